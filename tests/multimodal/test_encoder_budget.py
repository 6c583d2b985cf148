"""The scheduler's encoder budget on ints alone: a chunk stops before a media span whose encoder
rows the step has no room for, resumes inside a span at no cost, and spends one content hash once
per step."""

from __future__ import annotations

import numpy as np

from metrale.engine.request import Request
from metrale.engine.scheduler import Scheduler
from metrale.messages.sampling_params import SamplingParams
from metrale.messages.scheduler_output import ModelRunnerOutput
from metrale.multimodal.inputs import MultiModalInputs, MultiModalItem

PAD = 99


def media_request(rid: str, spans: list[tuple[int, int, str]], length: int) -> Request:
    """A prompt of `length` tokens with an item at each (offset, tokens, hash)."""
    ids = list(range(1, length + 1))
    items = []
    for offset, n, content_hash in spans:
        ids[offset:offset + n] = [PAD] * n
        items.append(MultiModalItem("image", np.zeros((1, 1), np.float32), (1, 1, n), offset, n, n, PAD,
                                    content_hash=content_hash))
    mm = MultiModalInputs(ids, items, np.tile(np.arange(length), (3, 1)), 0)
    return Request(rid, ids, SamplingParams(max_tokens=2), seed=0, multimodal=mm)


def step(s: Scheduler):
    plan, _ = s.schedule()
    sampled = {rid: 7 for rid in plan.num_scheduled_tokens if s.requests[rid].num_pending}
    s.update(plan, ModelRunnerOutput(sampled_token_ids=sampled))
    return plan


def test_a_chunk_stops_before_a_span_the_budget_cannot_hold():
    s = Scheduler(num_kv_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
                  max_num_encoder_tokens=10)
    s.add_request(media_request("a", [(2, 8, "x"), (12, 8, "y")], 24))
    assert step(s).num_scheduled_tokens == {"a": 12}  # x fits (8 rows), y (8 more) does not: stop at 12
    assert step(s).num_scheduled_tokens == {"a": 12}  # y, and the rest of the prompt


def test_a_resumed_span_costs_nothing_and_a_hash_is_spent_once():
    s = Scheduler(num_kv_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=5, max_model_len=128,
                  max_num_encoder_tokens=8)
    s.add_request(media_request("a", [(2, 8, "x")], 12))
    assert [step(s).num_scheduled_tokens["a"] for _ in range(3)] == [5, 5, 2]  # cut inside the span
    s = Scheduler(num_kv_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
                  max_num_encoder_tokens=8)
    s.add_request(media_request("a", [(2, 8, "x")], 12))
    s.add_request(media_request("b", [(1, 8, "x")], 12))  # the same image: no second charge
    s.add_request(media_request("c", [(1, 8, "z")], 12))  # another: waits a step
    assert step(s).num_scheduled_tokens == {"a": 12, "b": 12, "c": 1}  # c's text before its image
    assert step(s).num_scheduled_tokens["c"] == 11
