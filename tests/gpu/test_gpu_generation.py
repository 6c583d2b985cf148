"""On the GPU: the Triton backend, fused kernels and CUDA graphs give the same greedy tokens as
the PyTorch backend and as transformers (float32, tiny checkpoints)."""

import random

import pytest
import torch

from checkpoints import FAMILIES, load_reference, reference_greedy
from metrale import LLM, SamplingParams

pytestmark = pytest.mark.gpu

LENGTHS = [1, 3, 17, 64, 100, 181, 250]


def prompts():
    rng = random.Random(0)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in LENGTHS]


def run(path, **kw):
    llm = LLM(path, dtype="float32", device="cuda", num_kv_blocks=256, max_num_seqs=16, **kw)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_triton_graphs_eager_torch_and_transformers_agree(family, checkpoint_factory):
    path = checkpoint_factory(family)
    model = load_reference(path)
    expected = [reference_greedy(model, p, 12) for p in prompts()]
    llm, graphs = run(path, attention_backend="triton")
    assert llm.llm_engine.runner.graphs is not None
    assert llm.llm_engine.async_scheduling  # the default on CUDA
    _, synchronous = run(path, attention_backend="triton", async_scheduling=False)
    _, eager = run(path, attention_backend="triton", enforce_eager=True)
    _, torch_backend = run(path, attention_backend="torch", enforce_eager=True)
    _, chunked = run(path, attention_backend="triton", max_num_batched_tokens=16)
    _, no_pdl = run(path, attention_backend="triton", programmatic_launch=False)
    reference_llm, reference = run(path, forward="reference")
    assert reference_llm.llm_engine.runner.graphs is None and reference_llm.llm_engine.runner.reference
    assert graphs == expected
    assert synchronous == expected
    assert eager == expected
    assert torch_backend == expected
    assert chunked == expected
    assert no_pdl == expected  # programmatic dependent launch (on by default on Hopper) changes nothing
    assert reference == expected  # --forward reference: the PyTorch path of every layer


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_batch_of_one_matches_transformers(family, checkpoint_factory):
    """One sequence at a time: decode steps of one token take the Triton GEMV in the row-parallel
    layers (o_proj, down_proj), inside the captured graph of batch size 1."""
    path = checkpoint_factory(family)
    model = load_reference(path)
    llm = LLM(path, dtype="float32", device="cuda", num_kv_blocks=256, max_num_seqs=16)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for prompt in prompts()[::2]:
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == reference_greedy(model, prompt, 12)


def test_released_graphs_fall_back_to_eager_steps(checkpoint_factory):
    """What a multi-rank shutdown does first (graphs hold captured collectives); steps after it
    run eagerly and give the same tokens."""
    llm, before = run(checkpoint_factory("qwen3"), attention_backend="triton")
    llm.llm_engine.runner.release_cuda_graphs()
    assert llm.llm_engine.runner.graphs is None
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    after = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts()], params)]
    assert after == before


def test_bf16_triton_close_to_torch_backend(checkpoint_factory):
    """bf16 is not bit-exact across kernels: vLLM's rule, each side's token in the other's top 5
    at the first divergence."""
    path = checkpoint_factory("qwen3")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)

    def go(backend):
        llm = LLM(path, dtype="bfloat16", device="cuda", num_kv_blocks=256, attention_backend=backend)
        return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts()], params)]

    for a, b in zip(go("triton"), go("torch")):
        for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            if ta != tb:
                assert ta in b.logprobs[i] and tb in a.logprobs[i]
                break


def test_seeded_sampling_on_gpu_is_batch_invariant(checkpoint_factory):
    llm = LLM(checkpoint_factory("llama"), dtype="bfloat16", device="cuda", num_kv_blocks=256)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=11, max_tokens=16, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": prompts()[3]}, params)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts()], [other, other, other, params, other, other, other])
    assert batch[3].outputs[0].token_ids == alone


def test_memory_plan_predicts_startup_use(checkpoint_factory):
    """The plan's weights + KV + activation reserve within 5% of what torch holds after a full step."""
    llm = LLM("Qwen3-0.6B", load_format="dummy", skip_tokenizer_init=True, gpu_memory_utilization=0.5,
              max_num_seqs=64)
    plan = llm.llm_engine.memory_plan
    rng = random.Random(0)
    llm.generate([{"prompt_token_ids": [rng.randrange(1000) for _ in range(4000)]} for _ in range(4)],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    runner = llm.llm_engine.runner
    graphs = sum(g.memory_bytes for g in (runner.graphs, runner.verify_graphs, runner.prefill_graphs) if g is not None)
    held = torch.cuda.max_memory_reserved() - graphs
    assert abs(plan.predicted_bytes - held) / held < 0.05, (plan.table(), held)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_graphs_give_transformers_tokens(family, checkpoint_factory, monkeypatch):
    """Each prompt alone: its prefill replays a prefill graph (padded to a token bucket, or eager
    past the largest one) and the tokens are transformers'."""
    path = checkpoint_factory(family)
    model = load_reference(path)
    llm = LLM(path, dtype="float32", device="cuda", num_kv_blocks=256, max_num_seqs=16, attention_backend="triton")
    runner = llm.llm_engine.runner
    if not runner.supports_prefill_graphs:
        assert runner.prefill_graphs is None
        pytest.skip(f"{family}: no prefill graphs (MoE, quantized or a backend without them)")
    assert runner.prefill_graphs is not None
    replays = []
    run = runner.prefill_graphs.run
    monkeypatch.setattr(runner.prefill_graphs, "run", lambda batch: replays.append(1) or run(batch))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for prompt in prompts():
        got = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
        assert got == reference_greedy(model, prompt, 12), len(prompt)
    assert len(replays) == len(LENGTHS)
    off = LLM(path, dtype="float32", device="cuda", num_kv_blocks=256, max_num_seqs=16, attention_backend="triton",
              prefill_graphs=False)
    assert off.llm_engine.runner.prefill_graphs is None and off.llm_engine.runner.graphs is not None
