#!/usr/bin/env bash
# GPU checks of the startup, diagnostics and hardening work (issues 20, 22), in one device call:
#   OUT=/tmp/out bash benchmarks/run_session_checks.sh
# 1. the GPU generation tests of the dense families (graphs, eager, torch backend, --forward
#    reference, chunked: all equal to transformers; $TEST_FILTER narrows them);
# 2. met serve --check-kernels for the demo model and for Qwen3-8B's shipped config (dummy
#    weights): every kernel variant of the audit, exit status = unresolved count;
# 3. the abort-latency probe on the GPU (scripts/measure_abort_latency.py), with ABORT_PROBE=1.
set -uo pipefail
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/met-session-checks}"
mkdir -p "$OUT"
met() { python3 -m metrale.entrypoints.cli "$@"; }
python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))' | tee "$OUT/device.txt"
echo "${MET_COMMIT:-unknown}" > "$OUT/commit.txt"

TESTS="tests/gpu/test_gpu_generation.py"
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -v -rs -m gpu -p no:cacheprovider $TESTS \
    ${TEST_FILTER:+-k "$TEST_FILTER"} --durations=8 > "$OUT/gpu_tests.log" 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests.log" | tail -20

for model in demo Qwen3-8B; do
  extra=""
  [ "$model" = "Qwen3-8B" ] && extra="--load-format dummy --max-model-len 4096 --max-num-seqs 8"
  timeout 150 python3 -m metrale.entrypoints.cli serve --check-kernels --model "$model" $extra \
      > "$OUT/check_kernels_$model.log" 2>&1
  echo "check-kernels $model: exit $?"
  grep -E "\] (model resolve|backend|topology|weights|kv cache|kernel audit)" "$OUT/check_kernels_$model.log"
  tail -1 "$OUT/check_kernels_$model.log"
done

if [ -n "${ABORT_PROBE:-}" ]; then
  timeout 120 python3 scripts/measure_abort_latency.py --rounds 2 > "$OUT/abort_latency.log" 2>&1
  echo "abort probe: exit $?"; tail -8 "$OUT/abort_latency.log"
fi
