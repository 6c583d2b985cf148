"""What the Qwen-VL families share on the text side (the towers are in layers/vision/):

    embed_tokens(ids), with the rows at the placeholder positions replaced by the vision
    encoder's outputs (MultiModalBatch) -> decoder layers with M-RoPE (positions [3, T], or [T]
    for text alone) -> norm -> lm_head;
    DeepStack (Qwen3-VL): the extra feature slices are added to the residual stream after the
    first len(slices) layers, at the placeholder positions.

Checkpoints: transformers 5.x names (`model.visual.*`, `model.language_model.*`, `lm_head.*`)
and the 4.x layout (`visual.*`, `model.*`) both load onto ours (`visual.*`, `model.*`).
The vision tower is replicated on every tensor-parallel rank; the text part is sharded as the
text families are.
"""

from __future__ import annotations

import torch
from torch import nn

from metrale.config.model_config import ModelConfig, ModelLoadError, read_hf_config
from metrale.layers.mrope import MRotaryEmbedding
from metrale.layers.rotary import rope_parameters
from metrale.layers.vision.batch import MultiModalBatch

MODALITIES = ("image", "video")


def full_hf_config(config: ModelConfig):
    """The checkpoint's whole config (ModelConfig keeps the text part): vision_config and the
    placeholder token ids live at its top level."""
    full = read_hf_config(config.model_dir, {})
    if getattr(full, "vision_config", None) is None:
        raise ModelLoadError(f"{config.model_dir}: the config of {config.architecture} has no vision_config")
    return full


def whole_config(hf_config):
    """`mrope_positions` needs the checkpoint's whole config (vision_config, placeholder ids): a
    model's `vl_config`, or AutoConfig of the checkpoint; not ModelConfig.hf_config (the text part)."""
    if getattr(hf_config, "vision_config", None) is None or getattr(hf_config, "image_token_id", None) is None:
        raise ValueError(f"mrope_positions needs the checkpoint's whole config (with vision_config and "
                         f"image_token_id; a VL model's `vl_config`), not {type(hf_config).__name__}")
    return hf_config


def use_mrope(attention: nn.Module, config: ModelConfig, default_section: list[int], interleaved: bool) -> nn.Module:
    """Swap an attention's rotary (`rotary_emb`, also its Attention layer's) for M-RoPE: the same
    frequencies and rotary dim."""
    section = rope_parameters(config.hf_config).get("mrope_section") or default_section
    rotary = MRotaryEmbedding(config.hf_config, config.head_dim, config.max_model_len, list(section), interleaved,
                              rotary_dim=attention.rotary_emb.rotary_dim)
    attention.rotary_emb = rotary
    attention.attn.rotary = rotary
    return attention


class QwenVLMixin:
    """The multimodal interface over a CausalLM trunk (`self.model`: DecoderModel) and a tower
    (`self.visual`). A family sets `tower_outputs(pixel_values, grid_thw) -> [tokens, width]`."""

    supports_multimodal = True
    uses_mrope = True
    mtp_layout = None  # no MTP layer: the dense one would keep plain RoPE under M-RoPE
    checkpoint_renames = (("model.visual.", "visual."), ("model.language_model.", "model."))

    def setup_vision(self, full_config, tower: nn.Module, deepstack_layers: int) -> None:
        self.vl_config = full_config
        self.visual = tower.requires_grad_(False)
        self.deepstack_layers = deepstack_layers
        self.merge_size = full_config.vision_config.spatial_merge_size
        if deepstack_layers > len(self.model.layers):
            raise ModelLoadError(f"{deepstack_layers} DeepStack feature(s) for {len(self.model.layers)} decoder layers")
        tie = getattr(full_config, "tie_word_embeddings", None)
        if tie is None:
            tie = getattr(self.config.hf_config, "tie_word_embeddings", False)
        if tie and not self.tied_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def dummy_reference(self, text_config) -> dict:
        """`--load-format dummy`: the names and shapes of transformers' whole model (vision too),
        built on the meta device (AutoModelForCausalLM does not take a VL text config)."""
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText.from_config(self.vl_config).state_dict()

    @property
    def multimodal_width(self) -> int:
        return self.config.hidden_size * (1 + self.deepstack_layers)

    def embed_multimodal(self, modality: str, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """One [t*h*w / merge**2, multimodal_width] tensor per item of `grid_thw` [items, 3]."""
        if modality not in MODALITIES:
            raise ValueError(f"modality {modality!r} is not one of {', '.join(MODALITIES)}")
        if grid_thw.dim() != 2 or grid_thw.shape[1] != 3 or grid_thw.shape[0] == 0:
            raise ValueError(f"grid_thw must be [items, 3] with at least one item, not {list(grid_thw.shape)}")
        counts = [int(t * h * w) for t, h, w in grid_thw.tolist()]
        if any(h % self.merge_size or w % self.merge_size for _, h, w in grid_thw.tolist()):
            raise ValueError(f"grid_thw {grid_thw.tolist()}: h and w must be multiples of {self.merge_size}")
        if pixel_values.shape[0] != sum(counts):
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, grid_thw {grid_thw.tolist()} "
                             f"needs {sum(counts)}")
        weight = self.model.embed_tokens.weight
        embeds = self.tower_outputs(pixel_values.to(weight.device, weight.dtype), grid_thw)
        return list(embeds.split([c // self.merge_size ** 2 for c in counts]))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                multimodal: MultiModalBatch | None = None) -> torch.Tensor:
        model = self.model
        hidden = model.embed_tokens(input_ids)
        deepstack, mask = (), None
        if multimodal is not None:
            multimodal.check(input_ids.shape[0], self.multimodal_width)
            mask, embeds = multimodal.is_multimodal, multimodal.embeds.to(hidden.dtype)
            width = self.config.hidden_size
            hidden = hidden.clone()
            hidden[mask] = embeds[:, :width]
            deepstack = [embeds[:, width * (i + 1):width * (i + 2)] for i in range(self.deepstack_layers)]
        residual = None
        for i, layer in enumerate(model.layers):
            hidden, residual = layer(positions, hidden, residual)
            if i < len(deepstack):
                # The residual stream as transformers holds it (layer output), plus the features.
                hidden, residual = hidden + residual, None
                hidden[mask] = hidden[mask] + deepstack[i]
            if i in model.output_layers:  # as DecoderModel keeps them, for a runner-side drafter
                model.layer_outputs[i] = hidden if residual is None else hidden + residual
        return model.norm(hidden) if residual is None else model.norm(hidden, residual)[0]
