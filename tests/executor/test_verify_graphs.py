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
                                          verify_capture_sizes, verify_row_limit, verify_rows)
from metrale.kernels import HAS_TRITON, interpret_mode
from metrale.layers.cache_backend import get_backend
from mla_checkpoints import make_mla_checkpoint
from qwen_mtp_checkpoints import DENSE, write_mtp_layer


def test_verify_capture_sizes_keep_the_rows_within_the_row_limit():
    assert verify_capture_sizes(64, 3, max_rows=64) == [1, 2, 4, 8, 16]
    assert verify_capture_sizes(4, 4, max_rows=4) == [1]  # at least batch 1
    assert all(s * 5 <= 256 for s in verify_capture_sizes(256, 4, 256)) and verify_capture_sizes(256, 4, 256)[-1] == 48
    assert set(verify_capture_sizes(256, 1, 512)) <= set(capture_sizes(256))
    # Never more sequences than the decode graphs hold, whatever the rows allow.
    assert verify_capture_sizes(16, 3, max_rows=512) == capture_sizes(16)


def test_verify_row_limit():
    # A small max_num_seqs gets graphs for all its sequences (up to 512 rows, the step's budget).
    assert verify_row_limit(16, 8192) == 512
    assert verify_row_limit(16, 48) == 48  # no step has more rows than its token budget
    assert verify_row_limit(1024, 8192) == 1024  # at least max_num_seqs, as the decode graphs
    assert verify_capture_sizes(16, 3, verify_row_limit(16, 8192)) == capture_sizes(16)


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
    graphs = VerifyGraphSet(runner, max_num_seqs=16, num_speculative_tokens=3, max_blocks_per_seq=4, max_model_len=64,
                            max_rows=16)
    assert sorted(graphs.by_rows) == [2, 3, 4] and graphs.query_len == 4
    assert graphs.by_rows[2].sizes == [1, 2, 4, 8] and graphs.by_rows[4].sizes == [1, 2, 4]
    assert graphs._pick(_layout([2, 1, 2], [9, 5, 7])) is graphs.by_rows[2]  # one draft at most: 2 rows
    assert graphs._pick(_layout([4, 1], [9, 5])) is graphs.by_rows[4]
    assert graphs._pick(_layout([2] * 6, [9] * 6)) is graphs.by_rows[2]  # 6 sequences: only q = 2 has 8
    step = SimpleNamespace(layout=_layout([3] * 6, [9] * 6), host=SimpleNamespace())
    assert graphs._pick(step.layout) is None and not graphs.can_run_step(step, 18)
    step = SimpleNamespace(layout=_layout([3, 1], [9, 5]), host=SimpleNamespace())
    assert graphs.can_run_step(step, 4)
    step.host = None  # inputs the device holds (a placeholder, rows moved back): copied from the device
    assert graphs.can_run_step(step, 4)


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
        return pool


class _EagerReplay:
    def __init__(self, graphs, batch):
        self.graphs, self.batch = graphs, batch
        self.replays = 0

    def replay(self):
        self.replays += 1
        self.graphs.outputs[self.batch] = self.graphs._forward(self.batch)


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


def test_the_greedy_verdict_on_padded_rows_is_the_greedy_rule():
    from metrale.executor.rejection_sampler import verify_drafts_greedy, verify_greedy_padded

    torch.manual_seed(0)
    q, vocab = 4, 7
    lens = [4, 1, 3, 2, 4]  # real rows of each sequence: its last token and len - 1 drafts
    logits = torch.randn(len(lens) * q, vocab)
    input_ids = torch.randint(0, vocab, (len(lens) * q,))
    target = logits.argmax(dim=-1)
    input_ids[1:3] = target[0:2]  # sequence 0: its first two drafts are the argmax, its third is not
    input_ids[3] = (target[2] + 1) % vocab
    input_ids[13:15] = target[12:14]  # sequence 3: its one draft is accepted (row 14 is a dummy row)
    input_ids[17:20] = target[16:19]  # sequence 4: all three accepted, the bonus token after them
    verdict = verify_greedy_padded(logits, input_ids, torch.tensor(lens, dtype=torch.int32), q)
    real = [i * q + t for i, n in enumerate(lens) for t in range(n)]
    drafts = [input_ids[i * q + 1:i * q + n].tolist() for i, n in enumerate(lens)]
    accepted, tokens = verify_drafts_greedy(logits[real], drafts)
    assert verdict[1].tolist() == accepted.tolist() == [2, 0, accepted[2].item(), 1, 3]
    assert verdict[0].tolist() == tokens.tolist()
    assert verdict[0, 4] == target[19]


def _count_calls(monkeypatch, obj, name):
    calls = []
    original = getattr(obj, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(obj, name, counted)
    return calls


@pytest.mark.skipif(not (HAS_TRITON and interpret_mode()), reason="needs triton's CPU interpreter")
def test_verify_graph_steps_take_the_greedy_verdict_and_sampled_rows_their_logits(checkpoint_factory,
                                                                                 monkeypatch):
    """All-greedy verify steps take the graph's verdict (no rejection sampler on the host); a step
    with a sampled row reads the graph's logits instead, and gives the eager verify steps' tokens."""
    path = checkpoint_factory("llama")
    kwargs = dict(dtype="float32", device="cpu", num_kv_blocks=64, max_num_seqs=4)

    def engine(graphs: bool):
        llm = _with_triton_backends(LLM(path, speculative_config=SPEC, **kwargs))
        runner = llm.llm_engine.runner
        if graphs:
            max_model_len = llm.llm_engine.model_config.max_model_len
            runner.verify_graphs = EagerVerifyGraphs(runner, [1, 2, 4], -(-max_model_len // runner.block_size),
                                                     max_model_len, 1 + SPEC["num_speculative_tokens"])
            runner.verify_graphs.capture()
        return llm, runner

    llm, runner = engine(graphs=True)
    verdicts = _count_calls(monkeypatch, runner, "_take_verdict")
    rejections = _count_calls(monkeypatch, runner, "_sample_and_verify")
    assert _tokens(llm) == _tokens(LLM(path, **kwargs))
    replays = sum(g.replays for g in runner.verify_graphs.graphs.values())
    assert replays > 0 and len(verdicts) == replays and not rejections
    # One request alone, always drafting: steps with no dummy rows (the graph's rows are the step's)
    alone = [{"prompt_token_ids": PROMPTS[0]}]
    assert ([o.outputs[0].token_ids for o in llm.generate(alone, GREEDY, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in LLM(path, **kwargs).generate(alone, GREEDY, use_tqdm=False)])
    assert sum(g.replays for g in runner.verify_graphs.graphs.values()) > replays

    mixed = [GREEDY, SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)]  # [200] drafts
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, mixed, use_tqdm=False)]
    assert len(rejections) > 0
    eager, _ = engine(graphs=False)
    assert got == [o.outputs[0].token_ids for o in eager.generate(prompts, mixed, use_tqdm=False)]


@pytest.mark.skipif(not (HAS_TRITON and interpret_mode()), reason="needs triton's CPU interpreter")
def test_steps_planned_over_drafts_in_flight_replay_from_the_device(checkpoint_factory, tmp_path, monkeypatch):
    """Asynchronous scheduling with MTP drafts: a verify step planned over the one in flight has
    its drafts, positions, slots and lengths on the device alone; the graph copies them from there
    (padded to the graph's rows where a sequence drafts fewer) and gives plain greedy's tokens."""
    path = checkpoint_factory("llama")
    write_mtp_layer(path, str(tmp_path / "mtp"), passthrough=True, **DENSE)
    kwargs = dict(dtype="float32", device="cpu", num_kv_blocks=64, max_num_seqs=4)
    plain = _tokens(LLM(path, **kwargs))
    llm = _with_triton_backends(LLM(str(tmp_path / "mtp"), speculative_config=MTP, async_scheduling=True, **kwargs))
    runner = llm.llm_engine.runner
    max_model_len = llm.llm_engine.model_config.max_model_len
    runner.verify_graphs = EagerVerifyGraphs(runner, [1, 2, 4], -(-max_model_len // runner.block_size), max_model_len,
                                             1 + MTP["num_speculative_tokens"])
    runner.verify_graphs.capture()
    from_device = _count_calls(monkeypatch, runner.verify_graphs, "_copy_from_device")
    assert _tokens(llm) == plain
    assert len(from_device) > 0
    assert llm.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0
