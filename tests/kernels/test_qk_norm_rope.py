"""Fused per-head q/k RMSNorm + rotary (Qwen3) vs the references and the two-step kernel path."""

import pytest
import torch

from metrale.kernels import interpret_mode, reference
from metrale.kernels.kv_cache_write import write_kv_cache_triton
from metrale.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_triton, rope_store_kv_triton
from metrale.kernels.rms_norm import rms_norm_triton
from metrale.kernels.rotary import apply_rotary_triton

# Same casts as the two-step path (norm rounded to the dtype, then fp32 rotary rounded once);
# vs the torch reference only the fp32 sum order of the mean square differs.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (1e-3, 1e-3)}
EPS = 1e-6
MAX_POS = 4096


def cos_sin_cache(max_pos, rotary_dim, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _inputs(device, dtype, num_tokens, num_heads, num_kv_heads, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    # q and k are strided views into one fused qkv buffer, as the model's split produces them
    qkv = (torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g) * 3).to(dtype=dtype,
                                                                                                   device=device)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.reshape(-1, num_heads, head_dim), k.reshape(-1, num_kv_heads, head_dim)
    # (one token's views count as contiguous whatever their strides)
    assert num_tokens <= 1 or not (q.is_contiguous() or k.is_contiguous())
    positions = torch.randint(0, MAX_POS, (num_tokens,), generator=g).to(device)
    q_w = (1 + 0.1 * torch.randn(head_dim, generator=g)).to(dtype=dtype, device=device)
    k_w = (1 + 0.1 * torch.randn(head_dim, generator=g)).to(dtype=dtype, device=device)
    return positions, qkv, q, k, q_w, k_w


def _assert_close(out, ref):
    """Within rounding: a norm output an ulp off (rstd's sum order; the interpreter truncates
    fp32 -> bf16) moves the rotated value by an ulp of the head's LARGEST values, which the
    rotation's cancellation can leave next to a small result: an absolute, not relative, error."""
    rtol, atol = TOL[out.dtype]
    ulps = 4 if out.dtype == torch.bfloat16 and interpret_mode() else 2
    atol = max(atol, ulps * torch.finfo(out.dtype).eps * ref.abs().max().item())
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)


def _check(device, dtype, num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim, is_neox):
    positions, qkv, q, k, q_w, k_w = _inputs(device, dtype, num_tokens, num_heads, num_kv_heads, head_dim)
    cache = cos_sin_cache(MAX_POS, rotary_dim).to(device)
    q_ref, k_ref = reference.qk_norm_rope(positions, q, k, q_w, k_w, EPS, cache, rotary_dim, is_neox)
    # the two-step path the fused kernel replaces on GPU: norm kernel (new tensors), rotary kernel (in place)
    q_two, k_two = apply_rotary_triton(positions, rms_norm_triton(q, q_w, EPS), rms_norm_triton(k, k_w, EPS),
                                       cache, rotary_dim, is_neox)
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim:].clone()

    q_out, k_out = qk_norm_rope_triton(positions, q, k, q_w, k_w, EPS, cache, rotary_dim, is_neox)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()  # in place
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim:], v_before)  # v untouched
    for out, ref, two in ((q, q_ref, q_two), (k, k_ref, k_two)):
        _assert_close(out, ref)
        if interpret_mode():
            # same casts and the same mean-square reduction as the two kernels: bit-identical
            assert torch.equal(out, two)
        else:  # a GPU compiler may order the reductions of two different kernels differently
            _assert_close(out, two)
            assert (out != two).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_qk_norm_rope(device, dtype, is_neox, head_dim):
    _check(device, dtype, num_tokens=5, num_heads=4, num_kv_heads=2, head_dim=head_dim, rotary_dim=head_dim,
           is_neox=is_neox)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("head_dim,rotary_dim", [(128, 32), (64, 48)])  # 48: half of 24 is not a power of two
def test_qk_norm_rope_partial(device, is_neox, head_dim, rotary_dim):
    _check(device, torch.float16, num_tokens=3, num_heads=3, num_kv_heads=1, head_dim=head_dim,
           rotary_dim=rotary_dim, is_neox=is_neox)
    _check(device, torch.float32, num_tokens=2, num_heads=2, num_kv_heads=2, head_dim=head_dim,
           rotary_dim=rotary_dim, is_neox=is_neox)


def _check_store(device, dtype, cache_dtype, norm, is_neox, head_dim=64, rotary_dim=64, num_tokens=6,
                 num_heads=4, num_kv_heads=2, scales=(1.0, 1.0)):
    """The one-launch prologue (norm?, rotary, K/V store) against the launches it replaces:
    qk_norm_rope (or rotary) in place, then the KV write kernel. Same numerics: identical."""
    positions, qkv, q, k, q_w, k_w = _inputs(device, dtype, num_tokens, num_heads, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].reshape(-1, num_kv_heads, head_dim)
    cache = cos_sin_cache(MAX_POS, rotary_dim).to(device)
    block_size = 4
    num_blocks = num_tokens // block_size + 2  # some slots stay empty
    slots = torch.randperm(block_size * num_blocks, generator=torch.Generator().manual_seed(3))[:num_tokens]
    slots[1] = -1  # a padding token stores nothing
    slots = slots.to(device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    poison = torch.full(shape, 7.0, device=device).to(cache_dtype)
    k_cache, v_cache, k_two, v_two = (poison.clone() for _ in range(4))
    qk_norm = (q_w, k_w, EPS) if norm else None

    q2, k2 = q.clone(), k.clone()
    if norm:
        qk_norm_rope_triton(positions, q2, k2, q_w, k_w, EPS, cache, rotary_dim, is_neox)
    else:
        apply_rotary_triton(positions, q2, k2, cache, rotary_dim, is_neox)
    write_kv_cache_triton(k2, v, k_two, v_two, slots, *scales)

    rope_store_kv_triton(positions, q, k, v, cache, rotary_dim, is_neox, qk_norm=qk_norm,
                         kv_cache=(k_cache, v_cache), slot_mapping=slots, k_scale=scales[0], v_scale=scales[1])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0].cpu()] = False
    assert torch.equal(k_cache.view(-1, num_kv_heads, head_dim)[untouched.to(device)].view(torch.uint8),
                       poison.view(-1, num_kv_heads, head_dim)[untouched.to(device)].view(torch.uint8))
    if norm and cache_dtype == torch.float8_e4m3fn and q.is_cuda:
        # The fp8-storing variant compiles the head's mean square with another layout, so its sum
        # (rstd's last bit) may differ from the variant without the store: on an H200, 8 of 1.2M
        # q elements one bf16 step apart (the rotation of a near-cancelling pair). Rare and small.
        for name, got, want in (("q", q, q2), ("k", k, k2)):
            torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -6,
                                       msg=lambda m, name=name: f"{name}: {m}")
            assert (got != want).float().mean() < 1e-4, name
        for name, got, want in (("k cache", k_cache, k_two), ("v cache", v_cache, v_two)):
            assert (got.view(torch.uint8) != want.view(torch.uint8)).float().mean() < 1e-4, name
        return
    exact = dict(rtol=0, atol=0)  # assert_close rather than equal: a failure names where and by how much
    torch.testing.assert_close(q, q2, **exact, msg=lambda m: f"q: {m}")
    torch.testing.assert_close(k, k2, **exact, msg=lambda m: f"k: {m}")
    # fp8 has no comparison ops on some builds: compare the bytes
    torch.testing.assert_close(k_cache.view(torch.uint8), k_two.view(torch.uint8), **exact,
                               msg=lambda m: f"k cache: {m}")
    torch.testing.assert_close(v_cache.view(torch.uint8), v_two.view(torch.uint8), **exact,
                               msg=lambda m: f"v cache: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("is_neox", [True, False])
def test_rope_store_kv(device, dtype, norm, is_neox):
    _check_store(device, dtype, dtype, norm, is_neox)


@pytest.mark.parametrize("norm", [True, False])
def test_rope_store_kv_head_blocks(device, norm):
    # 12 q heads and 3 kv heads in blocks of 8: two q blocks (the second half empty), one
    # partly empty k block and v block
    _check_store(device, torch.float32, torch.float32, norm, True, head_dim=32, rotary_dim=32, num_heads=12,
                 num_kv_heads=3)


@pytest.mark.parametrize("norm", [True, False])
def test_rope_store_kv_partial_rotary_and_fp8(device, norm):
    _check_store(device, torch.float16, torch.float16, norm, True, head_dim=64, rotary_dim=48, num_heads=3,
                 num_kv_heads=1)
    _check_store(device, torch.bfloat16, torch.float8_e4m3fn, norm, True, scales=(0.05, 0.02))


def test_qk_norm_rope_no_tokens(device):
    positions, qkv, q, k, q_w, k_w = _inputs(device, torch.float32, 0, 4, 2, 64)
    cache = cos_sin_cache(MAX_POS, 64).to(device)
    q_out, k_out = qk_norm_rope_triton(positions, q, k, q_w, k_w, EPS, cache, 64, True)
    assert q_out.shape == (0, 4, 64) and k_out.shape == (0, 2, 64)


def test_reference_is_the_two_step_composition():
    """reference.qk_norm_rope = rms_norm on each head (rounded to the dtype), then apply_rotary."""
    positions, _, q, k, q_w, k_w = _inputs("cpu", torch.bfloat16, 4, 4, 2, 64)
    cache = cos_sin_cache(MAX_POS, 64)
    q_ref, k_ref = reference.qk_norm_rope(positions, q, k, q_w, k_w, EPS, cache, 64, True)
    q_two, k_two = reference.apply_rotary(positions, reference.rms_norm(q, q_w, EPS),
                                          reference.rms_norm(k, k_w, EPS), cache, 64, True)
    assert torch.equal(q_ref, q_two) and torch.equal(k_ref, k_two)


def test_dispatch_cpu_is_reference_in_place():
    positions, _, q, k, q_w, k_w = _inputs("cpu", torch.float32, 3, 4, 2, 64)
    cache = cos_sin_cache(MAX_POS, 64)
    q_ref, k_ref = reference.qk_norm_rope(positions, q, k, q_w, k_w, EPS, cache, 64, False)
    q_out, k_out = qk_norm_rope(positions, q, k, q_w, k_w, EPS, cache, 64, False)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


def _tiny_qwen3_attention(device, dtype):
    from transformers import Qwen3Config

    from metrale.config.model_config import ModelConfig
    from metrale.models.qwen3 import Qwen3Attention

    hf = Qwen3Config(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=64,
                     rms_norm_eps=1e-6, max_position_embeddings=256)
    config = ModelConfig(model_dir="", hf_config=hf, architecture="Qwen3ForCausalLM", dtype=dtype,
                         max_model_len=256, vocab_size=hf.vocab_size, hidden_size=96, num_layers=1,
                         num_attention_heads=6, num_kv_heads=2, head_dim=64)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as the model loader builds layers (the rope cache stays fp32)
    try:
        with torch.device(device):
            layer = Qwen3Attention(config, layer_index=0)
    finally:
        torch.set_default_dtype(previous)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in layer.parameters():  # norm weights near 1, projections random
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if p.dim() == 1 else 0.2 * noise)
    assert layer.rotary_emb.cos_sin_cache.dtype == torch.float32 and layer.q_norm.weight.dtype == dtype
    return layer


def _layer_qk(layer, hidden):
    q, k, _ = layer.qkv_proj(hidden).split([layer.qkv_proj.q_size, layer.qkv_proj.kv_size,
                                            layer.qkv_proj.kv_size], dim=-1)
    attn = layer.attn
    return q.reshape(-1, attn.num_heads, attn.head_dim), k.reshape(-1, attn.num_kv_heads, attn.head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen3_layer_fused_matches_unfused(device, dtype):
    """A tiny Qwen3 attention layer: the fused kernel forced on its q/k vs the norm and RoPE modules
    one after the other, and vs the Attention layer's own norm-and-RoPE step (on CPU the modules;
    on CUDA the fused kernel, which it picks for plain RMSNorms)."""
    layer = _tiny_qwen3_attention(device, dtype)
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(7, 96, generator=g).to(dtype=dtype, device=device)
    positions = torch.tensor([0, 1, 2, 3, 100, 17, 255], device=device)
    with torch.no_grad():
        q, k = _layer_qk(layer, hidden)
        q_unfused, k_unfused = layer.rotary_emb(positions, layer.q_norm(q.clone()), layer.k_norm(k.clone()))
        attn = layer.attn
        q_layer, k_layer = attn._norm_and_rope(positions, q.clone(), k.clone(), attn._fused_norm)
        rope = layer.rotary_emb
        q_f, k_f = qk_norm_rope_triton(positions, q, k, layer.q_norm.weight, layer.k_norm.weight, layer.q_norm.eps,
                                       rope.cos_sin_cache, rope.rotary_dim, rope.is_neox_style)
    # fp32: the unfused CPU rotary rounds nothing, so the two agree to fp32 rounding; bf16: the CPU
    # module rounds cos/sin and the products to bf16 (HF's order), a few bf16 ulps apart
    rtol, atol = TOL[dtype] if dtype == torch.float32 else (3e-2, 3e-2)
    for fused, unfused, via_layer in ((q_f, q_unfused, q_layer), (k_f, k_unfused, k_layer)):
        torch.testing.assert_close(fused, unfused, rtol=rtol, atol=atol)
        torch.testing.assert_close(via_layer, unfused, rtol=rtol, atol=atol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 256, 4096])
def test_qk_norm_rope_gpu_qwen3_8b(dtype, num_tokens):
    """Qwen3-8B's attention shapes: 32 q heads, 8 kv heads, head_dim 128, neox, full rotary."""
    _check("cuda", dtype, num_tokens=num_tokens, num_heads=32, num_kv_heads=8, head_dim=128, rotary_dim=128,
           is_neox=True)


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_rope_store_kv_gpu_8b_shapes(norm, cache_dtype):
    _check_store("cuda", torch.bfloat16, cache_dtype, norm, True, head_dim=128, rotary_dim=128, num_tokens=300,
                 num_heads=32, num_kv_heads=8, scales=(0.05, 0.02) if cache_dtype != torch.bfloat16 else (1.0, 1.0))
