#!/usr/bin/env bash
# Qwen2.5-VL with images on the GPU (issue 19's GPU figure), in one device call:
#     OUT=/tmp/out bash benchmarks/run_vl_suite.sh            # smoke, then bench
#     OUT=/tmp/out bash benchmarks/run_vl_suite.sh bench      # the benchmark alone
# smoke: benchmarks/vl_bench.py --tiny (a tiny checkpoint written by this box's transformers, met
#        and transformers on the CPU, greedy tokens compared): checks the box's transformers
#        before the long run;
# bench: benchmarks/vl_bench.py on metrale/model_configs/Qwen2.5-VL-7B-Instruct (random bf16
#        weights): TTFT (median, p99 of 10) and a batch of 16 x 128 tokens with 1 and 4 images of
#        1024x1024 per request, met and transformers against the floor; < 300 s.
# Everything lands in a temporary folder packed into $OUT/results.tgz (logs and JSON); the
# benchmark's JSON is copied to $OUT/vl_bench.json as well.
set -uo pipefail
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/met-vl}"
mkdir -p "$OUT"
W=$(mktemp -d)
export MET_COMMIT="${MET_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
echo "$MET_COMMIT" > "$W/commit.txt"
python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name(0))' \
  | tee "$W/device.txt"
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(smoke bench)
for part in "${PARTS[@]}"; do
  case $part in
    smoke)
      timeout 120 python3 benchmarks/vl_bench.py --tiny --output-json "$W/vl_tiny.json" > "$W/vl_tiny.log" 2>&1
      echo "smoke: exit $?"; tail -8 "$W/vl_tiny.log" ;;
    bench)
      timeout "${BENCH_TIMEOUT:-330}" python3 benchmarks/vl_bench.py ${VL_ARGS:-} --output-json "$W/vl_bench.json" \
        > "$W/vl_bench.log" 2>&1
      echo "bench: exit $?"; tail -12 "$W/vl_bench.log"
      [ -f "$W/vl_bench.json" ] && cp "$W/vl_bench.json" "$OUT/" ;;
    *) echo "unknown part $part (smoke, bench)" ;;
  esac
done
tar -czf "$OUT/results.tgz" -C "$W" .
