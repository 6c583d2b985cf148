"""Automatic prefix caching: block hashes, LRU reuse, copy-on-write of a fully cached prompt."""

from metrale.engine.block_pool import block_hash
from metrale.engine.kv_cache_coordinator import KVCacheCoordinator
from metrale.engine.request import Request
from metrale.messages.sampling_params import SamplingParams
from metrale.engine.scheduler import Scheduler
from metrale.messages.scheduler_output import ModelRunnerOutput


def test_hash_chains_over_the_whole_prefix():
    a = block_hash(None, [1, 2, 3, 4])
    assert block_hash(None, [1, 2, 3, 4]) == a
    assert block_hash(a, [5, 6]) != block_hash(block_hash(None, [9, 9, 9, 9]), [5, 6])  # same block, other prefix
    assert block_hash(None, [1, 2, 3, 4], ("adapter-a",)) != a
    assert len(a) == 32  # SHA-256


def _computed(kv, rid, tokens):
    """A request admitted, computed whole, its blocks offered to later requests."""
    r = Request(rid, list(tokens), SamplingParams(max_tokens=1), seed=0, extra_keys=extra.get(rid, ()))
    kv.admit(r, kv.lookup(r), len(tokens))
    kv.cache_computed(r, len(tokens))
    return r


extra: dict = {}


def _hit(kv, rid, tokens, keys=()):
    return kv.lookup(Request(rid, list(tokens), SamplingParams(max_tokens=1), seed=0, extra_keys=keys))


def test_shared_prefix_blocks_are_reused_and_kept_after_free():
    kv = KVCacheCoordinator(num_blocks=8, block_size=4, enable_prefix_caching=True)
    tokens = list(range(10))
    _computed(kv, "a", tokens)
    table_a = kv.get_block_table("a")
    assert _hit(kv, "b", tokens[:8] + [99, 98]).blocks == table_a[:2]
    kv.free("a")
    assert kv.num_free_blocks == 8
    hit = _hit(kv, "c", tokens)
    assert hit.blocks == table_a[:2] and hit.num_tokens == 8
    kv.admit(Request("c", tokens, SamplingParams(max_tokens=1), seed=0), hit, 10)
    assert kv.get_block_table("c")[:2] == table_a[:2]
    assert kv.num_free_blocks == 5


def test_eviction_takes_least_recently_used_and_forgets_hash():
    kv = KVCacheCoordinator(num_blocks=4, block_size=2, enable_prefix_caching=True)
    _computed(kv, "a", [1, 2, 3, 4])
    kv.free("a")
    _computed(kv, "b", [9] * 8)  # takes all four, evicting a's cached blocks
    assert _hit(kv, "c", [1, 2, 3, 4, 5]).blocks == []


def test_other_extra_keys_never_share():
    kv = KVCacheCoordinator(num_blocks=4, block_size=2, enable_prefix_caching=True)
    extra["a"] = ("lora-1",)
    _computed(kv, "a", [1, 2, 3, 4])
    assert _hit(kv, "b", [1, 2, 3, 4, 5], ("lora-2",)).blocks == []
    assert len(_hit(kv, "c", [1, 2, 3, 4, 5], ("lora-1",)).blocks) == 2


def _request(rid, tokens, max_tokens=2):
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), seed=0)


def _step(s):
    plan, _ = s.schedule()
    sampled = {rid: 5 for rid in plan.num_scheduled_tokens if s.requests[rid].num_pending}
    s.update(plan, ModelRunnerOutput(sampled_token_ids=sampled))
    return plan


def test_repeated_prompt_computes_one_token_in_a_private_copy():
    s = Scheduler(num_kv_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                  enable_prefix_caching=True)
    prompt = list(range(1, 13))  # three full blocks
    s.add_request(_request("a", prompt))
    while s.has_unfinished:
        _step(s)
    s.add_request(_request("b", prompt))
    plan = _step(s)
    assert plan.num_scheduled_tokens == {"b": 1}
    (new,) = plan.new_requests
    assert new.num_computed_tokens == 11
    (src, dst), = plan.block_copies
    assert new.block_ids[2] == dst and src != dst
    assert s.stats().prefix_cache_hits_total == 11
    while s.has_unfinished:
        _step(s)
    s.schedule()
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_partial_last_block_computes_only_the_tail():
    s = Scheduler(num_kv_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                  enable_prefix_caching=True)
    s.add_request(_request("a", list(range(1, 11))))
    while s.has_unfinished:
        _step(s)
    s.add_request(_request("b", list(range(1, 11)) + [42, 43]))
    plan = _step(s)
    assert plan.num_scheduled_tokens == {"b": 4} and not plan.block_copies  # 8 cached + 4 new
