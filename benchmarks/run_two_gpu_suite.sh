#!/usr/bin/env bash
# docs/benchmarks.md's figures in one call on a host with 2 GPUs:
#   1. side by side: on GPU 0 the GPU tests, then Qwen3-8B batch-1 latency; on GPU 1 Qwen3-0.6B
#      and Qwen3-30B-A3B throughput (full: and the transformers baselines);
#   2. on both GPUs: tiny-checkpoint token checks over NCCL, Qwen3-8B batch-1 latency at tp=2,
#      Qwen3-30B-A3B throughput at ep=2.
#     OUT=/tmp/out MET_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/run_two_gpu_suite.sh [full|short]
# short (about 3 minutes) runs only the GPU tests of the newest kernels and skips transformers and
# the MoE model.
# Everything runs under a deadline (SUITE_DEADLINE seconds), so that the pack at the end always
# happens: results in $OUT/results.tgz (the device tool returns at most 8 files).
set -uo pipefail
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-/tmp/met-two-gpu}"; mkdir -p "$OUT"
MODE="${1:-full}"
if [ -z "${SUITE_DIR:-}" ]; then  # the outer call: run the suite under the deadline, then pack
  export SUITE_DIR=$(mktemp -d)
  timeout "${SUITE_DEADLINE:-540}" bash "$0" "$MODE"
  tail -3 "$SUITE_DIR"/*tests.log
  grep -E "achieved|output tok|time to first|decode per" "$SUITE_DIR"/*.log | sed "s|$SUITE_DIR/||"
  tar -czf "$OUT/results.tgz" -C "$SUITE_DIR" .
  exit 0
fi
W="$SUITE_DIR"
echo "${MET_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" > "$W/commit.txt"
MET="python3 -m metrale.entrypoints.cli"
THR="--load-format dummy --num-prompts 256 --input-len-range 100 1024 --output-len-range 100 1024 --max-model-len 4096 --max-num-seqs 256"
LAT="--model Qwen3-8B --load-format dummy --batch-size 1 --input-len 512 --output-len 128 --max-model-len 4096 --max-num-seqs 8"
PYTEST="python3 -m pytest -q -rs -m gpu -p no:cacheprovider"
on() { local gpu=$1 limit=$2; shift 2; CUDA_VISIBLE_DEVICES=$gpu timeout "$limit" "$@"; }

if [ "$MODE" = short ]; then
  TESTS=(tests/gpu/test_gpu_generation.py::test_batch_of_one_matches_transformers
         "tests/kernels/test_gemv.py::test_gemv_gpu[1-4096-4096]" "tests/kernels/test_gemv.py::test_gemv_gpu[1-4096-12288]"
         "tests/kernels/test_gemv.py::test_gemv_gpu[1-4096-2048]" "tests/kernels/test_gemv.py::test_gemv_gpu[1-4096-6144]"
         tests/kernels/test_sampling.py::test_vocab_parallel_path_gpu)
else
  TESTS=(tests/gpu --deselect tests/gpu/test_gpu_parallel.py tests/kernels)
fi
(on 0 "$([ "$MODE" = short ] && echo 60 || echo 400)" $PYTEST "${TESTS[@]}" > "$W/gpu_tests.log" 2>&1
 on 0 45 $MET bench latency $LAT --output-json "$W/latency_qwen3_8b_tp1.json" > "$W/latency_qwen3_8b_tp1.log" 2>&1) &
on 1 50 $MET bench throughput --model Qwen3-0.6B $THR --output-json "$W/throughput_qwen3_0_6b.json" \
    > "$W/throughput_qwen3_0_6b.log" 2>&1
if [ "$MODE" = full ]; then
  on 1 90 $MET bench throughput --model Qwen3-30B-A3B $THR --output-json "$W/throughput_qwen3_30b_a3b_ep1.json" \
      > "$W/throughput_qwen3_30b_a3b_ep1.log" 2>&1
  on 1 60 python3 benchmarks/hf_baseline.py latency --model Qwen3-8B --input-len 512 --output-len 128 \
      --output-json "$W/hf_latency_qwen3_8b.json" > "$W/hf_latency.log" 2>&1
  on 1 70 python3 benchmarks/hf_baseline.py throughput --model Qwen3-0.6B --num-prompts 64 --max-new-tokens 256 \
      --output-json "$W/hf_throughput_qwen3_0_6b.json" > "$W/hf_throughput.log" 2>&1
fi
wait

K=$([ "$MODE" = short ] && echo "tiny and qwen3-tp" || echo "")
timeout "$([ "$MODE" = short ] && echo 60 || echo 300)" $PYTEST tests/gpu/test_gpu_parallel.py ${K:+-k "$K"} \
    > "$W/parallel_tests.log" 2>&1
timeout 50 $MET bench latency $LAT --tp-size 2 --num-iters 2 --output-json "$W/latency_qwen3_8b_tp2.json" \
    > "$W/latency_qwen3_8b_tp2.log" 2>&1
[ "$MODE" = full ] && timeout 90 $MET bench throughput --model Qwen3-30B-A3B --ep-size 2 $THR \
    --output-json "$W/throughput_qwen3_30b_a3b_ep2.json" > "$W/throughput_qwen3_30b_a3b_ep2.log" 2>&1
