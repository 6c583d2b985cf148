#!/usr/bin/env bash
# Everything docs/benchmarks.md reports, in one call on a host with 2 GPUs (under 9 minutes):
#   1. side by side: GPU tests on GPU 0 (then the GEMV microbenchmark); on GPU 1 the one-GPU
#      benchmarks (Qwen3-8B batch-1 latency, Qwen3-0.6B and Qwen3-30B-A3B throughput) and the
#      transformers baselines;
#   2. on both GPUs: tiny-checkpoint token checks over NCCL, Qwen3-8B latency at tp=2
#      (asynchronous and synchronous scheduling), Qwen3-30B-A3B throughput at ep=2.
# Results are packed into $OUT/results.tgz (the device tool returns at most 8 files):
#     OUT=/tmp/out MET_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/run_two_gpu_suite.sh
set -uo pipefail
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-/tmp/met-two-gpu}"; mkdir -p "$OUT"
if [ -z "${SUITE_DIR:-}" ]; then  # the outer call: run the suite under a deadline, then always pack
  export SUITE_DIR=$(mktemp -d)
  timeout "${SUITE_DEADLINE:-510}" bash "$0"
  tail -3 "$SUITE_DIR/gpu_tests.log" "$SUITE_DIR/parallel_tests.log"
  grep -E "achieved|output tok|time to first" "$SUITE_DIR"/*.log | sed "s|$SUITE_DIR/||" | head -30
  tail -25 "$SUITE_DIR/gemv_bench.log"
  tar -czf "$OUT/results.tgz" -C "$SUITE_DIR" .
  exit 0
fi
W="$SUITE_DIR"
echo "${MET_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" > "$W/commit.txt"
MET="python3 -m metrale.entrypoints.cli"
THR="--load-format dummy --num-prompts 256 --input-len-range 100 1024 --output-len-range 100 1024 --max-model-len 4096 --max-num-seqs 256"
LAT="--model Qwen3-8B --load-format dummy --batch-size 1 --input-len 512 --output-len 128 --max-model-len 4096 --max-num-seqs 8"
PYTEST="python3 -m pytest -q -rs -m gpu -p no:cacheprovider"

(CUDA_VISIBLE_DEVICES=0 timeout 170 $PYTEST tests/gpu/test_gpu_generation.py tests/kernels/test_gemv.py \
     tests/kernels/test_sampling.py > "$W/gpu_tests.log" 2>&1
 CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/gemv_bench.py > "$W/gemv_bench.log" 2>&1) &
one() { CUDA_VISIBLE_DEVICES=1 timeout "$1" "${@:2}"; }
one 60 $MET bench latency $LAT --output-json "$W/latency_qwen3_8b_tp1.json" > "$W/latency_qwen3_8b_tp1.log" 2>&1
one 60 $MET bench throughput --model Qwen3-0.6B $THR --output-json "$W/throughput_qwen3_0_6b.json" \
    > "$W/throughput_qwen3_0_6b.log" 2>&1
one 100 $MET bench throughput --model Qwen3-30B-A3B $THR --output-json "$W/throughput_qwen3_30b_a3b_ep1.json" \
    > "$W/throughput_qwen3_30b_a3b_ep1.log" 2>&1
one 60 python3 benchmarks/hf_baseline.py latency --model Qwen3-8B --input-len 512 --output-len 128 \
    --output-json "$W/hf_latency_qwen3_8b.json" > "$W/hf_latency.log" 2>&1
one 70 python3 benchmarks/hf_baseline.py throughput --model Qwen3-0.6B --num-prompts 64 --max-new-tokens 256 \
    --output-json "$W/hf_throughput_qwen3_0_6b.json" > "$W/hf_throughput.log" 2>&1
wait

timeout 90 $PYTEST tests/gpu/test_gpu_parallel.py -k "tiny and qwen3" > "$W/parallel_tests.log" 2>&1
for mode in async no-async; do
  timeout 60 $MET bench latency $LAT --tp-size 2 --num-iters 2 --$mode-scheduling \
      --output-json "$W/latency_qwen3_8b_tp2_$mode.json" > "$W/latency_qwen3_8b_tp2_$mode.log" 2>&1
done
timeout 100 $MET bench throughput --model Qwen3-30B-A3B --ep-size 2 $THR \
    --output-json "$W/throughput_qwen3_30b_a3b_ep2.json" > "$W/throughput_qwen3_30b_a3b_ep2.log" 2>&1

