"""Model classes by the `architectures` name in config.json."""

from __future__ import annotations

import importlib

# architecture -> (module, class). Imported lazily so an unused family costs nothing.
_MODELS = {
    "LlamaForCausalLM": ("metrale.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("metrale.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("metrale.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen2MoeForCausalLM": ("metrale.models.qwen3_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("metrale.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "MiniMaxM2ForCausalLM": ("metrale.models.minimax_m2", "MiniMaxM2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("metrale.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    "Glm4MoeForCausalLM": ("metrale.models.glm4_moe", "Glm4MoeForCausalLM"),
    "DeepseekV32ForCausalLM": ("metrale.models.deepseek_v32", "DeepseekV32ForCausalLM"),
    "GlmMoeDsaForCausalLM": ("metrale.models.glm_moe_dsa", "GlmMoeDsaForCausalLM"),
    # GLM-5.3: the text part; the multimodal checkpoint's name serves it too (vision weights skipped).
    "Glm5NextForCausalLM": ("metrale.models.glm5_next", "Glm5NextForCausalLM"),
    "Glm5NextForConditionalGeneration": ("metrale.models.glm5_next", "Glm5NextForCausalLM"),
    "Qwen3NextForCausalLM": ("metrale.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("metrale.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("metrale.models.qwen3_5", "Qwen3_5MoeForCausalLM"),
    # Vision-language (supports_multimodal, uses_mrope): layers/vision/ and models/qwen_vl_base.py.
    "Qwen2VLForConditionalGeneration": ("metrale.models.qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("metrale.models.qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Qwen3VLForConditionalGeneration": ("metrale.models.qwen3_vl", "Qwen3VLForConditionalGeneration"),
    "Qwen3VLMoeForConditionalGeneration": ("metrale.models.qwen3_vl", "Qwen3VLMoeForConditionalGeneration"),
    "Qwen3_5ForConditionalGeneration": ("metrale.models.qwen3_5_vl", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForConditionalGeneration": ("metrale.models.qwen3_5_vl", "Qwen3_5MoeForConditionalGeneration"),
}


def register_model(architecture: str, module: str, class_name: str) -> None:
    """Add an architecture (a family outside the package: tests, plugins). Worker ranks of a
    multi-rank engine are fresh interpreters and know only the built-in ones."""
    _MODELS[architecture] = (module, class_name)


def supported_architectures() -> dict[str, tuple[str, str]]:
    return dict(_MODELS)


def get_model_class(architecture: str):
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
