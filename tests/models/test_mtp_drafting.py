"""MTP (next-n) drafting (executor/drafters/mtp.py) on tiny DeepSeek-V3 and GLM-4.5 checkpoints with
a next-n layer written in the published layout (tests/models/test_mtp_weights.py's add_nextn_layer).

- Lossless greedy: tokens with MTP drafting equal transformers' (which ignores the layer; the
  engine's tokens without speculation equal them too, tests/models/test_mtp_weights.py), batched
  prompts of mixed lengths, k = 1 and chained k = 2, under chunked prefill with forced
  preemption, prefix hits and tp=2.
- The drafter itself: every draft the engine proposes equals a plain-torch reference of the MTP
  forward (transformers' own decoder-layer module holding the checkpoint's MTP tensors, over the
  trunk's final hidden states of the request's known tokens), k = 1 and chained k = 2.
- Acceptance: a next-n layer built to propose the last token again (the embedding passed straight
  to a tied head) is accepted wherever the target repeats a token.
- The MTP layer's cache is counted in the plan; a checkpoint without MTP layers is refused.
"""

import copy
import os

import pytest
import torch

from checkpoints import load_reference, reference_greedy
from metrale import LLM, SamplingParams
from metrale.config.engine_args import EngineArgs
from metrale.config.model_config import load_model_config
from metrale.executor.drafters.mtp import MTPDrafter
from metrale.models.registry import supported_architectures
from metrale.startup.memory import plan_memory
from mla_checkpoints import make_mla_checkpoint
from moe_checkpoints import make_moe_checkpoint
from speculative_cases import make_prompts
from test_mtp_weights import FAMILIES, add_nextn_layer

NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _make_base(family: str, path: str) -> str:
    return make_mla_checkpoint(path) if family == "deepseek_v3" else make_moe_checkpoint(path, "glm4_moe")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (base checkpoint, with its next-n layer, the MTP tensors, transformers' tokens)."""
    cache = {}

    def get(family):
        if family not in cache:
            root = tmp_path_factory.mktemp(f"mtp_draft_{family}")
            base = _make_base(family, str(root / "base"))
            layers, own_embedding = FAMILIES[family]
            mtp = add_nextn_layer(base, str(root / "with_mtp"), layers, own_embedding)
            reference = load_reference(base)
            expected = [reference_greedy(reference, p, NEW_TOKENS) for p in make_prompts()]
            cache[family] = base, str(root / "with_mtp"), mtp, expected
        return cache[family]

    return get


def mtp_engine(path: str, k: int = 1, **kwargs) -> LLM:
    return LLM(path, dtype="float32", device="cpu",
               speculative_config={"method": "mtp", "num_speculative_tokens": k}, **kwargs)


def greedy(llm: LLM, prompts=None) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in (prompts or make_prompts())]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def assert_drafted_and_idle(llm: LLM) -> None:
    stats = llm.llm_engine.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens > 0, stats
    kv = llm.llm_engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("family, k", [("deepseek_v3", 1), ("deepseek_v3", 2), ("glm4_moe", 2)])
def test_greedy_tokens_equal_transformers(checkpoints, family, k):
    _, path, _, expected = checkpoints(family)
    llm = mtp_engine(path, k)
    assert greedy(llm) == expected
    assert_drafted_and_idle(llm)
    assert llm.llm_engine.runner.drafter.sha256 == llm.llm_engine.runner.model.mtp_sha256 is not None


def test_chunked_prefill_and_preemption(checkpoints):
    _, path, _, expected = checkpoints("deepseek_v3")
    llm = mtp_engine(path, 2, max_num_batched_tokens=12, num_kv_blocks=40, block_size=4)
    assert greedy(llm) == expected
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert_drafted_and_idle(llm)


def test_prefix_hits(checkpoints):
    _, path, _, expected = checkpoints("deepseek_v3")
    llm = mtp_engine(path, 1, block_size=8, enable_prefix_caching=True)
    assert greedy(llm) == expected
    hits = llm.llm_engine.scheduler.kv.prefix_hits_total
    assert greedy(llm) == expected
    assert llm.llm_engine.scheduler.kv.prefix_hits_total > hits


def test_tensor_parallel_two_ranks(checkpoints):
    _, path, _, expected = checkpoints("glm4_moe")
    llm = mtp_engine(path, 2, tp_size=2, max_num_batched_tokens=16)
    assert greedy(llm) == expected
    assert_drafted_and_idle(llm)


# -- the drafter against a plain-torch reference --------------------------------------------------


def block_as_transformers_loads_it(base: str, own: dict, layers: int, scratch: str) -> torch.nn.Module:
    """transformers' decoder layer holding the MTP block's tensors: the base checkpoint with its
    last layer's tensors replaced by them, loaded by transformers (which converts the per-expert
    tensors into its fused layout), and that last layer taken out."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(base, scratch)
    weights = load_file(os.path.join(scratch, "model.safetensors"))
    last = f"model.layers.{layers - 1}."
    for name in [n for n in weights if n.startswith(last)]:
        weights[name] = own[name[len(last):]]
    save_file(weights, os.path.join(scratch, "model.safetensors"), metadata={"format": "pt"})
    model = load_reference(scratch)
    model.config._attn_implementation = "eager"
    return model.model.layers[-1]


class ReferenceMTP:
    """The MTP forward in plain torch: transformers' decoder layer of the family (a copy of the
    reference's last layer) holding the checkpoint's MTP block tensors, and the MTP tensors'
    enorm / hnorm / eh_proj / shared_head, over transformers' trunk."""

    def __init__(self, base: str, mtp: dict, layers: int, scratch: str):
        self.model = load_reference(base)
        self.model.config._attn_implementation = "eager"
        prefix = f"model.layers.{layers}."
        own = {name[len(prefix):]: t for name, t in mtp.items()}
        self.block = block_as_transformers_loads_it(base, own, layers, scratch)
        norm = self.model.model.norm
        self.enorm, self.hnorm, self.head_norm = (copy.deepcopy(norm) for _ in range(3))
        self.enorm.weight.data, self.hnorm.weight.data = own["enorm.weight"], own["hnorm.weight"]
        self.head_norm.weight.data = own["shared_head.norm.weight"]
        self.eh_proj, self.head = own["eh_proj.weight"], own["shared_head.head.weight"]
        self.embed = own.get("embed_tokens.weight", self.model.model.embed_tokens.weight)

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The k chained drafts after `tokens` (the last one just sampled): the layer at
        positions 0..n-2 over (h_p, token p + 1), then at n - 1 .. over its own hidden state and
        the previous draft."""
        trunk = self.model.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]
        inputs = [self._input(trunk[p], tokens[p + 1]) for p in range(len(tokens) - 1)]
        drafts = []
        for _ in range(k):
            hidden = self._block(torch.stack(inputs))[-1]
            drafts.append(int((self.head_norm(hidden) @ self.head.T).argmax()))
            inputs.append(self._input(hidden, drafts[-1]))
        return drafts

    def _input(self, hidden: torch.Tensor, token: int) -> torch.Tensor:
        return torch.cat([self.enorm(self.embed[token]), self.hnorm(hidden)]) @ self.eh_proj.T

    def _block(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        embeddings = self.model.model.rotary_emb(x[None], positions)
        return self.block(x[None], attention_mask=mask, position_ids=positions, position_embeddings=embeddings)[0]


@pytest.mark.parametrize("family, k", [("deepseek_v3", 1), ("deepseek_v3", 2), ("glm4_moe", 2)])
def test_drafts_equal_the_reference_mtp_forward(checkpoints, family, k, monkeypatch, tmp_path):
    base, path, mtp, expected = checkpoints(family)
    proposals = []  # (request id, its tokens then, drafts)
    propose = MTPDrafter.propose

    def recording(self, inputs):
        out = propose(self, inputs)
        runner_requests = llm.llm_engine.runner.requests
        for rid, accepted, row in zip(inputs.request_ids, inputs.num_accepted.tolist(), out.token_ids.tolist()):
            # The runner holds the request's tokens and one placeholder for this step's results:
            # the accepted drafts and the sampled token.
            proposals.append((rid, len(runner_requests[rid].token_ids) + accepted, row))
        return out

    monkeypatch.setattr(MTPDrafter, "propose", recording)
    llm = mtp_engine(path, k)
    prompts = make_prompts()[1:3]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    sequences = {o.request_id: p + o.outputs[0].token_ids for o, p in zip(outputs, prompts)}
    reference = ReferenceMTP(base, mtp, FAMILIES[family][0], str(tmp_path / "block"))
    checked = 0
    for rid, num_tokens, drafts in proposals:
        sequence = sequences[rid]
        if num_tokens > len(sequence):
            continue  # the request ended at this step (max_tokens): no later step reads its drafts
        assert drafts == reference.drafts(sequence[:num_tokens], k), (rid, num_tokens)
        checked += 1
    assert checked >= 2 * (NEW_TOKENS // (k + 1))


# -- acceptance ------------------------------------------------------------------------------------


def copying_nextn_layer(base: str, path: str) -> None:
    """DeepSeek-V3's next-n layer built to draft the token it is given: eh_proj passes the
    embedding half through, the decoder layer adds nothing (o_proj and the MLPs' down
    projections zero), and the head is the embedding, so the logits are embed(t) . embed and
    their argmax is t itself."""
    from safetensors.torch import load_file, save_file

    add_nextn_layer(base, path, 3, True)
    weights = load_file(os.path.join(path, "model.safetensors"))
    prefix = "model.layers.3."
    embed = weights[prefix + "embed_tokens.weight"]
    hidden = embed.shape[1]
    weights[prefix + "eh_proj.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    for name in list(weights):
        if name.startswith(prefix) and name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    weights[prefix + "enorm.weight"] = torch.ones(hidden)
    weights[prefix + "shared_head.norm.weight"] = torch.ones(hidden)
    weights[prefix + "shared_head.head.weight"] = embed.clone()
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def test_a_copying_mtp_layer_is_accepted_where_the_target_repeats(checkpoints, tmp_path):
    base, _, _, expected = checkpoints("deepseek_v3")
    path = str(tmp_path / "copying")
    copying_nextn_layer(base, path)
    llm = mtp_engine(path, 2)
    assert greedy(llm) == expected
    repeats = sum(a == b for tokens in expected for a, b in zip(tokens, tokens[1:]))
    assert repeats > 0  # the tiny model repeats itself somewhere: there the draft is right
    assert llm.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0


# -- the plan and the refusals ---------------------------------------------------------------------


def test_the_mtp_cache_is_counted_in_the_plan(checkpoints):
    _, path, _, _ = checkpoints("deepseek_v3")
    config = load_model_config(path, "float32", torch.device("cpu"), None, supported_architectures())

    def plan(**kwargs):
        return plan_memory(EngineArgs(model=path, dtype="float32", **kwargs), config, torch.device("cpu"))

    plain, drafting = plan(), plan(speculative_config={"method": "mtp"})
    # One more MLA layer's latent per token: (kv_lora_rank + qk_rope_head_dim) float32 values.
    hf = config.hf_config
    assert drafting.kv_bytes_per_token - plain.kv_bytes_per_token == (hf.kv_lora_rank + hf.qk_rope_head_dim) * 4


def test_a_checkpoint_without_mtp_layers_is_refused(checkpoints):
    base, _, _, _ = checkpoints("deepseek_v3")
    with pytest.raises(ValueError, match="holds none"):
        LLM(base, dtype="float32", device="cpu", speculative=True)
