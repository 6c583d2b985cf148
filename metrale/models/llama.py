"""Llama and Qwen2: pre-norm decoder blocks of GQA attention with RoPE and a SwiGLU MLP.

Qwen2 is Llama with a bias on the Q, K and V projections; Llama-3 adds rope scaling (handled by
get_rope from the config). Qwen3 (qwen3.py) adds per-head RMSNorm on Q and K.
"""

from __future__ import annotations

import torch
from torch import nn

from metrale.config.model_config import ModelConfig
from metrale.layers.activation import SiluAndMul
from metrale.layers.attention import Attention
from metrale.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from metrale.layers.norm import RMSNorm
from metrale.layers.rotary import RotaryEmbedding
from metrale.layers.vocab import ParallelLMHead, VocabParallelEmbedding


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


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

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.qkv_proj.q_size, self.qkv_proj.kv_size,
                                               self.qkv_proj.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.attn.can_fuse_prologue(q):  # norms, RoPE and the K/V write in one launch
            norms = self.per_head_qk_norms()
            if norms is None:
                q, k = self.transform_qk(q, k)
            return self.o_proj(self.attn.rope_and_attend(positions, q, k, v, self.rotary_emb, norms))
        q, k = self.rotate_qk(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attention: nn.Module):
        super().__init__()
        hf = config.hf_config
        self.self_attn = attention
        self.mlp = LlamaMLP(config.hidden_size, hf.intermediate_size, bias=getattr(hf, "mlp_bias", False))
        self.input_layernorm = RMSNorm(config.hidden_size, hf.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, hf.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


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
        hidden, _ = self.norm(hidden, residual)
        return hidden


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
