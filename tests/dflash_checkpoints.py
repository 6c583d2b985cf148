"""Tiny random DFlash drafters in the public z-lab layout, and a plain-torch reference of their
forward written from z-lab's description (github.com/z-lab/dflash, dflash/model.py's behaviour):

- config.json: a Qwen3 config of the drafter's layers, `architectures: ["DFlashDraftModel"]`,
  `block_size` and `dflash_config: {mask_token_id, target_layer_ids}`;
- model.safetensors: `fc`, `hidden_norm`, `norm` and `layers.{i}.*` (no embedding, no LM head:
  the target's are used).
"""

from __future__ import annotations

import json
import os

import torch

from checkpoints import make_checkpoint

TARGET_LAYERS = 4  # targets of the DFlash tests: layers 0..2 may be read (not the last)
LAYER_IDS = [0, 2]
BLOCK_SIZE = 4
MASK_TOKEN_ID = 3


def make_dflash_target(path: str, family: str = "qwen3") -> str:
    return make_checkpoint(path, family, num_hidden_layers=TARGET_LAYERS)


def make_dflash_drafter(path: str, target_dir: str, seed: int = 1, num_layers: int = 2, block_size: int = BLOCK_SIZE,
                        layer_ids=LAYER_IDS, mask_token_id: int = MASK_TOKEN_ID, silent: bool = False,
                        **overrides) -> str:
    """A random drafter for the target checkpoint in `target_dir` (its hidden size and vocabulary
    unless `overrides` change them). Weights are drawn with a wide range so that its drafts are not
    near-ties. `silent`: every layer's o_proj and down_proj zero and the norms one, so each draft
    is the LM head's argmax over the normed mask-token embedding (`constant_draft_mask`)."""
    from safetensors.torch import save_file

    with open(os.path.join(target_dir, "config.json")) as f:
        target = json.load(f)
    config = dict(architectures=["DFlashDraftModel"], model_type="qwen3", auto_map={"AutoModel": "dflash.DFlashDraftModel"},
                  hidden_size=target["hidden_size"], vocab_size=target["vocab_size"], num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                  rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512, attention_bias=False,
                  tie_word_embeddings=False, num_target_layers=target["num_hidden_layers"], block_size=block_size,
                  dflash_config={"mask_token_id": mask_token_id, "target_layer_ids": list(layer_ids)},
                  dtype="float32")
    config.update(overrides)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    hidden, heads, kv_heads, head_dim = (config["hidden_size"], config["num_attention_heads"],
                                         config["num_key_value_heads"], config["head_dim"])
    inter = config["intermediate_size"]
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.3):
        return torch.randn(*shape, generator=generator) * scale

    def norm(size):
        return 1.0 + rand(size, scale=0.1)

    weights = {"fc.weight": rand(hidden, len(layer_ids) * hidden, scale=0.15), "hidden_norm.weight": norm(hidden),
               "norm.weight": norm(hidden)}
    for i in range(num_layers):
        p = f"layers.{i}."
        weights.update({
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim, scale=0.2),
            p + "self_attn.q_norm.weight": norm(head_dim), p + "self_attn.k_norm.weight": norm(head_dim),
            p + "mlp.gate_proj.weight": rand(inter, hidden), p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter, scale=0.2),
            p + "input_layernorm.weight": norm(hidden), p + "post_attention_layernorm.weight": norm(hidden)})
    if silent:
        for name in weights:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                weights[name] = torch.zeros_like(weights[name])
            elif "norm" in name:
                weights[name] = torch.ones_like(weights[name])
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(path, "model.safetensors"))
    return path


def constant_draft_mask(target_model, token: int) -> int | None:
    """A mask token id whose silent drafter (above) drafts `token` at every position, or None."""
    embed, head = target_model.get_input_embeddings().weight, target_model.get_output_embeddings().weight
    with torch.no_grad():
        drafts = (_rms(embed, torch.ones(embed.shape[1])) @ head.T).argmax(-1)
    found = (drafts == token).nonzero().flatten().tolist()
    return found[0] if found else None


# -- the engine's drafts against the reference --------------------------------------------------

def record_drafts(llm) -> list:
    """Every propose call's (request id, block start position, sampled token, drafts)."""
    drafter, calls = llm.llm_engine.runner.drafter, []
    propose = drafter.propose

    def recording(inputs):
        out = propose(inputs)
        starts = (inputs.layout.positions[inputs.last_rows] + 1).tolist()
        calls.extend(zip(inputs.request_ids, starts, inputs.sampled_tokens.tolist(), out.token_ids.tolist()))
        return out

    drafter.propose = recording
    return calls


def assert_drafts_are_the_reference(calls, sequences: dict, drafter: str, model) -> None:
    assert calls
    # Causal: the target's features of a prefix are the first rows of the whole sequence's.
    features = {rid: target_features(model, tokens) for rid, tokens in sequences.items()}
    for request_id, start, sampled, drafts in calls:
        tokens = sequences[request_id]
        assert tokens[start] == sampled  # the block opens with the token the target gave at `start`
        context = features[request_id][:start]
        assert drafts == reference_drafts(drafter, model, context, sampled, len(drafts)), (request_id, start)


# -- the reference forward ---------------------------------------------------------------------

def _rms(x, weight, eps=1e-6):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, positions, theta):
    """x: [tokens, heads, d]; the rotate-half rotation of transformers' Llama/Qwen3."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    rotated = torch.cat([-x[..., d // 2:], x[..., :d // 2]], dim=-1)
    return x * cos + rotated * sin


def target_features(target_model, token_ids: list[int]) -> torch.Tensor:
    """transformers' target hidden states of `token_ids` after layers LAYER_IDS, concatenated."""
    with torch.no_grad():
        out = target_model(torch.tensor([token_ids]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1][0] for i in LAYER_IDS], dim=-1)


@torch.no_grad()
def reference_drafts(drafter_dir: str, target_model, context: torch.Tensor, block_first_token: int,
                     num_drafts: int) -> list[int]:
    """The drafts of one block: `context` [p, features] are the target's features of positions
    0..p-1; the block (the sampled token, then mask tokens) sits at positions p..p + block - 1;
    queries see every context and block key."""
    from safetensors.torch import load_file

    with open(os.path.join(drafter_dir, "config.json")) as f:
        cfg = json.load(f)
    w = load_file(os.path.join(drafter_dir, "model.safetensors"))
    heads, kv_heads, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    n, theta = cfg["block_size"], cfg["rope_theta"]
    p = context.shape[0]
    embed = target_model.get_input_embeddings().weight
    head = target_model.get_output_embeddings().weight
    ctx = _rms(context @ w["fc.weight"].T, w["hidden_norm.weight"])
    ids = torch.tensor([block_first_token] + [cfg["dflash_config"]["mask_token_id"]] * (n - 1))
    h = embed[ids]
    pos_block, pos_all = torch.arange(p, p + n), torch.arange(p + n)
    for i in range(cfg["num_hidden_layers"]):
        L = lambda name: w[f"layers.{i}.{name}.weight"]  # noqa: E731
        x = _rms(h, L("input_layernorm"))
        q = _rms((x @ L("self_attn.q_proj").T).view(n, heads, d), L("self_attn.q_norm"))
        both = torch.cat([ctx, x])
        k = _rms((both @ L("self_attn.k_proj").T).view(p + n, kv_heads, d), L("self_attn.k_norm"))
        v = (both @ L("self_attn.v_proj").T).view(p + n, kv_heads, d)
        q, k = _rope(q, pos_block, theta), _rope(k, pos_all, theta)
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * d ** -0.5
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)
        h = h + attn @ L("self_attn.o_proj").T
        x = _rms(h, L("post_attention_layernorm"))
        h = h + (torch.nn.functional.silu(x @ L("mlp.gate_proj").T) * (x @ L("mlp.up_proj").T)) @ L("mlp.down_proj").T
    logits = _rms(h, w["norm.weight"]) @ head.T
    return logits[1:num_drafts + 1].argmax(-1).tolist()
