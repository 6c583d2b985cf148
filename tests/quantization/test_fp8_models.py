"""Block-FP8 checkpoints end to end on the CPU, against transformers on the dequantized weights.

The tests quantize tiny random checkpoints themselves (tests/fp8_checkpoints.py): [32, 32]
blocks, so hidden 80 and intermediate 144 leave partial edge blocks in both directions, and
the merged gate/up (144 rows each) straddles a block (its scales stay one per row) while q/k/v
(128/64/64 rows) compress to blocks. transformers runs the dequantized float32 copy.

- With activation quantization off (W8A16), met's dequantize-then-matmul path computes what
  transformers computes: greedy tokens are identical, batched with prompts of lengths 1..250,
  with chunked prefill, forced preemption and prefix hits, for dense, MoE (softmax and sigmoid
  routing) and hybrid families, with float32 and bfloat16 scales, and with modules_to_not_convert.
- With dynamic activation quantization (the default), tokens may fork; along transformers'
  greedy path met's log-probs of transformers' top tokens stay close and its argmax agrees at
  most positions.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from checkpoints import load_reference, make_checkpoint, reference_greedy
from fp8_checkpoints import quantize_checkpoint
from hybrid_checkpoints import make_hybrid_checkpoint
from metrale import LLM, SamplingParams
from moe_checkpoints import make_moe_checkpoint

NEW_TOKENS = 12
PROMPT_LENGTHS = (1, 3, 17, 64, 100, 181, 250)


def make_prompts() -> list[list[int]]:
    return [[(37 * i + 11 * n) % 380 + 3 for i in range(n)] for n in PROMPT_LENGTHS]

SOURCES = {
    "qwen3": lambda d: make_checkpoint(d, "qwen3", hidden_size=80, intermediate_size=144),
    "qwen3_moe": lambda d: make_moe_checkpoint(d, "qwen3_moe", hidden_size=80),
    "minimax_m2": lambda d: make_moe_checkpoint(d, "minimax_m2", hidden_size=80),
    "qwen3_next": lambda d: make_hybrid_checkpoint(d, "qwen3_next"),
    "glm4_moe": lambda d: make_moe_checkpoint(d, "glm4_moe", hidden_size=80),
}
# (source, scale dtype, modules_to_not_convert)
VARIANTS = {
    "qwen3": ("qwen3", torch.float32, ()),
    "qwen3-bf16-scales": ("qwen3", torch.bfloat16, ()),
    "qwen3-not-converted": ("qwen3", torch.float32, ("model.layers.1.mlp.down_proj", "self_attn.o_proj")),
    "qwen3_moe": ("qwen3_moe", torch.float32, ()),
    "minimax_m2": ("minimax_m2", torch.float32, ()),
    "qwen3_next": ("qwen3_next", torch.float32, ()),
    "glm4_moe": ("glm4_moe", torch.float32, ()),  # q/k/v bias, partial rotary, DeepSeek-style MoE
    # As the published Qwen3-Next FP8 checkpoint: in_proj_ba unquantized beside the FP8 in_proj_qkvz
    # that met merges it with, so met quantizes it as it loads.
    "qwen3_next-ba-unconverted": ("qwen3_next", torch.float32, ("linear_attn.in_proj_ba",)),
}


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """variant -> (FP8 checkpoint, its dequantized float32 twin)."""
    sources, cache = {}, {}

    def get(variant):
        if variant not in cache:
            source, scale_dtype, not_converted = VARIANTS[variant]
            if source not in sources:
                sources[source] = SOURCES[source](str(tmp_path_factory.mktemp(f"src_{source}")))
            root = tmp_path_factory.mktemp(f"fp8_{variant}")
            cache[variant] = quantize_checkpoint(sources[source], str(root / "fp8"), str(root / "dequantized"),
                                                 (32, 32), scale_dtype, not_converted)
        return cache[variant]

    return get


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]


@pytest.mark.parametrize("variant", sorted(v for v in VARIANTS if v != "qwen3_next-ba-unconverted"))
def test_weight_only_fp8_matches_transformers(variant, fp8_checkpoint):
    fp8, dequantized = fp8_checkpoint(variant)
    prompts = make_prompts()
    reference = load_reference(dequantized)
    expected = [reference_greedy(reference, p, NEW_TOKENS) for p in prompts]

    llm = LLM(fp8, dtype="float32", device="cpu", activation_quantization="none")
    assert _greedy(llm, prompts) == expected
    llm.close()
    # Chunked prefill (16-token steps) with preemption (280 tokens of KV for ~700), then the
    # same prompts again in the same engine: prefix hits.
    llm = LLM(fp8, dtype="float32", device="cpu", activation_quantization="none", max_num_batched_tokens=16,
              num_kv_blocks=70, block_size=4)
    assert _greedy(llm, prompts) == expected
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    hits = llm.llm_engine.scheduler.kv.prefix_hits_total
    assert _greedy(llm, prompts[-1:]) == expected[-1:]
    assert llm.llm_engine.scheduler.kv.prefix_hits_total > hits
    llm.close()


def test_layers_are_fp8_where_the_config_says(fp8_checkpoint):
    fp8, _ = fp8_checkpoint("qwen3-not-converted")
    llm = LLM(fp8, dtype="float32", device="cpu", num_kv_blocks=16)
    model = llm.llm_engine.runner.model
    layer0, layer1 = model.model.layers
    assert layer0.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert layer0.self_attn.qkv_proj.fp8.group_n == 32  # 128/64/64 rows: one scale per 32-row block
    assert layer0.mlp.gate_up_proj.fp8.group_n == 1  # 144-row gate and up straddle blocks: per-row scales
    assert layer0.mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert layer1.mlp.down_proj.weight.dtype == torch.float32  # listed in modules_to_not_convert
    assert layer0.self_attn.o_proj.weight.dtype == torch.float32  # listed by suffix
    assert model.lm_head.weight.dtype == torch.float32
    llm.close()


def _teacher_forced_logprobs(llm: LLM, prompt: list[int], path: list[int], k: int) -> list[dict[int, float]]:
    """met's top-k log-probs of the next token after prompt + path[:t], for every t."""
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=k)
    prefixes = [{"prompt_token_ids": prompt + path[:t]} for t in range(len(path))]
    outs = llm.generate(prefixes, params, use_tqdm=False)
    return [{token: lp.logprob for token, lp in o.outputs[0].logprobs[0].items()} for o in outs]


@pytest.mark.parametrize("variant", ["qwen3", "qwen3_moe", "qwen3_next", "qwen3_next-ba-unconverted"])
def test_dynamic_activation_quantization_tracks_transformers(variant, fp8_checkpoint):
    fp8, dequantized = fp8_checkpoint(variant)
    reference = load_reference(dequantized)
    llm = LLM(fp8, dtype="float32", device="cpu")
    if variant.endswith("ba-unconverted"):  # the merged projection is FP8, its b/a rows quantized at load
        assert llm.llm_engine.runner.model.model.layers[0].linear_attn.in_proj.weight.dtype == torch.float8_e4m3fn
    errors, agree, positions = [], 0, 0
    for prompt in make_prompts()[1:5]:
        path = reference_greedy(reference, prompt, NEW_TOKENS)
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + path])).logits[0, len(prompt) - 1:-1]
        expected = torch.log_softmax(logits.float(), dim=-1)
        for position, got in enumerate(_teacher_forced_logprobs(llm, prompt, path, 5)):
            top = expected[position].topk(5).indices.tolist()
            errors += [abs(got[t] - expected[position, t].item()) for t in top if t in got]
            agree += max(got, key=got.get) == top[0]
            positions += 1
    llm.close()
    # Measured: median 0.09 (qwen3), 0.11 (qwen3_moe), 0.19 (qwen3_next, whose 30 of 48 argmaxes
    # agree: these tiny random models are near-chaotic, with many near-ties); without activation
    # quantization every error is ~1e-6 and every argmax agrees.
    assert statistics.median(errors) < 0.25, statistics.median(errors)
    assert agree >= 0.6 * positions, (agree, positions)


def _quantize_projection_inputs(model: torch.nn.Module, group: int) -> None:
    """transformers' projections with their inputs quantized as met's W8A8 kernels quantize them."""
    from fp8_checkpoints import is_projection
    from metrale.kernels.fp8_math import fake_quantize_activation

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and is_projection(f"{name}.weight", module.weight):
            module.forward = (lambda m: lambda x: torch.nn.functional.linear(
                fake_quantize_activation(x, group), m.weight, m.bias))(module)


def test_dynamic_activation_quantization_is_what_it_says(fp8_checkpoint):
    """transformers with every projection's input quantized per token in groups of 32 gives
    exactly met's tokens: the dynamic path's only difference is that quantization."""
    fp8, dequantized = fp8_checkpoint("qwen3")
    reference = load_reference(dequantized)
    _quantize_projection_inputs(reference, 32)
    prompts = make_prompts()
    expected = [reference_greedy(reference, p, NEW_TOKENS) for p in prompts]
    llm = LLM(fp8, dtype="float32", device="cpu", max_num_batched_tokens=16)
    assert _greedy(llm, prompts) == expected
    llm.close()
