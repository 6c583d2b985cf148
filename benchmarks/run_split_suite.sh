#!/usr/bin/env bash
# run_gpu_suite.sh on a host with 2 GPUs, in half the time: the GPU tests on GPU 0 while the
# benchmarks run on GPU 1, then a batch-1 decode profile of Qwen3-8B. Everything is packed into
# $OUT/results.tgz (the device tool returns at most 8 files). Run from the repository root:
#     OUT=/tmp/out bash benchmarks/run_split_suite.sh
set -uo pipefail
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/met-split-suite}"
WORK=$(mktemp -d)
mkdir -p "$WORK/tests" "$WORK/bench" "$OUT"

CUDA_VISIBLE_DEVICES=0 TEST_TIMEOUT="${TEST_TIMEOUT:-480}" OUT="$WORK/tests" \
    bash benchmarks/run_gpu_suite.sh tests-only > "$WORK/tests/run.log" 2>&1 &
tests_pid=$!
# Each part is bounded so that the pack at the end always happens within 10 minutes.
CUDA_VISIBLE_DEVICES=1 OUT="$WORK/bench" timeout "${BENCH_TIMEOUT:-380}" bash benchmarks/run_gpu_suite.sh bench-only > "$WORK/bench/run.log" 2>&1
CUDA_VISIBLE_DEVICES=1 timeout 150 python3 benchmarks/profile_step.py --model Qwen3-8B --num-prompts 1 \
    --max-num-seqs 1 --skip-steps 20 > "$WORK/bench/profile_bs1_qwen3_8b.log" 2>&1
wait "$tests_pid"
cat "$WORK/bench/summary.md" 2>/dev/null
grep -E "steady state|GPU busy" "$WORK/bench/profile_bs1_qwen3_8b.log"
tail -15 "$WORK/tests/gpu_tests.log"
tar -czf "$OUT/results.tgz" -C "$WORK" .
