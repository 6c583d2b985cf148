"""Compile kernels for an H100/H200 (sm_90) ahead of time, with no GPU: Triton's bundled ptxas
turns each into a cubin, so errors that only GPU compilation raises (the interpreter runs the
Python semantics) show up on the CPU. Prints one line per kernel (registers, local memory) and
exits 1 if any fails. Run with TRITON_INTERPRET unset (the test does):

    python tests/kernels/compile_sm90.py
"""

from __future__ import annotations

import os
import subprocess
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from metrale.kernels import causal_conv1d as CV
from metrale.kernels import dsa_indexer as DI
from metrale.kernels import fp8_moe_gemm as FM
from metrale.kernels import fp8_moe_gemv as FMV
from metrale.kernels import fp8_gemm as FG
from metrale.kernels import fp8_gemv as FV
from metrale.kernels import fp8_quant as FQ
from metrale.kernels import gated_delta_rule as GD
from metrale.kernels import gated_delta_step as GS
from metrale.kernels import gemv as G
from metrale.kernels import mla_decode as MD
from metrale.kernels import mla_extend as ME
from metrale.kernels import mla_latent_write as MW
from metrale.kernels import moe_gemv as MG
from metrale.kernels import moe_routing as MR
from metrale.kernels import paged_attention as A
from metrale.kernels import qk_norm_rope as Q
from metrale.kernels import ngram_match as NM
from metrale.kernels import rejection_sampling as RS
from metrale.kernels import sampling as S
from metrale.kernels import skinny_gemm as SG
from metrale.kernels import step_inputs as SI

F32, I64, I32, INT = "*fp32", "*i64", "*i32", "i32"
_TILE = {"n_rows": INT, "vocab": INT, "stride_row": INT, "num_chunks": INT, "eps": "fp32"}

# name: (kernel, argument types, constexprs, num_warps): the launch shapes of a Qwen3 vocabulary
_SKINNY = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "NUM_STAGES": 6, "HAS_BIAS": False, "IEEE": False,
           "INTERPRET": False}
KERNELS = {
    # the skinny GEMM of verify steps at Qwen3-8B's o_proj / down config (bf16)
    "skinny_gemm._skinny_kernel": (SG._skinny_kernel, {
        "x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "M": INT, "N": INT, "K": INT,
        "stride_xm": INT, "stride_wn": INT, "stride_ym": INT}, {**_SKINNY, "EVEN_K": True, "PDL": False}, 4, 6),
    # a step's inputs completed from the step before (asynchronous scheduling)
    "step_inputs._fill_kernel": (SI._fill_kernel, {
        **{name: I64 for name in ("input_ids_ptr", "positions_ptr", "slots_ptr", "tokens_ptr", "token_holes_ptr",
                                  "token_sources_ptr", "drafts_ptr", "draft_holes_ptr", "draft_sources_ptr",
                                  "accepted_ptr", "moved_seqs_ptr", "moved_unverified_ptr", "moved_last_rows_ptr",
                                  "moved_rows_ptr", "moved_row_seqs_ptr")},
        "seq_lens_ptr": I32, "tables_ptr": I32, "stride_t": INT, "block_size": INT, "num_tokens": INT,
        "num_drafts": INT, "num_moved": INT, "num_moved_rows": INT}, {"BLOCK": 1024}, 4),
    # prompt lookup on the device (the n-gram drafter in the runner): k = 4, n = 2..4
    "ngram_match._ngram_kernel": (NM._ngram_kernel, {
        "history_ptr": "*i32", "stride_h": INT, "rows_ptr": I64, "lengths_ptr": I64, "out_ptr": I64},
        {"MIN_N": 2, "MAX_N": 4, "K": 4, "K_PAD": 4, "BLOCK": 1024, "END_BITS": 40}, 4),
    # speculative decoding's rejection sampler: fp32 scores (sampled rows), a 152k vocabulary
    # (75 chunks of 2048)
    "rejection_sampling._chunk_stats_kernel": (RS._chunk_stats_kernel, {
        "scores_ptr": F32, "row_draft_ptr": I32, "draw_key_ptr": I64, "cmax_ptr": F32, "csum_ptr": F32,
        "cargmax_ptr": I32, "race_val_ptr": F32, "race_idx_ptr": I32, "vocab": INT, "stride_row": INT,
        "num_chunks": INT}, {"BLOCK_V": RS.BLOCK_V}, 8),
    "rejection_sampling._accept_kernel": (RS._accept_kernel, {
        "scores_ptr": F32, "row_start_ptr": I32, "num_drafts_ptr": I32, "drafts_ptr": I32, "greedy_ptr": I32,
        "accept_key_ptr": I64, "cmax_ptr": F32, "csum_ptr": F32, "cargmax_ptr": I32, "race_val_ptr": F32,
        "race_idx_ptr": I32, "num_accepted_ptr": I64, "tokens_ptr": I64, "stride_row": INT, "stride_drafts": INT,
        "num_chunks": INT}, {"BLOCK_C": 128}, 1),
    "sampling._chunk_max_kernel": (S._chunk_max_kernel, {"logits_ptr": F32, "chunk_max_ptr": F32, "temp_ptr": F32,
                                                         **_TILE}, {"ROWS": 1, "BLOCK_V": 4096}, 8),
    **{f"sampling._radix_count_kernel[MASS={mass}]": (
        S._radix_count_kernel, {"logits_ptr": F32, "hist_ptr": I64, "prefix_ptr": I64, "need_ptr": I64,
                                "floor_ptr": I64, "chunk_max_ptr": F32, "temp_ptr": F32, **_TILE},
        {"SHIFT": 8, "MASS": mass, "ROWS": 1, "BLOCK_V": 4096, "CHUNKS": 64}, 8) for mass in (False, True)},
    "sampling._radix_pick_kernel": (S._radix_pick_kernel, {"hist_ptr": I64, "prefix_ptr": I64, "need_ptr": I64,
                                                           "n_rows": INT}, {"ROWS": 1}, 4),
    "sampling._mass_kernel": (S._mass_kernel, {"logits_ptr": F32, "z_ptr": I64, "floor_ptr": I64, "on_ptr": I32,
                                               "chunk_max_ptr": F32, "temp_ptr": F32, **_TILE},
                              {"ROWS": 1, "BLOCK_V": 4096, "CHUNKS": 64}, 8),
    "sampling._chunk_draw_kernel": (S._chunk_draw_kernel, {
        "logits_ptr": F32, "chunk_max_ptr": F32, "thr_ptr": I64, "chunk_best_ptr": F32, "chunk_idx_ptr": I64,
        "temp_ptr": F32, "min_p_ptr": F32, "seed_ptr": I64, "offset_ptr": I64, **_TILE},
        {"ROWS": 1, "BLOCK_V": 4096, "CHUNKS": 64, "USE_MIN_P": True, "USE_THRESHOLD": True}, 8),
    "sampling._pick_chunk_kernel": (S._pick_chunk_kernel, {"chunk_best_ptr": F32, "chunk_idx_ptr": I64,
                                                           "out_ptr": I64, "n_rows": INT, "num_chunks": INT},
                                    {"ROWS": 1, "CHUNKS": 64}, 1),
    **{f"sampling._row_sample_kernel[filters={filters}]": (S._row_sample_kernel, {
        "logits_ptr": "*bf16", "out_ptr": I64, "temp_ptr": F32, "top_k_ptr": I64, "top_p_ptr": F32,
        "min_p_ptr": F32, "seed_ptr": I64, "offset_ptr": I64, "n_rows": INT, "vocab": INT, "stride_row": INT,
        "eps": "fp32"},
        {"ROWS": 1, "BLOCK_V": 4096, "USE_TOP_K": filters, "USE_TOP_P": filters, "USE_MIN_P": filters}, 8)
       for filters in (True, False)},
    "gemv._gemv_kernel[M=1]": (G._gemv_kernel, {
        "x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "N": INT, "K": INT,
        "stride_xm": INT, "stride_wn": INT, "stride_ym": INT},
        {"M": 1, "HAS_BIAS": False, "EVEN_K": True, "BLOCK_N": 1, "BLOCK_K": 4096, "VEC": 8, "NUM_STAGES": 1,
         "PREFETCH": True, "PDL": True}, 8),
    # The FP8 linear of Qwen3-8B-FP8 ([128, 128] blocks, bf16 x): the decode GEMV at its M = 1 and
    # N > 8192, M = 4 configs (fp8_gemv_config), the activation quantization, and the block-scaled
    # GEMM at the small-M and large-M rows of both fp8_gemm_config tables (num_stages is the
    # compiler's default here: the ring's depth is not compiled)
    **{f"fp8_gemv._fp8_gemv_kernel[M={m}]": (FV._fp8_gemv_kernel, {
        "x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": F32, "b_ptr": "*bf16", "y_ptr": "*bf16",
        **{name: INT for name in ("N", "K", "group_n", "group_k", "stride_xm", "stride_wn", "stride_sn",
                                  "stride_ym")}},
        {"M": m, "HAS_BIAS": False, "EVEN_K": True, "BLOCK_N": block_n, "BLOCK_K": block_k, "VEC": 16,
         "NUM_STAGES": stages, "PREFETCH": True, "PDL": True}, warps)
       for m, block_n, block_k, warps, stages in ((1, 2, 4096, 8, 1), (4, 4, 2048, 4, 3))},
    "fp8_quant._quantize_kernel": (FQ._quantize_kernel, {
        "x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": F32,
        **{name: INT for name in ("K", "group_size", "num_groups", "stride_xm", "stride_qm", "stride_sm")}},
        {"BLOCK_GROUPS": 16, "BLOCK_G": 128, "PDL": True}, 4),
    **{f"fp8_gemm._fp8_gemm_kernel[{'W8A8' if w8a8 else 'W8A16'},{scales},BLOCK_M={bm}]": (FG._fp8_gemm_kernel, {
        "x_ptr": "*fp8e4nv" if w8a8 else "*bf16", "xs_ptr": F32, "w_ptr": "*fp8e4nv", "ws_ptr": F32,
        "b_ptr": "*bf16", "y_ptr": "*bf16",
        **{name: INT for name in ("M", "N", "K", "group_n", "group_k", "act_group", "stride_xm", "stride_xsm",
                                  "stride_wn", "stride_wsn", "stride_ym")}},
        {"W8A8": w8a8, "WS_TILE": scales == "tile", "WS_CHANNEL": scales == "channel", "HAS_BIAS": True,
         "UPCAST": False, "IEEE_FP32": False, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": gm,
         "PDL": True}, warps)
       # weight scales: "tile" ([128, 128] blocks), "channel" (--quantization fp8), "column" (group_n = 1)
       for w8a8, scales, bm, bn, bk, gm, warps in (
           (True, "tile", 16, 64, 128, 1, 4), (True, "tile", 128, 128, 128, 8, 8),
           (True, "channel", 128, 128, 128, 8, 8), (True, "column", 128, 128, 128, 8, 8),
           (False, "tile", 16, 64, 128, 1, 4), (False, "tile", 128, 128, 64, 8, 8))},
    # The small-batch MoE GEMVs: Qwen3-Next-80B-A3B's routed experts (hidden 2048,
    # expert intermediate 512, top-10, bf16 routing weights) and Qwen3-30B-A3B's down (768, top-8)
    "moe_gemv._gate_up_kernel": (MG._gate_up_kernel, {
        "x_ptr": "*bf16", "w13_ptr": "*bf16", "ids_ptr": I64, "act_ptr": "*bf16",
        **{name: INT for name in ("hidden_size", "inter_size", "expert_start", "num_local", "stride_xm", "stride_we",
                                  "stride_wn", "stride_am")}},
        {"TOP_K": 10, "BLOCK_I": 2, "BLOCK_K": 2048, "VEC": 8, "EVEN_K": True, "FULL_CHUNKS": 1, "UNROLLED": True,
         "PDL": True}, 8),
    **{f"moe_gemv._down_kernel[I={inter}]": (MG._down_kernel, {
        "act_ptr": "*bf16", "w2_ptr": "*bf16", "ids_ptr": I64, "weights_ptr": "*bf16", "out_ptr": "*bf16",
        **{name: INT for name in ("hidden_size", "inter_size", "expert_start", "num_local", "stride_am", "stride_we",
                                  "stride_wn", "stride_om")}},
        {"TOP_K": top_k, "BLOCK_E": block_e, "BLOCK_N": 4, "BLOCK_K": 128, "VEC": 8, "EVEN_K": True,
         "FULL_CHUNKS": inter // 128, "UNROLLED": True, "PDL": True}, 4)
       for inter, top_k, block_e in ((512, 10, 16), (768, 8, 8))},
    # ... and the per-assignment stage 2 of the default config (moe_gemv_config: 8 rows, 128 of I)
    **{f"moe_gemv._down_per_assignment_kernel[I={inter}]": (MG._down_per_assignment_kernel, {
        "act_ptr": "*bf16", "w2_ptr": "*bf16", "ids_ptr": I64, "weights_ptr": "*bf16", "part_ptr": "*fp32",
        "arrivals_ptr": "*i32", "out_ptr": "*bf16",
        **{name: INT for name in ("hidden_size", "inter_size", "expert_start", "num_local", "stride_am", "stride_we",
                                  "stride_wn", "stride_om")}},
        {"TOP_K": top_k, "BLOCK_E": block_e, "BLOCK_N": 8, "BLOCK_K": 128, "VEC": 8, "EVEN_K": True,
         "FULL_CHUNKS": inter // 128, "UNROLLED": True, "PDL": True}, 4)
       for inter, top_k, block_e in ((512, 10, 16), (768, 8, 8))},
    # The FP8 MoE experts of Qwen3-30B-A3B-FP8 (128 experts, top-8, hidden 2048, expert intermediate
    # 768, [128, 128] blocks, bf16 activations): the grouped GEMM at the tiles of fp8_moe_gemm_config,
    # W8A8 and W8A16, with scalar scales per N tile ("tile") and per-column ones (group_n = 1,
    # "column"); GEMM 2's fused silu * up quantization; the small-batch GEMVs (fp8_moe_gemv_config)
    **{f"fp8_moe_gemm._fp8_grouped_gemm_kernel[{'W8A8' if a_fp8 else 'W8A16'},{scales},BLOCK_M={bm}]": (
        FM._fp8_grouped_gemm_kernel, {
            "a_ptr": "*fp8e4nv" if a_fp8 else "*bf16", "a_scale_ptr": F32, "w_ptr": "*fp8e4nv", "w_scale_ptr": F32,
            "c_ptr": "*bf16", "weight_ptr": F32, "sorted_ids_ptr": I32, "block_expert_ptr": I32,
            **{name: INT for name in ("N", "K", "num_assign", "a_row_divisor", "group_n", "group_k", "a_group",
                                      "stride_am", "stride_asm", "stride_we", "stride_wn", "stride_se", "stride_sn",
                                      "stride_cm")}},
        {"A_FP8": a_fp8, "W_SCALE_TILE": scales == "tile", "MUL_WEIGHT": True, "F32_DOT": False, "BLOCK_M": bm,
         "BLOCK_N": bn, "BLOCK_K": 128}, warps)
       for a_fp8, scales, bm, bn, warps in (
           (True, "tile", 16, 64, 4), (True, "tile", 64, 128, 4), (True, "tile", 128, 128, 8),
           (True, "column", 64, 128, 4), (False, "tile", 16, 64, 4), (False, "tile", 128, 128, 8),
           (False, "column", 64, 128, 4))},
    "fp8_moe_gemm._silu_mul_quant_kernel": (FM._silu_mul_quant_kernel, {
        "x_ptr": "*bf16", "ids_ptr": I64, "q_ptr": "*fp8e4nv", "s_ptr": F32,
        **{name: INT for name in ("d", "group", "num_groups", "expert_start", "num_local", "stride_x", "stride_q",
                                  "stride_s")}},
        {"BLOCK_G": 8, "GROUP": 128}, 4),
    "fp8_moe_gemv._gate_up_kernel": (FMV._gate_up_kernel, {
        "x_ptr": "*bf16", "w13_ptr": "*fp8e4nv", "s13_ptr": F32, "ids_ptr": I64, "act_ptr": "*bf16",
        **{name: INT for name in ("hidden_size", "inter_size", "expert_start", "num_local", "group_n", "group_k",
                                  "stride_xm", "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_am")}},
        {"TOP_K": 8, "BLOCK_I": 1, "BLOCK_K": 2048, "VEC": 16, "EVEN_K": True, "PDL": True}, 4),
    "fp8_moe_gemv._down_kernel": (FMV._down_kernel, {
        "act_ptr": "*bf16", "w2_ptr": "*fp8e4nv", "s2_ptr": F32, "ids_ptr": I64, "weights_ptr": "*bf16",
        "out_ptr": "*bf16",
        **{name: INT for name in ("hidden_size", "inter_size", "expert_start", "num_local", "group_n", "group_k",
                                  "stride_am", "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_om")}},
        {"TOP_K": 8, "BLOCK_E": 8, "BLOCK_N": 1, "BLOCK_K": 256, "VEC": 16, "EVEN_K": True, "PREFETCH": True,
         "PDL": True}, 4),
    # Qwen3-Next-80B-A3B's router: softmax top-10 of 512 experts, renormalised
    "moe_routing._softmax_topk_kernel": (MR._softmax_topk_kernel, {
        "logits_ptr": "*bf16", "weights_ptr": F32, "ids_ptr": I64, "n_rows": INT, "num_experts": INT,
        "stride_row": INT}, {"TOP_K": 10, "BLOCK_K": 16, "BLOCK_E": 512, "RENORMALIZE": True, "PDL": True}, 4),
    # ... and the same routing with the router's GEMV in one launch (hidden 2048 bf16, 2 rows a program)
    "moe_routing._router_topk_kernel": (MR._router_topk_kernel, {
        "x_ptr": "*bf16", "w_ptr": "*bf16", "logits_ptr": F32, "arrivals_ptr": I32, "weights_ptr": "*bf16",
        "ids_ptr": I64, "hidden_size": INT, "num_experts": INT, "stride_xm": INT, "stride_wn": INT},
        {"TOP_K": 10, "BLOCK_K": 16, "BLOCK_E": 512, "ROWS": 2, "BLOCK_H": 2048, "VEC": 8, "RENORMALIZE": True,
         "PDL": True}, 8),
    # Qwen3-8B's attention: 32 q heads over 8 kv heads of 128, bf16 cache
    # (and a verify step's multi-query decode: 1 + 4 query rows per sequence)
    **{f"paged_attention._decode_kernel[DIRECT={direct}{f',NUM_Q={nq},GROUP={group}' if nq > 1 else ''}]": (A._decode_kernel, {
        "q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "bt_ptr": I32, "seq_lens_ptr": I32,
        "query_lens_ptr": I32, "part_o_ptr": F32, "part_lse_ptr": F32, "out_ptr": "*bf16",
        **{name: INT for name in ("stride_qs", "stride_qh", "stride_cb", "stride_co", "stride_ch", "stride_bt",
                                  "stride_ps", "stride_ph", "stride_os", "stride_oh")},
        "scale_log2e": "fp32", "v_scale": "fp32", "block_size": INT, "num_splits": INT},
        {"GROUP": group, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_H": block_h, "BLOCK_N": 64,
         "PRECISION": None, "UPCAST": False, "DIRECT": direct, "PDL": True, "NUM_Q": nq}, warps)
       for direct, nq, group, block_h, warps in ((False, 1, 4, 16, 4), (True, 1, 4, 16, 4), (False, 5, 4, 32, 4),
                                                 (False, 9, 8, 128, 8))},  # the last: a GQA group of 8, k = 8
    **{f"paged_attention._decode_merge_kernel{f'[NUM_Q={nq}]' if nq > 1 else ''}": (A._decode_merge_kernel, {
        "part_o_ptr": F32, "part_lse_ptr": F32, "out_ptr": "*bf16", "seq_lens_ptr": I32, "query_lens_ptr": I32,
        **{name: INT for name in ("stride_ps", "stride_ph", "stride_os", "stride_oh", "num_splits")}},
        {"HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_S": 16, "BLOCK_N": 64, "PDL": True, "NUM_Q": nq}, 4)
       for nq in (1, 5)},
    # DeepSeek-V3's MLA at tp=1: 128 heads, latent 512 + rope 64, q/k 128 + 64, v 128; the module's
    # default tiles. Split bf16 decode, and a direct fp8 sparse decode over mapped rows
    **{f"mla_decode._mla_decode_kernel[{cache}]": (MD._mla_decode_kernel, {
        "q_lat_ptr": "*bf16", "q_pe_ptr": "*bf16", "cache_ptr": cache, "bt_ptr": I32, "seq_lens_ptr": I32,
        "row_seq_ptr": I32, "row_kv_len_ptr": I32, "topk_ptr": I32, "part_o_ptr": F32, "part_lse_ptr": F32,
        "out_ptr": "*bf16",
        **{name: INT for name in ("stride_qlt", "stride_qlh", "stride_qpt", "stride_qph", "stride_cb", "stride_co",
                                  "stride_bt", "stride_tk", "stride_ot", "stride_oh", "num_heads", "block_size",
                                  "num_splits", "num_topk")},
        "scale_log2e": "fp32", "v_scale": "fp32"},
        {"LATENT": 512, "ROPE": 64, "BLOCK_L": 512, "BLOCK_R": 64, "BLOCK_H": MD.BLOCK_H, "BLOCK_N": MD.FP8_BLOCK_N if fp8 else MD.BLOCK_N,
         "ROW_MAP": fp8, "SPARSE": fp8, "DIRECT": fp8, "PRECISION": None, "UPCAST": False, "PDL": True},
        MD.NUM_WARPS, MD.NUM_STAGES) for cache, fp8 in (("*bf16", False), ("*fp8e4nv", True))},
    # the latent-halves candidates for 64-row wgmma tiles (benchmarks/mla_decode_bench.py's SWEEP):
    # value halves over two programs at 64 heads, through the merge and direct (one split: batch
    # 256), and at 128 heads through the merge. Spilling, so not here: "halves" (both value halves
    # in one program), split_v 64 x 64 direct and 128 x 32 direct (one register: STL / LDL)
    **{f"mla_decode._mla_decode_halves_kernel[split_v {bh}x{bn}x{nw}{' direct' * direct}]": (MD._mla_decode_halves_kernel, {
        "q_lat_ptr": "*bf16", "q_pe_ptr": "*bf16", "cache_ptr": "*bf16", "bt_ptr": I32, "seq_lens_ptr": I32,
        "row_seq_ptr": I32, "row_kv_len_ptr": I32, "topk_ptr": I32, "part_o_ptr": F32, "part_lse_ptr": F32,
        "out_ptr": "*bf16",
        **{name: INT for name in ("stride_qlt", "stride_qlh", "stride_qpt", "stride_qph", "stride_cb", "stride_co",
                                  "stride_bt", "stride_tk", "stride_ot", "stride_oh", "num_heads", "block_size",
                                  "num_splits", "num_topk")},
        "scale_log2e": "fp32", "v_scale": "fp32"},
        {"LATENT": 512, "ROPE": 64, "BLOCK_L": 512, "BLOCK_R": 64, "BLOCK_H": bh, "BLOCK_N": bn,
         "ROW_MAP": False, "SPARSE": False, "DIRECT": direct, "PRECISION": None, "UPCAST": False, "PDL": True,
         "V_PROGRAMS": MD.VARIANTS["split_v"]},
        nw, 2) for bh, bn, nw, direct in ((64, 32, 8, False), (64, 32, 8, True), (128, 32, 8, False))},
    "mla_decode._mla_merge_kernel": (MD._mla_merge_kernel, {
        "part_o_ptr": F32, "part_lse_ptr": F32, "out_ptr": "*bf16",
        **{name: INT for name in ("stride_ot", "stride_oh", "num_heads", "num_splits")}},
        {"LATENT": 512, "BLOCK_L": 512, "BLOCK_S": 16, "PDL": True}, 4),
    "mla_extend._mla_extend_kernel": (ME._mla_extend_kernel, {
        **{name: "*bf16" for name in ("qn_ptr", "qp_ptr", "kn_ptr", "kp_ptr", "v_ptr", "out_ptr")},
        **{name: I32 for name in ("cu_q_ptr", "seq_lens_ptr", "seq_ids_ptr", "cu_k_ptr")},
        **{name: INT for name in ("stride_qnt", "stride_qnh", "stride_qpt", "stride_qph", "stride_knt", "stride_knh",
                                  "stride_kpt", "stride_vt", "stride_vh", "stride_ot", "stride_oh")},
        "scale_log2e": "fp32"},
        {"NOPE": 128, "ROPE": 64, "V_DIM": 128, "BLOCK_DN": 128, "BLOCK_DR": 64, "BLOCK_DV": 128,
         "BLOCK_M": ME.BLOCK_M, "BLOCK_N": ME.BLOCK_N, "PRECISION": None, "UPCAST": False, "PDL": True}, ME.NUM_WARPS),
    "mla_latent_write._write_latent_kernel[FP8]": (MW._write_latent_kernel, {
        "kv_c_ptr": "*bf16", "k_pe_ptr": "*bf16", "cache_ptr": "*fp8e4nv", "slot_ptr": I64,
        **{name: INT for name in ("stride_ct", "stride_pt", "stride_cb", "stride_co", "block_size")},
        "inv_scale": "fp32"}, {"LATENT": 512, "ROPE": 64, "BLOCK_L": 512, "BLOCK_R": 64, "FP8": True}, 4),
    # DeepSeek-V3.2's DSA indexer: 64 heads of 128, fp8 key write, scores over bf16 and fp8 keys,
    # the top-2048 radix select at its widest tile
    "dsa_indexer._write_keys_kernel[FP8]": (DI._write_keys_kernel, {
        "k_ptr": "*bf16", "key_cache_ptr": "*fp8e4nv", "scale_cache_ptr": F32, "slot_ptr": I64,
        **{name: INT for name in ("stride_kt", "stride_cb", "stride_co", "stride_sb", "stride_so", "block_size")}},
        {"HEAD_DIM": 128, "BLOCK_D": 128, "FP8": True}, 4),
    **{f"dsa_indexer._scores_kernel[{cache}]": (DI._scores_kernel, {
        "q_ptr": "*bf16", "w_ptr": F32, "key_cache_ptr": cache, "scale_cache_ptr": F32, "bt_ptr": I32,
        "row_seq_ptr": I32, "row_pos_ptr": I32, "out_ptr": F32,
        **{name: INT for name in ("stride_qt", "stride_qh", "stride_wt", "stride_cb", "stride_co", "stride_sb",
                                  "stride_so", "stride_bt", "stride_ot", "block_size", "max_context", "split_len")}},
        {"NUM_HEADS": 64, "HEAD_DIM": 128, "BLOCK_H": 64, "BLOCK_D": 128, "BLOCK_N": DI.SCORES_BLOCK_N, "FP8": fp8,
         "PRECISION": None, "UPCAST": False}, 4) for cache, fp8 in (("*bf16", False), ("*fp8e4nv", True))},
    "dsa_indexer._topk_kernel": (DI._topk_kernel, {
        "scores_ptr": F32, "row_pos_ptr": I32, "out_ptr": I32,
        **{name: INT for name in ("stride_st", "stride_ot", "max_context", "index_topk")}},
        {"BLOCK_N": DI.TOPK_BLOCK_N}, 8),
    "qk_norm_rope._qk_norm_rope_kernel[STORE_KV]": (Q._qk_norm_rope_kernel, {
        "pos_ptr": I64, "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "qw_ptr": "*bf16", "kw_ptr": "*bf16",
        "cos_sin_ptr": F32, "slot_ptr": I64, "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
        **{name: INT for name in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh",
                                  "stride_cos_sin", "stride_cb", "stride_co", "stride_ch", "num_q_heads",
                                  "num_kv_heads")},
        "eps": "fp32", "block_size": INT, "inv_k_scale": "fp32", "inv_v_scale": "fp32"},
        {"NORM": True, "STORE_KV": True, "FP8": False, "HEAD_DIM": 128, "ROT_DIM": 128, "IS_NEOX": True,
         "HALF": 64, "BLOCK_HALF": 64, "BLOCK_D": 128, "BLOCK_H": 8, "PDL": True}, 1),
    # Qwen3-Next-80B / Qwen3.5's Gated DeltaNet at tp=1: conv over 8192 channels (width 4, no bias,
    # the conv state channels-contiguous), 16 key heads and 32 value heads of 128, bf16, fp32 state
    "causal_conv1d._conv1d_varlen_kernel": (CV._conv1d_varlen_kernel, {
        "x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "state_ptr": "*bf16", "out_ptr": "*bf16",
        "qsl_ptr": I32, "blocks_ptr": I32, "slots_ptr": I32, "has_state_ptr": "*i1",
        **{name: INT for name in ("channels", "stride_x", "stride_out", "stride_w", "stride_ss", "stride_sw")}},
        {"stride_sc": 1, "KW": 4, "HAS_BIAS": False, "SILU": True, "BLOCK_T": 64, "BLOCK_C": 1024}, 4),
    "causal_conv1d._conv1d_step_kernel": (CV._conv1d_step_kernel, {
        "x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "state_ptr": "*bf16", "out_ptr": "*bf16",
        "slots_ptr": I32,
        **{name: INT for name in ("channels", "stride_x", "stride_out", "stride_w", "stride_ss", "stride_sw")}},
        {"stride_sc": 1, "KW": 4, "HAS_BIAS": False, "SILU": True, "BLOCK_C": 1024, "PDL": True}, 4),
    "gated_delta_step._gating_kernel": (GS._gating_kernel, {
        "a_ptr": "*bf16", "b_ptr": "*bf16", "A_ptr": F32, "dt_bias_ptr": "*bf16", "g_ptr": F32,
        "beta_ptr": "*bf16", **{name: INT for name in ("num_rows", "heads", "stride_a", "stride_b")}},
        {"BLOCK_R": 64, "BLOCK_H": 32}, 4),
    "gated_delta_step._step_kernel": (GS._step_kernel, {
        "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "a_ptr": "*bf16", "b_ptr": "*bf16",
        "A_ptr": F32, "dt_bias_ptr": "*bf16", "state_ptr": F32, "slots_ptr": I32, "out_ptr": "*bf16",
        **{name: INT for name in ("stride_qn", "stride_qh", "stride_kn", "stride_kh", "stride_vn", "stride_vh",
                                  "stride_an", "stride_bn", "stride_ss", "stride_sh", "stride_on", "stride_oh",
                                  "group")}, "scale": "fp32"},
        {"DK": 128, "DV": 128, "BV": 32, "PDL": True}, 4),
    "gated_delta_rule._prepare_kernel": (GD._prepare_kernel, {
        "k_ptr": "*bf16", "v_ptr": "*bf16", "g_ptr": F32, "beta_ptr": "*bf16", "qsl_ptr": I32, "chunks_ptr": I32,
        "w_ptr": "*bf16", "u_ptr": "*bf16", "G_ptr": F32,
        **{name: INT for name in ("stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_gt", "stride_bt",
                                  "value_heads", "group")}},
        {"DK": 128, "DV": 128, "BD": 64, "CHUNK": 64, "SUB": 16, "FP32": False, "UPCAST": False}, 4),
    "gated_delta_rule._state_kernel": (GD._state_kernel, {
        "k_ptr": "*bf16", "w_ptr": "*bf16", "u_ptr": "*bf16", "G_ptr": F32, "qsl_ptr": I32, "first_chunk_ptr": I32,
        "slots_ptr": I32, "has_state_ptr": "*i1", "state_ptr": F32, "h_ptr": "*bf16",
        **{name: INT for name in ("stride_kt", "stride_kh", "stride_ss", "stride_sh", "value_heads", "group")}},
        {"DK": 128, "DV": 128, "BV": 32, "CHUNK": 64, "FP32": False, "UPCAST": False}, 4),
    "gated_delta_rule._output_kernel": (GD._output_kernel, {
        "q_ptr": "*bf16", "k_ptr": "*bf16", "u_ptr": "*bf16", "G_ptr": F32, "h_ptr": "*bf16", "qsl_ptr": I32,
        "chunks_ptr": I32, "out_ptr": "*bf16",
        **{name: INT for name in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_ot", "stride_oh",
                                  "value_heads", "group")}, "scale": "fp32"},
        {"DK": 128, "DV": 128, "BV": 64, "CHUNK": 64, "FP32": False, "UPCAST": False}, 4),
}


# Integer arguments that are multiples of 16 in every real launch (the cache and head strides,
# the block size); pointers are always 16-byte aligned (torch allocations, the runner's views).
# Triton specialises launches on both, so the check compiles with the same facts.
ALIGNED_INTS = {"stride_qs", "stride_qh", "stride_os", "stride_oh", "stride_cb", "stride_co", "stride_ch",
                "block_size", "stride_qt", "stride_kt", "stride_vt", "stride_kh", "stride_vh",
                "N", "K", "stride_xm", "stride_wn", "stride_ym",  # the GEMV at model shapes
                # the Gated DeltaNet kernels: conv rows and channels, state slots and heads, q/k/v rows
                "channels", "stride_x", "stride_out", "stride_ss", "stride_sw", "stride_sh", "stride_qn",
                "stride_kn", "stride_vn", "stride_on", "stride_ot",
                # the FP8 MoE kernels: expert strides of the scales, C rows, quantized activation rows
                "stride_se", "stride_cm", "stride_q",
                # the small-batch MoE GEMVs: hidden and intermediate sizes, expert and row strides
                "hidden_size", "inter_size", "stride_we", "stride_am", "stride_om",
                # the FP8 linear: activation groups of 128, K / 128 scale columns, q rows
                "group_size", "act_group", "stride_qm", "stride_sm", "stride_xsm", "stride_wsn"}


def _launch_attrs(kernel, types: dict) -> dict:
    names = list(kernel.arg_names)
    return {(names.index(arg),): [["tt.divisibility", 16]] for arg, kind in types.items()
            if kind.startswith("*") or arg in ALIGNED_INTS}


def resource_usage(cubin: bytes, name: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"met_{os.getpid()}_{abs(hash(name))}.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    try:
        out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True, timeout=60).stdout
    finally:
        os.remove(path)
    return next((line.split("Resource usage:")[-1].strip() for line in out.splitlines() if "REG:" in line), "?")


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    target, failed = GPUTarget("cuda", 90, 32), []
    for name, (kernel, types, constexprs, num_warps, *num_stages) in KERNELS.items():
        signature = dict(types, **{k: "constexpr" for k in constexprs})
        # An entry may name the num_stages its launch uses (Triton's default, 3, otherwise).
        options = {"num_warps": num_warps, **({"num_stages": num_stages[0]} if num_stages else {})}
        try:
            compiled = triton.compile(ASTSource(kernel, signature, constexprs, _launch_attrs(kernel, types)),
                                      target=target, options=options)
        except Exception as e:  # noqa: BLE001 - report every kernel, then fail
            failed.append(name)
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:2000]}")
            continue
        wgmma = compiled.asm["ptx"].count("wgmma.mma_async")  # Hopper's tensor-core instruction
        print(f"{name}: {resource_usage(compiled.asm['cubin'], name)} WGMMA:{wgmma}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
