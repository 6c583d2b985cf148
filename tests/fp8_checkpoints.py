"""FP8 copies of the tiny random checkpoints, quantized here the way published FP8 checkpoints
are: every projection weight as float8_e4m3fn with a `weight_scale_inv` per [bn, bk] block
(partial at the edges), embeddings, norms, the LM head and routers left as they were; plus
the dequantized float32 copy that transformers runs as the reference.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from metrale.kernels.fp8_math import dequantize_weight, quantize_weight

_KEEP = ("embed_tokens", "lm_head", "norm", "mlp.gate.", "block_sparse_moe.gate.", "shared_expert_gate", "conv1d")


def is_projection(name: str, tensor: torch.Tensor) -> bool:
    return name.endswith(".weight") and tensor.dim() == 2 and not any(k in name for k in _KEEP)


def quantize_checkpoint(src: str, dst: str, reference_dst: str, block: tuple[int, int] = (32, 32),
                        scale_dtype: torch.dtype = torch.float32, not_converted: tuple[str, ...] = ()) -> tuple[str, str]:
    """`src` (float32 safetensors) -> `dst` (FP8 + scales, quantization_config) and
    `reference_dst` (the same weights dequantized, float32, no quantization_config)."""
    from safetensors.torch import load_file, save_file

    for path in (dst, reference_dst):
        shutil.copytree(src, path, dirs_exist_ok=True)
    files = [f for f in os.listdir(src) if f.endswith(".safetensors")]
    for file in files:
        tensors = load_file(os.path.join(src, file))
        quantized, dequantized = {}, {}
        for name, tensor in tensors.items():
            module = name.removesuffix(".weight")
            if not is_projection(name, tensor) or any(module.endswith(m) for m in not_converted):
                quantized[name] = dequantized[name] = tensor
                continue
            weight, scale = quantize_weight(tensor, *block)
            scale = scale.to(scale_dtype)
            quantized[name], quantized[f"{name}_scale_inv"] = weight, scale
            dequantized[name] = dequantize_weight(weight, scale, *block)
        save_file(quantized, os.path.join(dst, file), metadata={"format": "pt"})
        save_file(dequantized, os.path.join(reference_dst, file), metadata={"format": "pt"})
    config_path = os.path.join(dst, "config.json")
    config = json.load(open(config_path))
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block),
                                     **({"modules_to_not_convert": list(not_converted)} if not_converted else {})}
    json.dump(config, open(config_path, "w"), indent=2)
    return dst, reference_dst
