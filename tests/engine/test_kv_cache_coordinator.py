"""The cache coordinator and its pools (blocks, state slots): no torch, milliseconds."""

import subprocess
import sys

import pytest

from metrale.engine.block_pool import BlockPool
from metrale.engine.kv_cache_coordinator import KVCacheCoordinator, PrefixHit
from metrale.engine.request import Request
from metrale.engine.state_slots import StateSlotPool
from metrale.messages.sampling_params import SamplingParams


def test_scheduler_and_cache_coordinator_import_no_torch():
    code = ("import sys, metrale.engine.scheduler, metrale.engine.kv_cache_coordinator; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def request(rid: str, tokens) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), seed=0)


def admit(kv: KVCacheCoordinator, rid: str, tokens, end: int | None = None):
    r = request(rid, tokens)
    return r, kv.admit(r, kv.lookup(r), len(r.token_ids) if end is None else end)


def test_tables_grow_by_whole_blocks():
    kv = KVCacheCoordinator(num_blocks=8, block_size=4)
    _, admission = admit(kv, "a", [1], end=1)
    assert admission.block_table == [0] and admission.state_slot == -1
    assert kv.grow("a", 4) == []
    assert kv.grow("a", 9) == [1, 2]
    assert kv.get_block_table("a") == [0, 1, 2]
    assert kv.num_free_blocks == 5


def test_short_pool_changes_nothing():
    kv = KVCacheCoordinator(num_blocks=3, block_size=4)
    admit(kv, "a", range(8))
    _, admission = admit(kv, "b", range(8))
    assert admission is None and kv.get_block_table("b") == []
    assert kv.num_free_blocks == 1
    assert kv.grow("a", 16) is None
    assert kv.get_block_table("a") == [0, 1]


def test_free_returns_every_block_and_slot():
    kv = KVCacheCoordinator(num_blocks=10, block_size=2, num_state_slots=4)
    for i, n in enumerate([3, 5, 1, 7]):
        _, admission = admit(kv, str(i), range(n))
        assert admission.state_slot == i
    _, admission = admit(kv, "5", range(1))
    assert admission is None, "no running slot left"
    for i in range(4):
        kv.free(str(i))
    assert kv.num_free_blocks == kv.num_blocks and kv.num_free_state_slots == 4
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


def test_state_slots_run_out_and_come_back():
    pool = StateSlotPool(num_running=2, num_checkpoints=0)
    a, b = pool.allocate(), pool.allocate()
    assert (a, b) == (0, 1) and pool.allocate() is None
    pool.release(a)
    assert pool.allocate() == a
    with pytest.raises(AssertionError):
        pool.release(b) or pool.release(b)


def test_checkpoints_are_pinned_for_their_step_then_evicted_least_recent_first():
    pool = StateSlotPool(num_running=1, num_checkpoints=2)
    x = pool.save_checkpoint(b"x")
    y = pool.save_checkpoint(b"y")
    assert {x, y} == {1, 2}
    assert pool.save_checkpoint(b"z") is None, "both are pinned by the step that saves them"
    pool.end_step()
    pool.use_checkpoint(x)  # a restore this step: x is pinned, then most recently used
    z = pool.save_checkpoint(b"z")
    assert z == y and pool.checkpoint(b"y") is None, "the evicted checkpoint is forgotten"
    pool.end_step()
    assert pool.save_checkpoint(b"w") == x, "both unpinned at once: x, first in the pin list, is the oldest"
    assert pool.checkpoint(b"x") is None and pool.checkpoint(b"z") == z


def test_hybrid_hits_resume_only_from_a_checkpoint_before_the_last_token():
    kv = KVCacheCoordinator(num_blocks=16, block_size=4, num_state_slots=2, num_checkpoint_slots=2,
                            enable_prefix_caching=True)
    prompt = list(range(1, 13))  # 12 tokens: the checkpoint goes at 8 (the last boundary before token 11)
    first, admission = admit(kv, "a", prompt)
    assert admission.end == 8, "the first chunk is cut at the checkpoint position"
    first.num_computed_tokens = 8
    save = kv.save_checkpoint(first, 8)
    assert save is not None and save[0] == admission.state_slot
    assert kv.lookup(request("b", prompt)) == PrefixHit(), "blocks are not cached yet: no hit"
    kv.cache_computed(first, 8)
    kv.end_step()
    hit = kv.lookup(request("b", prompt))
    assert hit.num_tokens == 8 and hit.state_source == save[1] and hit.copy_last_from is None
    second, admission = admit(kv, "b", prompt)
    assert admission.state_restores == [(save[1], admission.state_slot)] and admission.end == 12
    assert kv.lookup(request("c", prompt[:9] + [99, 98, 97])).num_tokens == 8, "a longer prompt shares it too"
    assert kv.lookup(request("d", prompt[:7] + [0] * 5)).num_tokens == 0, "another prefix does not"
    assert kv.prefix_hits_total == 8 and kv.prefix_queries_total == 24


def test_without_checkpoint_slots_a_hybrid_model_has_no_prefix_cache():
    kv = KVCacheCoordinator(num_blocks=8, block_size=4, num_state_slots=2, num_checkpoint_slots=0,
                            enable_prefix_caching=True)
    assert not kv.enable_prefix_caching
    assert admit(kv, "a", range(12))[1].end == 12
