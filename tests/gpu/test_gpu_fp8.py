"""FP8 checkpoints on the GPU: the Triton FP8 paths (batch-1 GEMV, W8A8 GEMM, FP8 experts) under
CUDA graphs, against transformers on the dequantized weights (float32), and the FP8 KV-free
dummy configs starting at their real shapes."""

import random

import pytest
import torch

from checkpoints import load_reference, make_checkpoint, reference_greedy
from fp8_checkpoints import quantize_checkpoint
from metrale import LLM, SamplingParams
from moe_checkpoints import make_moe_checkpoint

pytestmark = pytest.mark.gpu

SOURCES = {"qwen3": lambda d: make_checkpoint(d, "qwen3", hidden_size=128, intermediate_size=256),
           "qwen3_moe": lambda d: make_moe_checkpoint(d, "qwen3_moe", hidden_size=128, moe_intermediate_size=64)}


def _prompts():
    rng = random.Random(0)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in (1, 17, 100, 250)]


@pytest.mark.parametrize("family", sorted(SOURCES))
def test_weight_only_fp8_matches_transformers_with_graphs(family, tmp_path):
    """W8A16 (activation quantization off): batch 1..4 through the FP8 GEMV, larger prefill
    steps through the W8A16 GEMM; both compute transformers' dequantized matmuls."""
    src = SOURCES[family](str(tmp_path / "src"))
    fp8, dequantized = quantize_checkpoint(src, str(tmp_path / "fp8"), str(tmp_path / "ref"), (32, 32))
    model = load_reference(dequantized)
    prompts = _prompts()
    expected = [reference_greedy(model, p, 10) for p in prompts]
    llm = LLM(fp8, dtype="float32", device="cuda", num_kv_blocks=256, max_num_seqs=8,
              activation_quantization="none")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("family", sorted(SOURCES))
def test_dynamic_fp8_on_the_gpu_equals_the_cpu_reference_path(family, tmp_path):
    """The W8A8 kernels (prefill) and the GEMV (decode) against met's own PyTorch reference of
    the same model: most greedy tokens agree (the GEMV skips activation quantization)."""
    src = SOURCES[family](str(tmp_path / "src"))
    fp8, _ = quantize_checkpoint(src, str(tmp_path / "fp8"), str(tmp_path / "ref"), (32, 32))
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=1)
    gpu = LLM(fp8, dtype="float32", device="cuda", num_kv_blocks=256, max_num_seqs=8)
    got = [o.outputs[0].token_ids[0] for o in gpu.generate([{"prompt_token_ids": p} for p in prompts], params)]
    gpu.close()
    cpu = LLM(fp8, dtype="float32", device="cpu", num_kv_blocks=256, max_num_seqs=8)
    want = [o.outputs[0].token_ids[0] for o in cpu.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert sum(g == w for g, w in zip(got, want)) >= len(prompts) - 1, (got, want)


@pytest.mark.parametrize("name", ["Qwen3-8B-FP8", "Qwen3-30B-A3B-FP8"])
def test_shipped_fp8_configs_start_and_generate(name):
    llm = LLM(name, load_format="dummy", hf_overrides={"num_hidden_layers": 2}, max_model_len=1024,
              max_num_seqs=4, skip_tokenizer_init=True)
    layer = llm.llm_engine.runner.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.self_attn.qkv_proj.fp8.group_n == 128  # real shapes: scales stay one per block
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_fp8_prefill_graphs_give_the_eager_prefills_tokens(tmp_path):
    """A dense FP8 model captures prefill graphs (prompts of 2+ tokens: the W8A8 GEMM at any row
    count from 2); each prompt alone gives the tokens of the same engine without them."""
    src = SOURCES["qwen3"](str(tmp_path / "src"))
    fp8, _ = quantize_checkpoint(src, str(tmp_path / "fp8"), str(tmp_path / "ref"), (32, 32))
    prompts = _prompts() + [[5, 9, 11]]  # 1, 17, 100, 250 and 3 tokens
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = {}
    for prefill_graphs in (False, True):
        llm = LLM(fp8, dtype="bfloat16", device="cuda", num_kv_blocks=256, max_num_seqs=8,
                  prefill_graphs=prefill_graphs)
        graphs = llm.llm_engine.runner.prefill_graphs
        assert (graphs is not None and graphs.min_tokens == 2) if prefill_graphs else graphs is None
        tokens[prefill_graphs] = [llm.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids
                                  for p in prompts]
        llm.close()
    assert tokens[True] == tokens[False]
