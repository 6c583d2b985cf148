#!/usr/bin/env bash
# The whole GPU suite in one job: GPU tests, then the benchmarks of docs/benchmarks.md with their
# transformers comparisons, then a markdown table. Run from the repository root on a CUDA machine:
#     OUT=/tmp/out bash benchmarks/run_gpu_suite.sh [quick|bench-only|tests-only|profile|focused]
# profile: no tests; where the time goes (kernel profiles at batch 1 and 256, the throughput
# workload step by step against each step's floor, the sampler, the launch-gap probe) and the
# batch-1 latency benchmark.
# focused: the decode path's GPU tests, the headline benchmarks (batch 1 also without programmatic
# dependent launch) and transformers in one call of a few minutes (see below).
# Writes $OUT/gpu_tests.log, $OUT/*.json, $OUT/summary.md.
set -uo pipefail
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/met-gpu-suite}"
mkdir -p "$OUT"
QUICK="${1:-}"
met() { python3 -m metrale.entrypoints.cli "$@"; }
# The two headline workloads of docs/benchmarks.md, for every mode below.
LAT="--model Qwen3-8B --load-format dummy --batch-size 1 --input-len 512 --output-len 128 --max-model-len 4096 --max-num-seqs 8"
THR="--model Qwen3-0.6B --load-format dummy --num-prompts 256 --input-len-range 100 1024 --output-len-range 100 1024 --max-model-len 4096 --max-num-seqs 256"

python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))'
echo "${MET_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" > "$OUT/commit.txt"

if [ "$QUICK" = "focused" ]; then
  # The GPU tests of the decode path (or $FOCUSED_TESTS), then the headline benchmarks (batch-1
  # latency with and without programmatic dependent launch), transformers, summary.md (or the
  # steps in $FOCUSED_STEPS, among those below); all logs packed into $OUT/results.tgz (the
  # device tool returns at most 8 files).
  if [ -z "${FOCUSED_DIR:-}" ]; then  # the outer call: the steps under a deadline, then the pack
    export FOCUSED_DIR=$(mktemp -d)
    cp "$OUT/commit.txt" "$FOCUSED_DIR/"
    timeout "${SUITE_DEADLINE:-560}" bash "$0" focused
    tar -czf "$OUT/results.tgz" -C "$FOCUSED_DIR" .
    exit 0
  fi
  W=$FOCUSED_DIR
  TESTS=${FOCUSED_TESTS:-"tests/gpu/test_gpu_generation.py tests/gpu/test_gpu_moe.py tests/gpu/test_gpu_compiles.py
    tests/kernels/test_qk_norm_rope.py tests/kernels/test_sampling.py tests/kernels/test_fp8_kv.py
    tests/kernels/test_paged_attention.py::test_decode_gpu"}
  # -v: each test's outcome is in the log as it ends, even if the deadline cuts the run short
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -v -rs -m gpu -p no:cacheprovider $TESTS --durations=15 \
      > "$W/gpu_tests.log" 2>&1
  grep -cE " PASSED" "$W/gpu_tests.log"; grep -E "FAILED|ERROR|passed|failed" "$W/gpu_tests.log" | tail -15
  BENCH="python3 -m metrale.entrypoints.cli bench"
  for step in ${FOCUSED_STEPS:-latency latency_no_pdl throughput hf}; do
    case $step in
      latency) timeout 100 $BENCH latency $LAT --output-json "$W/latency_qwen3_8b_async.json" > "$W/latency.log" 2>&1
               tail -3 "$W/latency.log" ;;
      latency_no_pdl) timeout 100 $BENCH latency $LAT --no-programmatic-launch \
               --output-json "$W/latency_qwen3_8b_no_pdl.json" > "$W/latency_no_pdl.log" 2>&1
               tail -3 "$W/latency_no_pdl.log" ;;
      throughput) timeout 100 $BENCH throughput $THR --output-json "$W/throughput_qwen3_0_6b_async.json" \
               > "$W/throughput.log" 2>&1; tail -4 "$W/throughput.log" ;;
      timeline) timeout 100 python3 benchmarks/step_timeline.py --model Qwen3-0.6B --output-json "$W/timeline.json" \
               > "$W/timeline.log" 2>&1; tail -9 "$W/timeline.log" ;;
      profile256) timeout 100 python3 benchmarks/profile_step.py --model Qwen3-0.6B --table-rows 25 \
               > "$W/profile_0_6b_256.log" 2>&1; grep -E "steady|GPU busy" "$W/profile_0_6b_256.log" ;;
      hf) timeout 90 python3 benchmarks/hf_baseline.py latency --model Qwen3-8B --input-len 512 --output-len 128 \
               --output-json "$W/hf_latency_qwen3_8b.json" > "$W/hf_latency.log" 2>&1; tail -3 "$W/hf_latency.log"
          timeout 100 python3 benchmarks/hf_baseline.py throughput --model Qwen3-0.6B --num-prompts 64 \
               --max-new-tokens 256 --output-json "$W/hf_throughput_qwen3_0_6b.json" > "$W/hf_throughput.log" 2>&1
          tail -3 "$W/hf_throughput.log" ;;
    esac
  done
  python3 benchmarks/summarize.py "$W" | tee "$W/summary.md"
  exit 0
fi

if [ "$QUICK" = "profile" ]; then
  python3 benchmarks/pdl_probe.py > "$OUT/pdl_probe.log" 2>&1; tail -8 "$OUT/pdl_probe.log"
  python3 benchmarks/step_timeline.py --model Qwen3-0.6B --output-json "$OUT/timeline_0_6b.json" \
      > "$OUT/timeline_0_6b.log" 2>&1; tail -10 "$OUT/timeline_0_6b.log"
  met bench latency $LAT --output-json "$OUT/latency_qwen3_8b_async.json" > "$OUT/latency_qwen3_8b_async.log" 2>&1
  tail -4 "$OUT/latency_qwen3_8b_async.log"
  python3 benchmarks/profile_step.py --model Qwen3-8B --num-prompts 1 --max-num-seqs 1 --table-rows 45 \
      > "$OUT/profile_8b_bs1.log" 2>&1; grep -E "steady|GPU busy" "$OUT/profile_8b_bs1.log"
  python3 benchmarks/profile_step.py --model Qwen3-0.6B --table-rows 45 > "$OUT/profile_0_6b_256.log" 2>&1
  grep -E "steady|GPU busy" "$OUT/profile_0_6b_256.log"
  python3 benchmarks/sampler_bench.py > "$OUT/sampler_bench.log" 2>&1; tail -8 "$OUT/sampler_bench.log"
  exit 0
fi

if [ "$QUICK" != "bench-only" ]; then
  # Straight to a file (a pipe would be held open by any process a test leaves behind).
  timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -x -rs tests/gpu tests/kernels -m gpu -p no:cacheprovider \
      --deselect tests/gpu/test_gpu_parallel.py --durations=10 > "$OUT/gpu_tests.log" 2>&1
  tail -25 "$OUT/gpu_tests.log"
  [ "$QUICK" = "tests-only" ] && exit 0
fi

# Asynchronous scheduling (the default on CUDA) and synchronous, back to back on the same GPU.
for mode in async sync; do
  flag="--async-scheduling"; [ "$mode" = sync ] && flag="--no-async-scheduling"
  met bench latency $LAT $flag --output-json "$OUT/latency_qwen3_8b_$mode.json" > "$OUT/latency_qwen3_8b_$mode.log" 2>&1
  tail -4 "$OUT/latency_qwen3_8b_$mode.log"
  met bench throughput $THR $flag --output-json "$OUT/throughput_qwen3_0_6b_$mode.json" \
      > "$OUT/throughput_qwen3_0_6b_$mode.log" 2>&1
  tail -4 "$OUT/throughput_qwen3_0_6b_$mode.log"
done
if [ "$QUICK" != "quick" ]; then
  python3 benchmarks/hf_baseline.py latency --model Qwen3-8B --input-len 512 --output-len 128 \
      --output-json "$OUT/hf_latency_qwen3_8b.json" 2>&1 | tail -8
  python3 benchmarks/hf_baseline.py throughput --model Qwen3-0.6B --num-prompts 64 --max-new-tokens 256 \
      --output-json "$OUT/hf_throughput_qwen3_0_6b.json" 2>&1 | tail -8
fi
python3 benchmarks/summarize.py "$OUT" | tee "$OUT/summary.md"
