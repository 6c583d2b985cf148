"""The vision-language benchmark's workload: random images, prompts of token ids laid out as
Qwen-VL's chat template lays them out, and a tiny checkpoint for the CPU smoke run.

No tokenizer is needed (the shipped configs carry none): each image is `<|vision_start|>`, its
`<|image_pad|>` tokens (one per merged 2x2 patch block of the processed image) and
`<|vision_end|>`, between runs of random text ids. transformers is given those ids; met one
`<|image_pad|>` per image, as a chat template writes it, which its processor expands. Every
image is different noise, so neither the encoder cache nor the prefix cache can serve one
request from another's work; iteration i of a seed always gets the same images and ids, so two
frameworks see the same inputs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

TEXT_BEFORE = 8  # "<|im_start|>system ... <|im_start|>user\n", roughly
TEXT_AFTER = 56  # the question, "<|im_end|>\n<|im_start|>assistant\n"


@dataclass(frozen=True)
class VisionTokens:
    image_pad: int
    vision_start: int
    vision_end: int
    text_id_limit: int  # text ids are drawn below this (and below every special id)

    @classmethod
    def from_config(cls, hf_config) -> "VisionTokens":
        """From the checkpoint's whole config (AutoConfig's): the ids Qwen's processor writes."""
        ids = [hf_config.image_token_id, hf_config.vision_start_token_id, hf_config.vision_end_token_id]
        text = getattr(hf_config, "text_config", None) or hf_config
        # Qwen's special tokens sit above its ordinary ones: draw text below the lowest of them.
        return cls(*ids, text_id_limit=min(min(ids), text.vocab_size, 100_000))


def noise_images(count: int, size: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(count)]


def image_token_count(grid_thw, merge_size: int) -> int:
    t, h, w = (int(v) for v in grid_thw)
    return t * h * w // (merge_size * merge_size)


def prompt_ids(tokens: VisionTokens, image_token_counts: list[int], seed: int) -> list[int]:
    """Text ids, then each image's run, then more text ids (the images first, as a user turn
    with the images before the question)."""
    rng = np.random.default_rng(seed)

    def text(n: int) -> list[int]:
        return rng.integers(1, tokens.text_id_limit, n).tolist()

    ids = text(TEXT_BEFORE)
    for count in image_token_counts:
        ids += [tokens.vision_start] + [tokens.image_pad] * count + [tokens.vision_end]
    return ids + text(TEXT_AFTER)


@dataclass
class VLRequest:
    prompt_token_ids: list[int]  # expanded: every image's placeholder tokens (transformers' input_ids)
    images: list  # PIL images
    image_pad: int

    def met_prompt(self) -> dict:
        """As a chat template renders it before the processor: one `<|image_pad|>` per image,
        which met's processor expands to the image's tokens (multimodal/processor.py)."""
        ids = [t for i, t in enumerate(self.prompt_token_ids)
               if t != self.image_pad or i == 0 or self.prompt_token_ids[i - 1] != self.image_pad]
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": self.images}}


def make_requests(tokens: VisionTokens, count: int, images_per_request: int, image_size: int,
                  tokens_per_image: int, seed: int) -> list[VLRequest]:
    """`count` requests of `images_per_request` distinct images each; seeds derived from `seed`."""
    return [VLRequest(prompt_ids(tokens, [tokens_per_image] * images_per_request, seed * 1000 + i),
                      noise_images(images_per_request, image_size, seed * 1000 + i), tokens.image_pad)
            for i in range(count)]


# -- the tiny checkpoint of the CPU smoke run -------------------------------------------------

TINY_VOCAB = 512
TINY_IMAGE_SIZE = 56  # 4x4 patches: 4 tokens per image


def write_tiny_checkpoint(path: str, seed: int = 0) -> str:
    """A tiny random Qwen2.5-VL written by transformers (config, safetensors, image processor),
    so met and transformers load the same weights and their greedy tokens can be compared."""
    import torch
    import transformers

    os.makedirs(path, exist_ok=True)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, hidden_act="silu",
                  window_size=56, fullatt_block_indexes=[0], tokens_per_second=2, initializer_range=0.2)
    text = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                initializer_range=0.2, rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=TINY_VOCAB - 5,
                bos_token_id=None, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    config = transformers.Qwen2_5_VLConfig(vision_config=vision, text_config=text, image_token_id=TINY_VOCAB - 4,
                                           video_token_id=TINY_VOCAB - 3, vision_start_token_id=TINY_VOCAB - 2,
                                           vision_end_token_id=TINY_VOCAB - 1, tie_word_embeddings=False)
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    torch.manual_seed(seed)
    transformers.Qwen2_5_VLForConditionalGeneration(config).float().eval().save_pretrained(path)
    preprocessor = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 16, "patch_size": 14, "temporal_patch_size": 2,
                    "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                    "image_std": [0.26862954, 0.26130258, 0.27577711],
                    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor"}
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(preprocessor, f, indent=2)
    return path
