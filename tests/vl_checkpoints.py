"""Tiny random Qwen2.5-VL / Qwen3-VL checkpoints, written by transformers, with a processor.

The tokenizer is the tests' byte-level BPE (checkpoints.make_tokenizer) plus the vision special
tokens; the processor is transformers' own (PIL image processor: no torchvision here) saved
beside it, with a chat template that renders {"type": "image"} / {"type": "video"} parts as the
vision tokens. Video pixel values are made from the image processor's per-frame output (the
video processor needs torchvision): frame pairs go into one temporal patch as the video
processor lays them out.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from checkpoints import VOCAB_SIZE, make_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

FAMILIES = {
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", "Qwen2VLProcessor"),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor"),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", "Qwen3VLProcessor"),
    "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration", "Qwen3VLProcessor"),
    "qwen3_5_vl": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", "Qwen3VLProcessor"),
    "qwen3_5_moe_vl": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", "Qwen3VLProcessor"),
}


def _vision_fields(family: str) -> dict:
    common = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, initializer_range=0.2)
    if family == "qwen2_vl":  # the tower's width is embed_dim; hidden_size is its output width
        return dict(depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, in_channels=3, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2, hidden_act="quick_gelu", initializer_range=0.2)
    if family == "qwen2_5_vl":
        # Block 0 full attention, block 1 windows of 2x2 merged units (56 px).
        return dict(common, hidden_act="silu", window_size=56, fullatt_block_indexes=[0], tokens_per_second=2)
    if family.startswith("qwen3_5"):  # no DeepStack
        return dict(common, hidden_act="gelu_pytorch_tanh", num_position_embeddings=16)
    return dict(common, hidden_act="gelu_pytorch_tanh", num_position_embeddings=16, deepstack_visual_indexes=[0, 1])


def _text_fields(family: str, tie: bool) -> dict:
    fields = dict(vocab_size=VOCAB_SIZE + len(VISION_TOKENS), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.2, rms_norm_eps=1e-6, tie_word_embeddings=tie, head_dim=16)
    if family in ("qwen2_vl", "qwen2_5_vl"):
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    else:
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                     "mrope_interleaved": True}
    if family == "qwen3_vl_moe":  # layer 0 dense, layer 1 sparse: 4 experts, top 2
        fields.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=2)
    if family == "qwen3_5_moe_vl":  # every layer MoE with a shared expert
        fields.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48)
    if family.startswith("qwen3_5"):  # layer 0 Gated DeltaNet, layer 1 gated attention (rotary on half of each head)
        fields.update(head_dim=32, full_attention_interval=2, linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
        fields["rope_parameters"] = dict(fields["rope_parameters"], partial_rotary_factor=0.5)
    return fields


def _perturb_hybrid(model) -> None:
    """As hybrid_checkpoints.py: zero-centred norms and decay parameters off their init values."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.randn(param.shape) * 0.3)
            elif name.endswith(("A_log", "dt_bias")):
                param.copy_(torch.randn(param.shape) * 0.5)


def make_vl_checkpoint(path: str, family: str = "qwen2_5_vl", tie: bool = False, seed: int = 0) -> str:
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config_name, model_name, processor_name = FAMILIES[family]
    os.makedirs(path, exist_ok=True)
    tokenizer = make_tokenizer(path)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    tokenizer.chat_template = CHAT_TEMPLATE
    config = getattr(transformers, config_name)(
        vision_config=_vision_fields(family),
        text_config=dict(_text_fields(family, tie), eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=tie)
    config.architectures = [model_name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float().eval()
    if family.startswith("qwen3_5"):
        _perturb_hybrid(model)
    model.save_pretrained(path, safe_serialization=True)
    image_processor = Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2,
                                               min_pixels=56 * 56, max_pixels=28 * 28 * 64)
    # transformers' processor classes need torchvision for their video processor at construction:
    # the parts are saved on their own (tokenizer, image processor with its processor class).
    image_processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    _set_json(os.path.join(path, "preprocessor_config.json"), processor_class=processor_name)
    return path


def _set_json(path: str, **fields) -> None:
    with open(path) as f:
        data = json.load(f)
    data.update(fields)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def tiny_images():
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((56, 56), (84, 112))]


def tiny_video(frames: int = 4, height: int = 56, width: int = 84) -> np.ndarray:
    rng = np.random.default_rng(1)
    return rng.integers(0, 256, (frames, height, width, 3), dtype=np.uint8)


def video_pixel_values(image_processor, frames: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values [t*h*w, C*T*P*P], grid_thw [1, 3]) of a video: each frame through the image
    processor (which repeats a still image over the temporal patch), then frames 2k and 2k+1 put
    in the two temporal slots of each patch, as the video processor does."""
    from PIL import Image

    tp = image_processor.temporal_patch_size
    per_frame = [image_processor(images=[Image.fromarray(f)], return_tensors="pt") for f in frames]
    _, h, w = per_frame[0]["image_grid_thw"][0].tolist()
    patches = torch.stack([p["pixel_values"] for p in per_frame])  # [frames, h*w, C*T*P*P]
    n, hw, width = patches.shape
    channels = image_processor.patch_size ** 2
    slots = patches.view(n, hw, 3, tp, channels)[:, :, :, 0]  # each frame once: [frames, hw, C, P*P]
    slots = slots.view(n // tp, tp, hw, 3, channels).permute(0, 2, 3, 1, 4)  # [t, hw, C, T, P*P]
    return slots.reshape(n // tp * hw, width), torch.tensor([[n // tp, h, w]])
