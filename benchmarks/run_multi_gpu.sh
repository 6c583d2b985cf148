#!/usr/bin/env bash
# Multi-GPU job (issue 7): NCCL correctness tests, then TP/EP scaling benchmarks, on a host with
# 2+ GPUs. Run from the repository root:
#     OUT=/tmp/out bash benchmarks/run_multi_gpu.sh tests|bench|latency|dense|moe
# (bench = latency + dense + moe: Qwen3-8B batch-1 latency and throughput at tp = 1, 2, 4.. up
# to the GPUs present, Qwen3-30B-A3B throughput at ep = 1, 2, 4..)
# Writes $OUT/*.log, $OUT/*.json and $OUT/scaling.md. NVLink multicast stays off throughout.
set -uo pipefail
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-/tmp/met-multi-gpu}"
mkdir -p "$OUT"
MODE="${1:-bench}"
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())')
met() { python3 -m metrale.entrypoints.cli "$@"; }
echo "${MET_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" > "$OUT/commit.txt"
echo "$GPUS GPUs"; nvidia-smi topo -m 2>&1 | head -12 | tee "$OUT/topology.txt"

# How the GPUs talk: NCCL's transport and all-reduce times by size (a few seconds).
NCCL_DEBUG=INFO timeout 120 torchrun --nproc-per-node "$GPUS" benchmarks/allreduce_probe.py \
    > "$OUT/allreduce_probe.log" 2>&1
grep -oE "via [A-Za-z0-9/_]+" "$OUT/allreduce_probe.log" | sort | uniq -c | head -5
grep -E "^\||symmetric|failed" "$OUT/allreduce_probe.log"

if [ "$MODE" = "tests" ]; then
  # Straight to a file, not through a pipe: worker ranks inherit the output and would hold a pipe open.
  # Past the time limit every rank prints its Python stacks (faulthandler) and stops.
  T="${TEST_TIMEOUT:-400}"
  (sleep "$((T - 3))"; pkill -ABRT -f metrale.distributed.worker) &
  PYTHONFAULTHANDLER=1 timeout -s ABRT "$T" python3 -m pytest -v -rs -o log_cli=true --log-cli-level=INFO \
      tests/gpu/test_gpu_parallel.py -p no:cacheprovider --durations=10 > "$OUT/parallel_tests.log" 2>&1
  tail -25 "$OUT/parallel_tests.log"
  exit 0
fi

sizes() { local n=1; while [ "$n" -le "$GPUS" ]; do echo "$n"; n=$((n * 2)); done; }
want() { [ "$MODE" = bench ] || [ "$MODE" = "$1" ]; }
want latency && for tp in $(sizes); do
  met bench latency --model Qwen3-8B --load-format dummy --tp-size "$tp" --batch-size 1 --input-len 512 \
      --output-len 128 --max-model-len 4096 --max-num-seqs 8 --num-iters 2 \
      --output-json "$OUT/latency_qwen3_8b_tp$tp.json" > "$OUT/latency_qwen3_8b_tp$tp.log" 2>&1
  tail -3 "$OUT/latency_qwen3_8b_tp$tp.log"
done
want dense && for tp in $(sizes); do
  met bench throughput --model Qwen3-8B --load-format dummy --tp-size "$tp" --num-prompts 256 \
      --input-len-range 100 1024 --output-len-range 100 1024 --max-model-len 4096 --max-num-seqs 256 \
      --output-json "$OUT/throughput_qwen3_8b_tp$tp.json" > "$OUT/throughput_qwen3_8b_tp$tp.log" 2>&1
  tail -3 "$OUT/throughput_qwen3_8b_tp$tp.log"
done
want moe && for ep in $(sizes); do
  met bench throughput --model Qwen3-30B-A3B --load-format dummy --ep-size "$ep" --num-prompts 256 \
      --input-len-range 100 1024 --output-len-range 100 1024 --max-model-len 4096 --max-num-seqs 256 \
      --output-json "$OUT/throughput_qwen3_30b_a3b_ep$ep.json" > "$OUT/throughput_qwen3_30b_a3b_ep$ep.log" 2>&1
  tail -3 "$OUT/throughput_qwen3_30b_a3b_ep$ep.log"
done
python3 benchmarks/summarize_parallel.py "$OUT" | tee "$OUT/scaling.md"
