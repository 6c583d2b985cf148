"""Llama and Qwen2: pre-norm decoder blocks of GQA attention with RoPE and a SwiGLU MLP.

Qwen2 is Llama with a bias on the Q, K and V projections; Llama-3 adds rope scaling (handled by
get_rope from the config). Qwen3 (qwen3.py) adds per-head RMSNorm on Q and K.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from metrale.config.model_config import ModelConfig
from metrale.distributed.parallel_state import get_tp_group
from metrale.kernels import use_triton
from metrale.layers.activation import SiluAndMul
from metrale.layers.attention import Attention
from metrale.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear, one_row
from metrale.layers.norm import RMSNorm
from metrale.layers.rotary import RotaryEmbedding
from metrale.layers.vocab import ParallelLMHead, VocabParallelEmbedding


# LlamaDecoderLayer.forward_one_token on (the default) or off: MET_FUSED_DECODE_LAYERS=0 runs batch-1
# decode through the separate kernels, for A/B measurements (benchmarks/run_gpu_suite.sh).
FUSED_DECODE_LAYERS = os.environ.get("MET_FUSED_DECODE_LAYERS", "1") != "0"


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """down(silu(gate) * up) of x, or of norm(x) with `norm`; plus `residual` if given (the
        decoder layer's add). The batch-1 layer path (LlamaDecoderLayer.forward_one_token) passes
        both, so the GEMVs fold in the norm, the activation and the add."""
        if norm is None and residual is None:
            return self.down_proj(self.act_fn(self.gate_up_proj(x)))
        return self.down_proj(self.gate_up_proj.forward_glu(x, norm), residual=residual)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, qkv_bias: bool, o_bias: bool):
        super().__init__()
        hf = config.hf_config
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, config.num_attention_heads,
                                          config.num_kv_heads, bias=qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = config.head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * config.head_dim, config.hidden_size, bias=o_bias)
        self.rotary_emb = RotaryEmbedding(hf, config.head_dim, config.max_model_len)
        self.attn = Attention(self.num_heads, config.head_dim, config.head_dim ** -0.5, self.num_kv_heads)

    def transform_qk(self, q: torch.Tensor, k: torch.Tensor):
        """Per-head changes before RoPE; none for Llama."""
        return q, k

    def per_head_qk_norms(self):
        """(q_norm, k_norm) when transform_qk is an RMSNorm of each head that the fused prologue
        kernel can apply itself; None when transform_qk is something else (or nothing)."""
        return None

    def rotate_qk(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """transform_qk, then RoPE; a subclass may fuse the two (Qwen3)."""
        return self.rotary_emb(positions, *self.transform_qk(q, k))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, norm: nn.Module | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """Attention over hidden, or over norm(hidden) with `norm`; plus `residual` if given (as
        LlamaMLP.forward's)."""
        q, k, v = self.qkv_proj(hidden, norm).split([self.qkv_proj.q_size, self.qkv_proj.kv_size,
                                                     self.qkv_proj.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.attn.can_fuse_prologue(q):  # norms, RoPE and the K/V write in one launch
            norms = self.per_head_qk_norms()
            if norms is None:
                q, k = self.transform_qk(q, k)
            return self.o_proj(self.attn.rope_and_attend(positions, q, k, v, self.rotary_emb, norms), residual)
        q, k = self.rotate_qk(positions, q, k)
        return self.o_proj(self.attn(q, k, v), residual)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attention: nn.Module):
        super().__init__()
        hf = config.hf_config
        self.self_attn = attention
        self.mlp = LlamaMLP(config.hidden_size, hf.intermediate_size, bias=getattr(hf, "mlp_bias", False))
        self.input_layernorm = RMSNorm(config.hidden_size, hf.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, hf.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        """(hidden, residual) -> (hidden, residual): the residual stream is their sum; a None
        residual means hidden is the whole stream (after the embedding)."""
        if self.fuses_one_token(hidden):
            return self.forward_one_token(positions, hidden, residual)
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    @staticmethod
    def fuses_one_token(hidden: torch.Tensor) -> bool:
        """Batch-1 decode on the Triton path and one GPU: forward_one_token."""
        return FUSED_DECODE_LAYERS and one_row(hidden) and use_triton(hidden) and get_tp_group().size == 1

    def forward_one_token(self, positions, hidden, residual):
        """forward for one token with 3 launches fewer: each RMSNorm runs inside the GEMV that
        reads its output, the residual adds inside the GEMVs of o_proj and down_proj, SiLU-and-mul
        inside gate_up's (a sparse MoE block takes the norm's output as usual). Returns the
        stream as (stream, None) for a dense MLP, rounded where forward rounds."""
        stream = hidden if residual is None else hidden + residual
        stream = self.self_attn(positions, stream, norm=self.input_layernorm, residual=stream)
        if isinstance(self.mlp, LlamaMLP):
            return self.mlp(stream, norm=self.post_attention_layernorm, residual=stream), None
        return self.mlp(self.post_attention_layernorm(stream)), stream


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, make_attention):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, make_attention(config))
                                    for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.hf_config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        return self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    # Checkpoint projections that live stacked in one of our parameters: (ours, theirs, shard).
    stacked_params = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                      ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.make_attention)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config.hf_config, "tie_word_embeddings", False):
            self.lm_head.tie_to(self.model.embed_tokens)

    @property
    def tied_embeddings(self) -> bool:
        return self.lm_head.weight is self.model.embed_tokens.weight

    def make_attention(self, config: ModelConfig) -> nn.Module:
        bias = getattr(config.hf_config, "attention_bias", False)
        return LlamaAttention(config, qkv_bias=bias, o_bias=bias)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)


class Qwen2ForCausalLM(LlamaForCausalLM):
    def make_attention(self, config: ModelConfig) -> nn.Module:
        return LlamaAttention(config, qkv_bias=True, o_bias=False)
