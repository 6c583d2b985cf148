#!/usr/bin/env bash
# The hybrid (linear-attention) families on one GPU, in two calls of a few minutes each:
#     OUT=/tmp/out bash benchmarks/run_hybrid_suite.sh tests    # GPU tests, kernel benchmarks, a profile
#     OUT=/tmp/out bash benchmarks/run_hybrid_suite.sh bench    # met and transformers on Qwen3-Next-80B-A3B
#     OUT=/tmp/out bash benchmarks/run_hybrid_suite.sh final    # $FINAL_TESTS, then met's batch-1 latency again
# Carried beside the tree (see docs/benchmarks.md): .whl/ with transformers (a release that knows
# Qwen3.5), fla-core and einops; .ckpt/hybrid/ from `python tests/hybrid_checkpoints.py .ckpt/hybrid`
# (tiny checkpoints and transformers' tokens for them, made where transformers knows every family).
# fla is importable only in the steps that compare with it: transformers' reference takes its
# kernels when it imports. Every log goes into $OUT/results.tgz.
set -uo pipefail
MODE="${1:-tests}"
OUT="${OUT:-/tmp/met-hybrid}"
W=$(mktemp -d)
[ "$MODE" != tests ] && W="$OUT"  # at most 8 files, each back even if the call is cut short
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MET_HYBRID_CHECKPOINTS="$PWD/.ckpt/hybrid"
mkdir -p "$OUT" /tmp/site /tmp/site_fla
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/transformers-*.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_fla .whl/fla_core-*.whl \
    .whl/einops-*.whl
BASE="/tmp/site:$PYTHONPATH"
WITH_FLA="/tmp/site:/tmp/site_fla:$PYTHONPATH"
echo "${MET_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" > "$W/commit.txt"
PYTHONPATH=$BASE python3 -c 'import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__, torch.cuda.get_device_name(0))' | tee -a "$W/commit.txt"
NEXT="--model Qwen3-Next-80B-A3B-Instruct --load-format dummy --hf-overrides {\"num_hidden_layers\":24}"

if [ "$MODE" = tests ]; then
  PYTHONPATH=$BASE timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -v -rs -p no:cacheprovider \
      tests/kernels/test_gated_delta_rule.py tests/kernels/test_causal_conv1d.py tests/kernels/test_moe_routing.py \
      tests/gpu/test_gpu_hybrid.py tests/gpu/test_gpu_compiles.py \
      ${EXTRA_TESTS:-} --durations=12 > "$W/gpu_tests.log" 2>&1
  grep -cE " PASSED" "$W/gpu_tests.log"; grep -E "FAILED|ERROR|passed|failed" "$W/gpu_tests.log" | tail -20
  PYTHONPATH=$WITH_FLA timeout 90 python3 benchmarks/gdn_bench.py > "$W/gdn_bench.log" 2>&1; tail -25 "$W/gdn_bench.log"
  [ -f benchmarks/moe_decode_bench.py ] && { PYTHONPATH=$BASE timeout 60 python3 benchmarks/moe_decode_bench.py \
      > "$W/moe_decode_bench.log" 2>&1; tail -14 "$W/moe_decode_bench.log"; }
fi

if [ "$MODE" = final ]; then
  PYTHONPATH=$BASE timeout "${TEST_TIMEOUT:-330}" python3 -m pytest -v -rs -p no:cacheprovider $FINAL_TESTS \
      --durations=12 > "$W/gpu_tests.log" 2>&1
  grep -cE " PASSED" "$W/gpu_tests.log"; grep -E "FAILED|ERROR|passed|failed" "$W/gpu_tests.log" | tail -20
  PYTHONPATH=$BASE timeout 150 python3 -m metrale.entrypoints.cli bench latency $NEXT --batch-size 1 --input-len 512 \
      --output-len 128 --max-model-len 4096 --max-num-seqs 8 --output-json "$W/latency_qwen3_next_final.json" \
      > "$W/latency_final.log" 2>&1
  tail -4 "$W/latency_final.log"
fi

if [ "$MODE" = bench ]; then
  BENCH="python3 -m metrale.entrypoints.cli bench"
  PYTHONPATH=$BASE timeout 150 $BENCH latency $NEXT --batch-size 1 --input-len 512 --output-len 128 \
      --max-model-len 4096 --max-num-seqs 8 --output-json "$W/latency_qwen3_next.json" > "$W/latency.log" 2>&1
  tail -4 "$W/latency.log"
  PYTHONPATH=$BASE timeout 200 $BENCH throughput $NEXT --num-prompts 256 --input-len-range 100 1024 \
      --output-len-range 100 1024 --max-model-len 4096 --max-num-seqs 256 \
      --output-json "$W/throughput_qwen3_next.json" > "$W/throughput.log" 2>&1
  tail -4 "$W/throughput.log"
  PYTHONPATH=$WITH_FLA timeout 110 python3 benchmarks/hf_baseline.py latency --model Qwen3-Next-80B-A3B-Instruct \
      --hf-overrides '{"num_hidden_layers":24}' --input-len 512 --output-len 64 \
      --output-json "$W/hf_latency_qwen3_next.json" > "$W/hf_latency.log" 2>&1; tail -8 "$W/hf_latency.log"
fi
if [ "$MODE" = tests ] || [ "$MODE" = bench ]; then
  PYTHONPATH=$BASE timeout 130 python3 benchmarks/profile_step.py --model Qwen3-Next-80B-A3B-Instruct \
      --hf-overrides '{"num_hidden_layers":24}' --num-prompts 1 --max-num-seqs 1 --table-rows 40 \
      > "$W/profile_next_bs1.log" 2>&1; grep -E "steady|GPU busy" "$W/profile_next_bs1.log"
fi
[ "$W" != "$OUT" ] && tar -czf "$OUT/results.tgz" -C "$W" .
