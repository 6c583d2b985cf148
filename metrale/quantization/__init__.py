"""Quantized weights: FP8 formats, their layout in met's layers, and loading them (docs/quantization.md)."""
