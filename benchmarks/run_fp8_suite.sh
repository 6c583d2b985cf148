#!/usr/bin/env bash
# FP8 weights on one GPU (docs/quantization.md, docs/benchmarks.md), in calls of a few minutes:
#     OUT=/tmp/out bash benchmarks/run_fp8_suite.sh tests   # GPU tests of the FP8 paths, kernel benchmarks
#     OUT=/tmp/out bash benchmarks/run_fp8_suite.sh dense   # Qwen3-8B-FP8 against Qwen3-8B (bf16), batch 1
#                                                         (AB_DIR=<older tree>: its FP8 run too)
#     OUT=/tmp/out bash benchmarks/run_fp8_suite.sh moe     # Qwen3-30B-A3B-FP8 against bf16: batch 1, workload
#                                                         (moe_latency: batch 1 only)
#     OUT=/tmp/out bash benchmarks/run_fp8_suite.sh next    # the full Qwen3-Next-80B-A3B-Instruct-FP8 config
# Modes can be joined with commas ("dense,moe"). Carried beside the tree: .whl/ with a transformers
# that knows Qwen3-Next (dummy weights take the tensor names from transformers' model). Every log
# goes into $OUT/logs/ (pack it after the call, even one cut short: the device tool returns few
# files); pass MET_COMMIT=<hash>.
set -uo pipefail
MODES="${1:-tests}"
OUT="${OUT:-/tmp/met-fp8}"
W="$OUT/logs"
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$W" /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/transformers-*.whl
echo "${MET_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" > "$W/commit.txt"
python3 -c 'import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__, torch.cuda.get_device_name(0))' | tee -a "$W/commit.txt"
BENCH="python3 -m metrale.entrypoints.cli bench"
LAT="--load-format dummy --batch-size 1 --input-len 512 --output-len 128 --max-model-len 4096 --max-num-seqs 8"
THR="--load-format dummy --num-prompts 256 --input-len-range 100 1024 --output-len-range 100 1024 --max-model-len 4096 --max-num-seqs 256"
latency() {  # name model [extra args]
  local name=$1 model=$2; shift 2
  timeout "${LAT_TIMEOUT:-120}" $BENCH latency --model "$model" $LAT "$@" --output-json "$W/latency_$name.json" \
      > "$W/latency_$name.log" 2>&1
  echo "== latency $name"; tail -5 "$W/latency_$name.log"
}
throughput() {
  local name=$1 model=$2; shift 2
  timeout "${THR_TIMEOUT:-200}" $BENCH throughput --model "$model" $THR "$@" --output-json "$W/throughput_$name.json" \
      > "$W/throughput_$name.log" 2>&1
  echo "== throughput $name"; tail -5 "$W/throughput_$name.log"
}
for mode in ${MODES//,/ }; do
  case $mode in
    tests)
      timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -v -rs -m gpu -p no:cacheprovider ${FP8_TESTS:-tests/kernels/test_fp8_linear.py \
          tests/kernels/test_fp8_moe.py tests/gpu/test_gpu_fp8.py} --durations=12 > "$W/gpu_tests.log" 2>&1
      grep -cE " PASSED" "$W/gpu_tests.log"; grep -E "FAILED|ERROR|passed|failed" "$W/gpu_tests.log" | tail -20
      [ -n "${SKIP_KERNEL_BENCH:-}" ] && continue
      timeout "${KBENCH_TIMEOUT:-150}" python3 benchmarks/fp8_gemm_bench.py ${GEMM_BENCH_ARGS:-} > "$W/fp8_gemm_bench.log" 2>&1
      tail -40 "$W/fp8_gemm_bench.log"
      [ -n "${SKIP_MOE_BENCH:-}" ] && continue
      timeout 90 python3 benchmarks/fp8_moe_bench.py > "$W/fp8_moe_bench.log" 2>&1; tail -25 "$W/fp8_moe_bench.log" ;;
    dense)
      latency qwen3_8b_fp8 Qwen3-8B-FP8
      latency qwen3_8b_bf16 Qwen3-8B
      if [ -n "${AB_DIR:-}" ]; then  # the same FP8 run from an older tree (git archive), same machine
        (cd "$AB_DIR" && PYTHONPATH="/tmp/site:$PWD" latency qwen3_8b_fp8_ab Qwen3-8B-FP8)
      fi ;;
    moe_latency)
      latency qwen3_30b_a3b_fp8 Qwen3-30B-A3B-FP8
      latency qwen3_30b_a3b_bf16 Qwen3-30B-A3B ;;
    moe)
      latency qwen3_30b_a3b_fp8 Qwen3-30B-A3B-FP8
      latency qwen3_30b_a3b_bf16 Qwen3-30B-A3B
      throughput qwen3_30b_a3b_fp8 Qwen3-30B-A3B-FP8
      throughput qwen3_30b_a3b_bf16 Qwen3-30B-A3B ;;
    next)
      LAT_TIMEOUT=200 latency qwen3_next_80b_fp8 Qwen3-Next-80B-A3B-Instruct-FP8
      THR_TIMEOUT=260 throughput qwen3_next_80b_fp8 Qwen3-Next-80B-A3B-Instruct-FP8 ;;
  esac
done
