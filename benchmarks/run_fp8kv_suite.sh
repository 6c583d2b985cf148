#!/usr/bin/env bash
# OUT=/tmp/out bash benchmarks/run_fp8kv_suite.sh -- FP8 KV against bf16 KV: the decode kernel's sweep, the nano-vllm workload, and per-kernel profiles.
set -uo pipefail
OUT="${OUT:-/tmp/met-fp8kv}"; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
met() { python3 -m metrale.entrypoints.cli "$@"; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
t0=$(date +%s)
python3 benchmarks/attention_bench.py --cases thr256,thr128,thr32 --default-only > $OUT/attn_bf16.md 2>$OUT/attn_bf16.log
python3 benchmarks/attention_bench.py --cases thr256,thr128,thr32 --kv-dtype fp8 > $OUT/attn_fp8.md 2>$OUT/attn_fp8.log
cat $OUT/attn_bf16.md $OUT/attn_fp8.md; echo "attn done $(( $(date +%s) - t0 )) s"
common="--load-format dummy --num-prompts 256 --input-len-range 100 1024 --output-len-range 100 1024 --max-model-len 4096 --max-num-seqs 256"
met bench throughput --model Qwen3-0.6B $common --output-json $OUT/thr_bf16.json > $OUT/thr_bf16.log 2>&1; tail -4 $OUT/thr_bf16.log
met bench throughput --model Qwen3-0.6B $common --kv-cache-dtype fp8 --output-json $OUT/thr_fp8.json > $OUT/thr_fp8.log 2>&1; tail -4 $OUT/thr_fp8.log
echo "thr done $(( $(date +%s) - t0 )) s"
python3 benchmarks/profile_step.py --model Qwen3-0.6B --kv-cache-dtype fp8 --no-programmatic-launch > $OUT/prof_fp8.txt 2>&1
python3 benchmarks/profile_step.py --model Qwen3-0.6B --no-programmatic-launch > $OUT/prof_bf16.txt 2>&1
grep -A30 "steady state" $OUT/prof_fp8.txt | head -60; grep -A30 "steady state" $OUT/prof_bf16.txt | head -60
echo "all done $(( $(date +%s) - t0 )) s"
