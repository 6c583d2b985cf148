#!/usr/bin/env bash
# OUT=/tmp/out bash benchmarks/run_moe_suite.sh <modes> -- the bf16 grouped MoE GEMMs on one GPU.
#   sweep   benchmarks/moe_gemm_sweep.py writes the tile table ($OUT/tuned_moe_gemm.json, and into
#           metrale/layers/moe/ for the modes after it), then the MoE GPU tests
#   engine  Qwen3-30B-A3B's nano-vllm workload and batch-1 decode from a base tree ($BASE, a
#           directory of `git archive` output) and from this one, in that order; Qwen3-Next's
#           workload (24 of 48 layers) from this one; the no-compile-after-warm-up GPU test
set -uo pipefail
OUT="${OUT:-/tmp/met-moe}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
ROOT=$PWD
SITEP=${SITE:+:$SITE}  # extra site-packages (carried wheels)
met() { python3 -m metrale.entrypoints.cli "$@"; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
t0=$(date +%s)
thr="--load-format dummy --num-prompts 256 --input-len-range 100 1024 --output-len-range 100 1024 --max-model-len 4096 --max-num-seqs 256"
lat="--load-format dummy --batch-size 1 --input-len 512 --output-len 128 --max-model-len 4096 --max-num-seqs 8 --num-iters 5"
for mode in "$@"; do
  case $mode in
    sweep)
      PYTHONPATH=$ROOT$SITEP python3 benchmarks/moe_gemm_sweep.py --precompile 12 --deadline-s "${SWEEP_DEADLINE:-330}" \
        --write-table $OUT/tuned_moe_gemm.json > $OUT/sweep.md 2> $OUT/sweep.log
      cat $OUT/sweep.md; tail -3 $OUT/sweep.log
      [ -s $OUT/tuned_moe_gemm.json ] && cp $OUT/tuned_moe_gemm.json metrale/layers/moe/tuned_moe_gemm.json
      echo "sweep done $(( $(date +%s) - t0 )) s"
      PYTHONPATH=$ROOT$SITEP:$ROOT/tests timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -x tests/layers/test_fused_moe.py \
        tests/gpu/test_gpu_moe.py > $OUT/tests.log 2>&1; tail -3 $OUT/tests.log
      echo "tests done $(( $(date +%s) - t0 )) s" ;;
    engine)
      for tree in "${BASE:-}" "$ROOT"; do
        [ -n "$tree" ] || continue
        tag=$([ "$tree" = "$ROOT" ] && echo head || echo base)
        (cd $tree && PYTHONPATH=$tree$SITEP timeout 240 python3 -m metrale.entrypoints.cli bench throughput --model Qwen3-30B-A3B $thr \
          --output-json $OUT/thr_moe_$tag.json > $OUT/thr_moe_$tag.log 2>&1); tail -3 $OUT/thr_moe_$tag.log
        echo "throughput $tag done $(( $(date +%s) - t0 )) s"
      done
      PYTHONPATH=$ROOT$SITEP timeout 150 python3 -m metrale.entrypoints.cli bench latency --model Qwen3-30B-A3B $lat \
        > $OUT/lat_moe_head.log 2>&1; tail -4 $OUT/lat_moe_head.log
      echo "latency done $(( $(date +%s) - t0 )) s" ;;
    next)
      PYTHONPATH=$ROOT$SITEP timeout 260 python3 -m metrale.entrypoints.cli bench throughput --model Qwen3-Next-80B-A3B-Instruct \
        --hf-overrides '{"num_hidden_layers":24}' $thr --output-json $OUT/thr_next_head.json > $OUT/thr_next_head.log 2>&1
      tail -3 $OUT/thr_next_head.log; echo "next done $(( $(date +%s) - t0 )) s" ;;
    compiles)
      PYTHONPATH=$ROOT$SITEP:$ROOT/tests timeout 200 python3 -m pytest -q -x tests/gpu/test_gpu_compiles.py > $OUT/compiles.log 2>&1
      tail -3 $OUT/compiles.log; echo "compiles done $(( $(date +%s) - t0 )) s" ;;
  esac
done
