"""Verify graphs (executor/cuda_graphs.py) on the CPU: the padding of a verify step into a graph of
q = 1 + k rows per sequence, as pure functions, and a whole engine whose verify steps go through
VerifyGraphs with each "replay" run eagerly over the graph's static buffers (the Triton attention
and MLA backends through the interpreter): the tokens are plain greedy decoding's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from metrale import LLM, SamplingParams
from metrale.executor.cuda_graphs import (VerifyGraphs, VerifyGraphSet, capture_sizes, fits_verify_graph,
                                          verify_capture_sizes, verify_rows)
from metrale.kernels import HAS_TRITON, interpret_mode
from metrale.layers.cache_backend import get_backend
from mla_checkpoints import make_mla_checkpoint
from qwen_mtp_checkpoints import DENSE, write_mtp_layer


def test_verify_capture_sizes_keep_the_rows_within_max_num_seqs():
    assert verify_capture_sizes(64, 3) == [1, 2, 4, 8, 16]
    assert verify_capture_sizes(4, 4) == [1]  # at least batch 1
    assert all(s * 5 <= 256 for s in verify_capture_sizes(256, 4)) and verify_capture_sizes(256, 4)[-1] == 48
    assert set(verify_capture_sizes(256, 1)) <= set(capture_sizes(256))


def test_verify_rows_place_each_sequence_at_q_rows_and_dummies_repeat_the_last_position():
    placed = verify_rows(query_lens=[3, 1, 2], seq_lens=[10, 5, 8], query_len=4)
    assert placed.padded_rows.tolist() == [0, 1, 2, 4, 8, 9]
    assert placed.positions.tolist() == [7, 8, 9, 9, 4, 4, 4, 4, 6, 7, 7, 7]


def test_fits_verify_graph():
    assert fits_verify_graph([3, 1], [10, 5], 4, query_len=4)
    assert not fits_verify_graph([5, 1], [10, 5], 6, query_len=4)  # more rows than the graph's q
    assert not fits_verify_graph([3, 1], [10, 5], 2, query_len=4)  # a row whose logits are not sampled
    assert not fits_verify_graph([3, 2], [10, 2], 5, query_len=4)  # a sequence that starts here (a prefill)


def _layout(query_lens, seq_lens):
    from metrale.layers.forward_context import BatchLayout

    n, rows = len(query_lens), sum(query_lens)
    return BatchLayout(
        positions=torch.zeros(rows, dtype=torch.int64), query_start_loc=torch.zeros(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=torch.zeros(n, 1, dtype=torch.int32),
        slot_mapping=torch.zeros(rows, dtype=torch.int64), state_slots=torch.zeros(n, dtype=torch.int32),
        has_initial_state=torch.ones(n, dtype=torch.int32), max_query_len=max(query_lens), max_seq_len=64,
        query_lens_cpu=query_lens, seq_lens_cpu=seq_lens, is_pure_decode=False)


def test_a_step_takes_the_smallest_verify_graph_that_holds_it():
    runner = SimpleNamespace(model=None, device=torch.device("cpu"), padding_slot=0)
    graphs = VerifyGraphSet(runner, max_num_seqs=16, num_speculative_tokens=3, max_blocks_per_seq=4, max_model_len=64)
    assert sorted(graphs.by_rows) == [2, 3, 4] and graphs.query_len == 4
    assert graphs.by_rows[2].sizes == [1, 2, 4, 8] and graphs.by_rows[4].sizes == [1, 2, 4]
    assert graphs._pick(_layout([2, 1, 2], [9, 5, 7])) is graphs.by_rows[2]  # one draft at most: 2 rows
    assert graphs._pick(_layout([4, 1], [9, 5])) is graphs.by_rows[4]
    assert graphs._pick(_layout([2] * 6, [9] * 6)) is graphs.by_rows[2]  # 6 sequences: only q = 2 has 8
    assert graphs._pick(_layout([3] * 6, [9] * 6)) is None and not graphs.can_run_step(_layout([3] * 6, [9] * 6), 18)
    assert graphs.can_run_step(_layout([3, 1], [9, 5]), 4)


def test_mla_verify_row_map():
    from metrale.layers.forward_context import BatchLayout
    from metrale.layers.mla.triton_backend import VerifyRowMap

    layout = BatchLayout(
        positions=torch.zeros(9, dtype=torch.int64), query_start_loc=torch.arange(4, dtype=torch.int32) * 3,
        seq_lens=torch.tensor([10, 4, 0], dtype=torch.int32), block_tables=torch.zeros(3, 1, dtype=torch.int32),
        slot_mapping=torch.full((9,), -1), state_slots=torch.zeros(3, dtype=torch.int32),
        has_initial_state=torch.ones(3, dtype=torch.int32), max_query_len=3, max_seq_len=16,
        query_lens_cpu=[3] * 3, seq_lens_cpu=[3] * 3, is_pure_decode=False, uniform_query_len=3,
        real_query_lens=torch.tensor([3, 1, 1], dtype=torch.int32))
    rows = VerifyRowMap.of(layout)
    assert rows.row_seq.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert rows.row_kv_len.tolist() == [8, 9, 10, 4, 4, 4, 0, 0, 0]  # a padded sequence reads nothing


class EagerVerifyGraphs(VerifyGraphs):
    """VerifyGraphs whose "graphs" run the captured forward eagerly at each replay, over the same
    static buffers: what a replay computes, on a machine without CUDA."""

    def capture(self, pool=None):
        for batch in self.sizes:
            self.graphs[batch] = _EagerReplay(self, batch)
            self.logits[batch] = self.hidden[batch] = None
        return pool


class _EagerReplay:
    def __init__(self, graphs, batch):
        self.graphs, self.batch = graphs, batch
        self.replays = 0

    def replay(self):
        self.replays += 1
        self.graphs.hidden[self.batch], self.graphs.logits[self.batch] = self.graphs._forward(self.batch)


def _with_triton_backends(llm):
    """The Triton attention / MLA backends (interpreted) under the PyTorch path of every other
    layer: the backends are what a verify graph's layout changes, and the rest interpreted would
    take minutes."""
    runner = llm.llm_engine.runner
    runner.backends = {kind: get_backend(kind, "triton", runner.device) for kind in runner.backends}
    return llm


# [200]: the tiny Llama's greedy output repeats a token there, so drafts are accepted
PROMPTS = [[200], [5, 6, 7, 8, 9] * 6]
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MTP = {"method": "mtp", "num_speculative_tokens": 2}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _tokens(llm):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.skipif(not (HAS_TRITON and interpret_mode()), reason="needs triton's CPU interpreter")
@pytest.mark.parametrize("family, spec", [("llama", SPEC), ("deepseek_v3", SPEC), ("llama", MTP)])
def test_verify_graph_steps_give_plain_greedy_tokens(family, spec, checkpoint_factory, tmp_path):
    path = make_mla_checkpoint(str(tmp_path), family) if family == "deepseek_v3" else checkpoint_factory(family)
    if spec is MTP:  # a passthrough MTP layer: the drafter reads the hidden states the graph kept
        write_mtp_layer(path, str(tmp_path / "mtp"), passthrough=True, **DENSE)
        path = str(tmp_path / "mtp")
    kwargs = dict(dtype="float32", device="cpu", num_kv_blocks=64, max_num_seqs=4)
    plain = _tokens(LLM(path, **kwargs))  # the PyTorch backends (tests/gpu: the Triton ones give the same)
    llm = _with_triton_backends(LLM(path, speculative_config=spec, **kwargs))
    runner = llm.llm_engine.runner
    max_model_len = llm.llm_engine.model_config.max_model_len
    runner.verify_graphs = EagerVerifyGraphs(runner, [1, 2, 4], -(-max_model_len // runner.block_size), max_model_len,
                                             1 + spec["num_speculative_tokens"])
    runner.verify_graphs.capture()
    assert _tokens(llm) == plain
    assert sum(g.replays for g in runner.verify_graphs.graphs.values()) > 0
    if family == "llama":
        assert llm.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0
    if spec is MTP:  # the drafter saw the same hidden states as without graphs: the same drafts accepted
        eager = _with_triton_backends(LLM(path, speculative_config=spec, **kwargs))
        assert _tokens(eager) == plain
        assert eager.llm_engine.scheduler.spec_stats == llm.llm_engine.scheduler.spec_stats
