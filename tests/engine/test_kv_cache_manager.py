"""Block pool and block tables: no torch, milliseconds."""

import subprocess
import sys

import pytest

from metrale.engine.kv_cache_manager import BlockPool, KVCacheManager


def test_scheduler_and_block_manager_import_no_torch():
    code = ("import sys, metrale.engine.scheduler, metrale.engine.kv_cache_manager; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_allocate_grows_table_by_whole_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots("a", 1) == [0]
    assert kv.allocate_slots("a", 4) == []
    assert kv.allocate_slots("a", 9) == [1, 2]
    assert kv.get_block_table("a") == [0, 1, 2]
    assert kv.num_free_blocks == 5


def test_short_pool_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    kv.allocate_slots("a", 8)
    assert kv.allocate_slots("b", 8) is None
    assert kv.get_block_table("b") == []
    assert kv.num_free_blocks == 1
    assert kv.allocate_slots("a", 16) is None
    assert kv.get_block_table("a") == [0, 1]


def test_free_returns_every_block():
    kv = KVCacheManager(num_blocks=10, block_size=2)
    for i, n in enumerate([3, 5, 1, 7]):
        kv.allocate_slots(str(i), n)
    for i in range(4):
        kv.free(str(i))
    assert kv.num_free_blocks == kv.num_blocks
    kv.free("never-allocated")
    assert kv.num_free_blocks == kv.num_blocks


def test_pool_refcounts():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.release([b])
    with pytest.raises(AssertionError):
        pool.release([b])
    with pytest.raises(RuntimeError):
        pool.allocate(3)


def test_pool_needs_a_block():
    with pytest.raises(ValueError):
        BlockPool(0)
