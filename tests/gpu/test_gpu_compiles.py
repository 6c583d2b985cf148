"""After startup's kernel warm-up, serving compiles no new Triton kernel variant: a compile in
the middle of a run stalls that step for about a second (11 of 17 s of one measured run of the
nano-vllm workload, before the warm-up and the de-specialised batch arguments)."""

import importlib
import pkgutil
import random

import pytest
import torch

import metrale.kernels
from metrale import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def compiled_variants() -> dict[str, set]:
    """Per met kernel, the keys of the variants Triton has compiled so far in this process."""
    from triton.runtime.jit import JITFunction

    modules = [importlib.import_module(f"metrale.kernels.{m.name}")
               for m in pkgutil.iter_modules(metrale.kernels.__path__)]
    modules.append(importlib.import_module("metrale.layers.moe.triton_moe"))
    variants: dict[str, set] = {}
    for module in modules:
        for name, obj in vars(module).items():
            if isinstance(obj, JITFunction):
                for cache in obj.device_caches.values():
                    kernels = next(part for part in cache if isinstance(part, dict))
                    variants.setdefault(f"{module.__name__}.{name}", set()).update(map(str, kernels))
    return variants


@pytest.mark.parametrize("family", ["qwen3", "qwen3_next"])
def test_serving_after_warm_up_compiles_nothing(family, checkpoint_factory, tmp_path):
    if family == "qwen3_next":  # attention and Gated DeltaNet layers, prefix checkpoints
        from hybrid_checkpoints import make_hybrid_checkpoint

        path = make_hybrid_checkpoint(str(tmp_path), family)
    else:
        path = checkpoint_factory(family)
    llm = LLM(path, dtype="bfloat16", device="cuda", num_kv_blocks=512, max_num_seqs=16,
              max_num_batched_tokens=64)  # small budget: chunked prefill and mixed steps
    before = compiled_variants()
    assert sum(map(len, before.values())) > 0
    rng = random.Random(0)
    for wave in (1, 3, 16, 7, 2):  # batches growing and shrinking, ragged lengths, sampled and greedy
        prompts = [[rng.randrange(3, 384) for _ in range(rng.choice([1, 2, 5, 17, 40, 90, 200]))]
                   for _ in range(wave)]
        params = [SamplingParams(temperature=rng.choice([0.0, 0.7]), max_tokens=rng.randrange(1, 20), ignore_eos=True,
                                 seed=i) for i in range(wave)]
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    torch.cuda.synchronize()
    after = compiled_variants()
    new = {name: keys - before.get(name, set()) for name, keys in after.items() if keys - before.get(name, set())}
    assert not new, f"compiled after the warm-up: {new}"
