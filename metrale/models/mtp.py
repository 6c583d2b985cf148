"""Multi-token-prediction (next-n) layers of DeepSeek-V3 and GLM-4.5 checkpoints (and GLM-5 /
DeepSeek-V3.2, whose trunk is DeepSeek-V3's): loaded, hashed and run by the MTP drafter of
speculative decoding (executor/drafters/mtp.py). Qwen3-Next's / Qwen3.5's `mtp.*` layer has its
own layout (which met also defines for its dense families): models/qwen_mtp.py, on the helpers here.

A checkpoint of `num_hidden_layers` N carries layer i of `num_nextn_predict_layers` as
`model.layers.{N + i}.*`:

    enorm, hnorm              RMSNorm of the next token's embedding and of the trunk's hidden state
    eh_proj                   Linear 2H -> H over [enorm(embedding), hnorm(hidden)] (replicated)
    self_attn, mlp, input_layernorm, post_attention_layernorm
                              one decoder layer, the one the family builds for layer N + i (MoE)
    shared_head.norm          RMSNorm before the head
    shared_head.head          the LM head (DeepSeek stores a copy; optional: else the model's)
    embed_tokens              the embedding (DeepSeek stores a copy; optional: else the model's)

Here layer i is `model.mtp[i]` (an `MTPLayer`, its decoder layer as `block`), outside
`model.layers`, so the main forward never runs it; `mtp_checkpoint_renames` maps the names. The
family builds the layers its config declares only where the checkpoint holds them: whether it
does is read from the safetensors headers before building (`held_mtp_layers`), so a stripped
checkpoint whose config still declares them loads as before, with no MTP. A layer the checkpoint
holds in part is an error naming what is missing (the loader's check). `--load-format dummy`
builds every layer the config declares (`drawing_dummy_weights`), storing no embedding or head of
its own, and the dummy checkpoint draws their tensors under the checkpoint's names
(`MTPLayer.dummy_checkpoint_shapes`: transformers' reference model, which gives the trunk's names
and shapes, has no MTP layers; the decoder layer's are the last trunk layer's).

Caches: the MTP decoder layer's attention is marked `drafter_only`, so `cached_layers(model)`
skips it: without MTP drafting the cache layout, the KV pool and the memory plan are as without
MTP but for the weights' bytes. The MTP drafter lists those modules as its own cached layers
(`MTPLayer.cached_layers`), and the runner adds them to the model's: then their paged caches are
counted, allocated and bound like the trunk's.

Forward (`MTPLayer.forward`), position p, as DeepSeek-V3 and vLLM compute it: the trunk's final
hidden state h_p (after its last norm) and the embedding of the token at p + 1 give
x = eh_proj([enorm(embed(t_{p+1})), hnorm(h_p)]); the decoder layer runs at position p over its
own cache; its output plus the residual is the layer's hidden state (the next chained pass's h),
and shared_head (norm, then the head) gives the logits of the token at p + 2.

Hash: sha256 over the MTP tensors as stored, in name order, each its name (UTF-8) then its raw
bytes read from the safetensors file (FP8 scales included). Computed once the weights are in
(executor/model_loader.py with loader/safetensors_loader.py's `sha256_of_tensors`), from those
tensors' byte ranges only (the rest of the checkpoint is not read again), logged at startup
(`MTP: 1 layer(s), 123 tensors, ..., sha256 ...`) and kept as `model.mtp_sha256` (with
`model.mtp_tensor_count`).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch import nn

from metrale.config.model_config import ModelConfig
from metrale.layers.linear import ReplicatedLinear
from metrale.layers.vocab import ParallelLMHead, VocabParallelEmbedding

DECODER_PARTS = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")

_names: contextvars.ContextVar[frozenset] = contextvars.ContextVar("met_checkpoint_names", default=frozenset())
_dummy: contextvars.ContextVar[bool] = contextvars.ContextVar("met_dummy_mtp", default=False)


@contextlib.contextmanager
def checkpoint_tensor_names(names, dummy: bool = False):
    """Inside, families build the MTP layers these checkpoint tensor names hold. construct_model
    (executor/model_loader.py) passes the checkpoint's, read from its headers, or none and `dummy`
    for dummy weights (then every declared layer is built); a model built outside it has no MTP
    layers."""
    token, dummy_token = _names.set(frozenset(names)), _dummy.set(dummy)
    try:
        yield
    finally:
        _names.reset(token)
        _dummy.reset(dummy_token)


def held_checkpoint_names() -> frozenset:
    """The checkpoint tensor names `checkpoint_tensor_names` set (none outside it)."""
    return _names.get()


def drawing_dummy_weights() -> bool:
    """Inside `checkpoint_tensor_names(..., dummy=True)`: the weights will be drawn
    (`--load-format dummy`), so a family builds every MTP layer its config declares."""
    return _dummy.get()


def trunk_prefix(reference_shapes: dict) -> str:
    """The decoder layers' name prefix in a (dummy) reference checkpoint: `model.`, or a
    multimodal checkpoint's `model.language_model.`."""
    for prefix in ("model.", "model.language_model."):
        if any(name.startswith(prefix + "layers.0.") for name in reference_shapes):
            return prefix
    raise ValueError("the reference checkpoint has no model.layers.0.*: no decoder layer to shape an MTP layer on")


def copied_layer_shapes(reference_shapes: dict, source: str, target: str, parts=DECODER_PARTS) -> dict:
    """{target + rest: shape} for every reference name `source + rest` under one of `parts`
    (`reference_shapes`: {name: shape tuple}, the dummy checkpoint's)."""
    return {target + name[len(source):]: shape for name, shape in reference_shapes.items()
            if name.startswith(source) and name[len(source):].startswith(tuple(p + "." for p in parts))}


def mark_drafter_only(block: nn.Module) -> None:
    """An MTP layer's stateful modules: `cached_layers` skips them, so without MTP drafting the
    cache layout, the KV pool and the memory plan are as without MTP but for the weights' bytes."""
    for module in block.modules():
        if hasattr(module, "cache_specs"):
            module.drafter_only = True


def mtp_prefix(config: ModelConfig, i: int) -> str:
    return f"model.layers.{config.hf_config.num_hidden_layers + i}."


def declared_mtp_layers(config: ModelConfig) -> int:
    return getattr(config.hf_config, "num_nextn_predict_layers", 0) or 0


def held_mtp_layers(config: ModelConfig) -> list[dict[str, bool]]:
    """For each MTP layer the config declares and the checkpoint holds (from layer 0 on, while
    held): whether it stores its own `embed_tokens` and `shared_head.head`."""
    declared, names = declared_mtp_layers(config), _names.get()
    if _dummy.get():
        return [dict(embed_tokens=False, head=False) for _ in range(declared)]
    held = []
    for i in range(declared):
        prefix = mtp_prefix(config, i)
        if not any(name.startswith(prefix) for name in names):
            break
        held.append(dict(embed_tokens=f"{prefix}embed_tokens.weight" in names,
                         head=f"{prefix}shared_head.head.weight" in names))
    return held


def mtp_checkpoint_renames(config: ModelConfig, count: int) -> tuple[tuple[str, str], ...]:
    """Checkpoint names of MTP layer i (`model.layers.{N + i}.*`) -> `mtp.{i}.*`, the decoder
    layer's parts under `mtp.{i}.block.`."""
    renames = []
    for i in range(count):
        prefix = mtp_prefix(config, i)
        renames += [(f"{prefix}{part}.", f"mtp.{i}.block.{part}.") for part in DECODER_PARTS]
        renames.append((prefix, f"mtp.{i}."))
    return tuple(renames)


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig, norm: type[nn.Module], own_head: bool):
        super().__init__()
        self.norm = norm(config.hidden_size, config.hf_config.rms_norm_eps)
        self.head = ParallelLMHead(config.vocab_size, config.hidden_size) if own_head else None


class MTPLayer(nn.Module):
    """One next-n layer: block(eh_proj([enorm(embed(next token)), hnorm(hidden)])), then
    shared_head (the module docstring)."""

    def __init__(self, config: ModelConfig, block: nn.Module, norm: type[nn.Module], own_embedding: bool,
                 own_head: bool):
        super().__init__()
        hidden, eps = config.hidden_size, config.hf_config.rms_norm_eps
        self.hidden_size, self.num_hidden_layers = hidden, config.hf_config.num_hidden_layers
        self.enorm = norm(hidden, eps)
        self.hnorm = norm(hidden, eps)
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden, bias=False)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, hidden) if own_embedding else None
        self.shared_head = SharedHead(config, norm, own_head)
        self.block = block
        mark_drafter_only(block)

    def cached_layers(self) -> list:
        """Its decoder layer's stateful modules (attention, a DSA indexer), in order."""
        return [m for m in self.block.modules() if hasattr(m, "cache_specs")]

    def dummy_checkpoint_shapes(self, index: int, reference_shapes: dict) -> dict:
        """`--load-format dummy`: this layer's (layer `index`'s) checkpoint names and shapes, its
        decoder layer shaped on the last trunk layer of `reference_shapes` (the MTP layer is built
        as layer N + index, of the last layer's kind in the published checkpoints). Neither
        embed_tokens nor shared_head.head: a dummy layer uses the model's."""
        trunk, h = trunk_prefix(reference_shapes), self.hidden_size
        target = f"{trunk}layers.{self.num_hidden_layers + index}."
        shapes = copied_layer_shapes(reference_shapes, f"{trunk}layers.{self.num_hidden_layers - 1}.", target)
        shapes.update({f"{target}enorm.weight": (h,), f"{target}hnorm.weight": (h,),
                       f"{target}eh_proj.weight": (h, 2 * h), f"{target}shared_head.norm.weight": (h,)})
        return shapes

    def forward(self, positions: torch.Tensor, next_token_ids: torch.Tensor, hidden: torch.Tensor,
                embed_tokens: nn.Module) -> torch.Tensor:
        """The layer's hidden state at each row: `hidden` is the trunk's (or the previous chained
        pass's) at the row's position, `next_token_ids` the token after it. `embed_tokens`: the
        model's, used when the layer stores none. Runs inside a forward context."""
        embedding = (self.embed_tokens if self.embed_tokens is not None else embed_tokens)(next_token_ids)
        x = self.eh_proj(torch.cat([self.enorm(embedding), self.hnorm(hidden)], dim=-1))
        out, residual = self.block(positions, x, None)
        return out + residual

    def compute_logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """shared_head: its norm, then its head (the model's `lm_head` when it stores none)."""
        head = self.shared_head.head if self.shared_head.head is not None else lm_head
        return head.compute_logits(self.shared_head.norm(hidden))


def attach_mtp_layers(model: nn.Module, config: ModelConfig) -> None:
    """A family's __init__, after the trunk: `model.mtp` (the layers the checkpoint holds), the
    name mapping onto them, and the declared layers the checkpoint lacks ignored."""
    held = held_mtp_layers(config)
    n = config.hf_config.num_hidden_layers
    if held:
        model.mtp = nn.ModuleList(
            MTPLayer(config, model.make_layer(config, n + i), model.norm, layer["embed_tokens"], layer["head"])
            for i, layer in enumerate(held))
        model.checkpoint_renames = type(model).checkpoint_renames + mtp_checkpoint_renames(config, len(held))
    model.mtp_sha256 = None
    model.mtp_tensor_count = 0
    model.mtp_checkpoint_prefixes = tuple(mtp_prefix(config, i) for i in range(len(held)))
    model.ignored_checkpoint_prefixes = tuple(mtp_prefix(config, i)
                                              for i in range(len(held), declared_mtp_layers(config)))


def mtp_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The checkpoint name prefixes of the MTP tensors the model holds, the ones hashed (none: ()).
    Set by the family's attach (DeepSeek's `model.layers.{N + i}.`, Qwen's `mtp.`)."""
    if not getattr(model, "mtp", None):
        return ()
    return getattr(model, "mtp_checkpoint_prefixes", ())


def mtp_parameter_bytes(model: nn.Module) -> int:
    layers = getattr(model, "mtp", None)
    if not layers:
        return 0
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in layers.parameters()}.values())
