#!/usr/bin/env bash
# Multi-GPU job (issue 7): NCCL correctness tests, then TP/EP scaling benchmarks, on a host with
# 2+ GPUs. Run from the repository root:
#     OUT=/tmp/out bash benchmarks/run_multi_gpu.sh tests|bench
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

if [ "$MODE" = "tests" ]; then
  timeout 560 python3 -m pytest -q -x -rs tests/gpu/test_gpu_parallel.py -p no:cacheprovider --durations=5 2>&1 \
      | tail -30 | tee "$OUT/parallel_tests.log"
  exit 0
fi

sizes() { local n=1; while [ "$n" -le "$GPUS" ]; do echo "$n"; n=$((n * 2)); done; }
for tp in $(sizes); do
  met bench latency --model Qwen3-8B --load-format dummy --tp-size "$tp" --batch-size 1 --input-len 512 \
      --output-len 128 --max-model-len 4096 --max-num-seqs 8 --num-iters 2 \
      --output-json "$OUT/latency_qwen3_8b_tp$tp.json" 2>&1 | tail -4
done
for tp in $(sizes); do
  met bench throughput --model Qwen3-8B --load-format dummy --tp-size "$tp" --num-prompts 256 \
      --input-len-range 100 1024 --output-len-range 100 1024 --max-model-len 4096 --max-num-seqs 256 \
      --output-json "$OUT/throughput_qwen3_8b_tp$tp.json" 2>&1 | tail -4
done
for ep in $(sizes); do
  met bench throughput --model Qwen3-30B-A3B --load-format dummy --ep-size "$ep" --num-prompts 256 \
      --input-len-range 100 1024 --output-len-range 100 1024 --max-model-len 4096 --max-num-seqs 256 \
      --output-json "$OUT/throughput_qwen3_30b_a3b_ep$ep.json" 2>&1 | tail -4
done
python3 benchmarks/summarize_parallel.py "$OUT" | tee "$OUT/scaling.md"
