"""Checkpoint loading: safetensors streaming, name mapping, dummy weights."""
