#!/usr/bin/env bash
# The second half of the GPU suite: FP8 next to bf16, and the MoE model, with the GPU tests
# that cover them. OUT=/tmp/out bash benchmarks/run_final.sh
set -uo pipefail
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/met-gpu-suite}"; mkdir -p "$OUT"
met() { python3 -m metrale.entrypoints.cli "$@"; }
echo "${MET_COMMIT:-unknown}" > "$OUT/commit.txt"
python3 -m pytest -q tests/gpu tests/kernels/test_fp8_kv.py tests/engine/test_soak.py -m gpu -p no:cacheprovider \
    2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
common="--load-format dummy --num-prompts 256 --input-len-range 100 1024 --output-len-range 100 1024 --max-model-len 4096"
met bench throughput --model Qwen3-0.6B $common --max-num-seqs 256 --output-json "$OUT/thr_bf16.json" 2>&1 | grep -v Generating | tail -5
met bench throughput --model Qwen3-0.6B $common --max-num-seqs 256 --kv-cache-dtype fp8 \
    --fp8-kv-calibration-tokens 4096 --output-json "$OUT/thr_fp8.json" 2>&1 | grep -v Generating | tail -5
met bench latency --model Qwen3-30B-A3B --load-format dummy --batch-size 1 --input-len 512 --output-len 128 \
    --max-model-len 4096 --max-num-seqs 8 --output-json "$OUT/lat_moe.json" 2>&1 | tail -4
met bench throughput --model Qwen3-30B-A3B $common --max-num-seqs 256 --output-json "$OUT/thr_moe.json" 2>&1 \
    | grep -v Generating | tail -5
