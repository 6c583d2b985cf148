"""FP8 under tensor and expert parallelism on the CPU (gloo, real worker processes): a rank's
shard of every weight keeps its scales, so tp=2 and ep=2 give one rank's greedy tokens (and,
without activation quantization, transformers' on the dequantized weights)."""

from __future__ import annotations

import pytest

from checkpoints import load_reference, make_checkpoint, reference_greedy
from fp8_checkpoints import quantize_checkpoint
from metrale import LLM, SamplingParams
from moe_checkpoints import make_moe_checkpoint
from parallel_cases import make_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SOURCES = {
    # intermediate 192: 96 rows and inputs per rank, three whole 32-blocks
    "qwen3": (lambda d: make_checkpoint(d, "qwen3", intermediate_size=192), (32, 32)),
    # 32-wide experts: 16 per rank under tp, so 16-blocks
    "qwen3_moe": (lambda d: make_moe_checkpoint(d, "qwen3_moe"), (16, 16)),
}
CASES = [("qwen3", dict(tp_size=2)), ("qwen3_moe", dict(tp_size=2)), ("qwen3_moe", dict(ep_size=2))]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            make, block = SOURCES[name]
            src = make(str(tmp_path_factory.mktemp(f"src_{name}")))
            root = tmp_path_factory.mktemp(f"fp8_{name}")
            fp8, dequantized = quantize_checkpoint(src, str(root / "fp8"), str(root / "ref"), block)
            reference = load_reference(dequantized)
            cache[name] = fp8, [reference_greedy(reference, p, 8) for p in make_prompts()]
        return cache[name]

    return get


def _greedy(path, **kwargs):
    llm = LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=16, **kwargs)
    try:
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in make_prompts()],
                                                              GREEDY, use_tqdm=False)]
    finally:
        llm.close()


@pytest.mark.parametrize("name, sizes", CASES, ids=lambda c: c if isinstance(c, str) else
                         "-".join(f"{k[:2]}{v}" for k, v in c.items()))
def test_fp8_split_over_ranks_gives_one_ranks_tokens(name, sizes, checkpoints):
    fp8, expected = checkpoints(name)
    assert _greedy(fp8, activation_quantization="none", **sizes) == expected
    assert _greedy(fp8, **sizes) == _greedy(fp8)


def test_online_fp8_split_over_ranks_gives_one_ranks_tokens(tmp_path):
    """--quantization fp8 quantizes each full tensor before a rank takes its shard: tp=2 holds
    exactly the weights one rank holds. (Its scale groups are 128 inputs wide, so the row-parallel
    layers need 256 inputs here: 64-wide heads, intermediate 256.)"""
    src = make_checkpoint(str(tmp_path / "src"), "qwen3", head_dim=64, intermediate_size=256)
    assert _greedy(src, quantization="fp8", tp_size=2) == _greedy(src, quantization="fp8")
