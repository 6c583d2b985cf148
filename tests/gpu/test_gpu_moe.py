"""MoE on the GPU: the Triton grouped GEMM at Qwen3-30B-A3B's shapes against the reference, and
tiny MoE checkpoints' greedy tokens (Triton path, CUDA graphs) against transformers."""

import random

import pytest
import torch

from checkpoints import load_reference, reference_greedy
from metrale import LLM, SamplingParams
from metrale.layers.moe import fused_experts_reference, select_experts

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("tokens", [1, 7, 64, 512])
def test_grouped_gemm_matches_reference_at_real_shapes(tokens):
    from metrale.layers.moe.triton_moe import fused_experts_triton

    torch.manual_seed(tokens)
    experts, hidden, inter, top_k = 128, 2048, 768, 8
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.02
    weights, ids = select_experts(torch.randn(tokens, experts, device="cuda"), top_k, "softmax", renormalize=True)
    expected = fused_experts_reference(x.float(), w13.float(), w2.float(), weights, ids)
    got = fused_experts_triton(x, w13, w2, weights, ids).float()
    assert (got - expected).norm() / expected.norm() < 2e-2


@pytest.mark.parametrize("family", ["qwen3_moe", "minimax_m2"])
def test_moe_greedy_matches_transformers_with_graphs(family, tmp_path):
    from moe_checkpoints import make_moe_checkpoint

    path = make_moe_checkpoint(str(tmp_path / family), family)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in (1, 17, 100, 250)]
    model = load_reference(path)
    expected = [reference_greedy(model, p, 10) for p in prompts]
    llm = LLM(path, dtype="float32", device="cuda", num_kv_blocks=256, max_num_seqs=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
