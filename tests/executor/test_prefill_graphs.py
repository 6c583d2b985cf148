"""Prefill graphs (executor/cuda_graphs.PrefillGraphs) on the CPU: the token buckets, which steps
fit, and a whole engine whose fresh prompts go through PrefillGraphs with each "replay" run
eagerly over the graph's static buffers (the Triton attention backend through the
interpreter): the padded prompt gives plain greedy decoding's tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from checkpoints import make_checkpoint
from fp8_checkpoints import quantize_checkpoint
from metrale import LLM, SamplingParams
from metrale.executor.cuda_graphs import PrefillGraphs, prefill_capture_sizes
from metrale.kernels import HAS_TRITON, interpret_mode
from metrale.kernels.fp8_gemv import MAX_M
from metrale.kernels.fp8_linear import rows_on_one_path
from test_verify_graphs import _EagerReplay, _with_triton_backends


def test_prefill_buckets_are_powers_of_two_up_to_the_budget_and_1024():
    assert prefill_capture_sizes(8192) == [16, 32, 64, 128, 256, 512, 1024]
    assert prefill_capture_sizes(100) == [16, 32, 64]
    assert prefill_capture_sizes(8) == []


class EagerPrefillGraphs(PrefillGraphs):
    """PrefillGraphs whose "graphs" run the captured forward eagerly at each replay."""

    def capture(self, pool=None):
        for tokens in self.sizes:
            self.graphs[tokens] = _EagerReplay(self, tokens)
        return pool


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# 1, 16 and 32 tokens fill a bucket exactly; 5 and 20 are padded (to 16 and 32)
PROMPTS = [[7], [3, 1, 4, 1, 5], [(i * 11) % 300 for i in range(16)], [(i * 7) % 300 for i in range(20)],
           [(i * 5) % 300 for i in range(32)]]


def _alone(llm, prompts):
    return [llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def _eager_prefill_graphs(llm):
    """The engine's runner with EagerPrefillGraphs of 16 and 32 tokens, as capture_cuda_graphs
    builds them (the runner's own minimum prompt)."""
    runner = llm.llm_engine.runner
    max_model_len = llm.llm_engine.model_config.max_model_len
    runner.prefill_graphs = EagerPrefillGraphs(runner, [16, 32], -(-max_model_len // runner.block_size),
                                               max_model_len, runner.prefill_graph_min_tokens)
    runner.prefill_graphs.capture()
    return runner


@pytest.mark.skipif(not (HAS_TRITON and interpret_mode()), reason="needs triton's CPU interpreter")
def test_prefill_graph_steps_give_plain_greedy_tokens(checkpoint_factory):
    path = checkpoint_factory("llama")
    kwargs = dict(dtype="float32", device="cpu", num_kv_blocks=64, max_num_seqs=4)
    plain = _alone(LLM(path, **kwargs), PROMPTS)
    llm = _with_triton_backends(LLM(path, **kwargs))
    runner = _eager_prefill_graphs(llm)
    assert runner.prefill_graphs.min_tokens == 1
    for cache in runner.caches.paged:  # what the padding rows read but never write: NaN garbage
        cache.fill_(float("nan"))
    assert _alone(llm, PROMPTS) == plain
    assert {t: g.replays for t, g in runner.prefill_graphs.graphs.items()} == {16: 3, 32: 2}
    # Two prompts in one step, and a prompt longer than the largest bucket: eager prefills
    batched = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]] + [{"prompt_token_ids": list(range(40))}],
                           GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched[:2]] == plain[:2]
    assert sum(g.replays for g in runner.prefill_graphs.graphs.values()) == 5


@pytest.mark.skipif(not (HAS_TRITON and interpret_mode()), reason="needs triton's CPU interpreter")
@pytest.mark.parametrize("activations", ["dynamic", "none"])
def test_fp8_models_take_prefill_graphs_from_their_minimum_prompt(tmp_path, activations):
    """A block-FP8 checkpoint: prompts of at least rows_on_one_path tokens replay the graphs (2
    with activations quantized, MAX_M + 1 without), shorter ones prefill eagerly, and the tokens
    are plain greedy decoding's."""
    source = make_checkpoint(str(tmp_path / "src"), "qwen3", hidden_size=80, intermediate_size=144)
    fp8, _ = quantize_checkpoint(source, str(tmp_path / "fp8"), str(tmp_path / "dequantized"))
    kwargs = dict(dtype="float32", device="cpu", num_kv_blocks=64, max_num_seqs=4,
                  activation_quantization=activations)
    prompts = [[7], [3, 1, 4], [3, 1, 4, 1, 5], PROMPTS[2], PROMPTS[3]]  # 1, 3, 5, 16 and 20 tokens
    plain = _alone(LLM(fp8, **kwargs), prompts)
    llm = _with_triton_backends(LLM(fp8, **kwargs))
    runner = _eager_prefill_graphs(llm)
    expected_min = 2 if activations == "dynamic" else MAX_M + 1
    assert runner.prefill_graph_min_tokens == expected_min
    for cache in runner.caches.paged:
        cache.fill_(float("nan"))
    assert _alone(llm, prompts) == plain
    # 1 token is eager either way, 3 tokens without activation quantization (the GEMV's rows)
    replays = {16: 3, 32: 1} if activations == "dynamic" else {16: 2, 32: 1}
    assert {t: g.replays for t, g in runner.prefill_graphs.graphs.items()} == replays


def test_rows_on_one_path():
    assert rows_on_one_path(128) == 2  # one row takes the W8A16 GEMV, two the W8A8 GEMM
    assert rows_on_one_path(None) == MAX_M + 1  # the GEMV up to MAX_M rows, then the W8A16 GEMM


def test_a_prefill_graph_takes_only_a_fresh_whole_prompt():
    graphs = PrefillGraphs.__new__(PrefillGraphs)
    graphs.max_batch, graphs.min_tokens = 32, 2

    def step(query_lens, seq_lens, sampled=1, host=True, drafts=None):
        layout = SimpleNamespace(num_seqs=len(query_lens), query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)
        return SimpleNamespace(layout=layout, host=SimpleNamespace() if host else None, logits_rows=drafts,
                               sampled_request_ids=["r"] * sampled, multimodal=None)

    assert graphs.can_run_step(step([20], [20]))
    assert not graphs.can_run_step(step([20], [30]))  # a cached prefix (or an earlier chunk) before it
    assert not graphs.can_run_step(step([20], [20], sampled=0))  # a chunk short of the prompt's end
    assert not graphs.can_run_step(step([33], [33]))  # past the largest bucket
    assert not graphs.can_run_step(step([5, 5], [5, 5], sampled=2))  # two sequences
    assert not graphs.can_run_step(step([20], [20], host=False))
    assert not graphs.can_run_step(step([1], [1]))  # shorter than min_tokens
    assert graphs.can_run_step(step([2], [2]))
