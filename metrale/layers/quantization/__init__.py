"""Quantized weights in met's layers: which layers hold FP8 (apply.py), their FP8 state and kernels
(fp8_layers.py), and how their scales are laid out (scales.py). docs/quantization.md."""
