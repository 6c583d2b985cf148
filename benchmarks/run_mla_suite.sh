#!/usr/bin/env bash
# MLA, DSA and the DeepSeek / GLM families on one GPU (docs/mla.md, docs/benchmarks.md), in calls
# of a few minutes:
#     OUT=/tmp/out bash benchmarks/run_mla_suite.sh tests      # GPU tests of the MLA / DSA paths
#     OUT=/tmp/out bash benchmarks/run_mla_suite.sh kernels    # MLA decode and DSA indexer benchmarks,
#                                                             # the fp8 indexer's top-k agreement
#     OUT=/tmp/out bash benchmarks/run_mla_suite.sh glm        # GLM-4.5-Air, 16 of 46 layers: batch 1, workload
#     OUT=/tmp/out bash benchmarks/run_mla_suite.sh deepseek   # DeepSeek-V3, 5 of 61 layers (3 dense, 2 MoE):
#                                                             # bf16 and block-FP8, batch 1, workload
#     OUT=/tmp/out bash benchmarks/run_mla_suite.sh hf         # transformers, the same batch-1 runs (bf16)
# Modes can be joined with commas. Carried beside the tree: .whl/ with transformers 5.24 (the
# device's 5.17 predates the DSA families). Every log goes into $OUT/logs/ (pack it after the
# call: the device tool returns few files); pass MET_COMMIT=<hash>.
set -uo pipefail
MODES="${1:-tests}"
OUT="${OUT:-/tmp/met-mla}"
W="$OUT/logs"
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$W" /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/transformers-*.whl
echo "${MET_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" > "$W/commit.txt"
python3 -c 'import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__, torch.cuda.get_device_name(0))' | tee -a "$W/commit.txt"
BENCH="python3 -m metrale.entrypoints.cli bench"
GLM_CUT='{"num_hidden_layers": 16}'
DSV3_CUT='{"num_hidden_layers": 5}'
LAT="--load-format dummy --batch-size 1 --input-len 512 --output-len 128 --max-model-len 4096 --max-num-seqs 8"
THR="--load-format dummy --num-prompts ${NUM_PROMPTS:-256} --input-len-range 100 1024 --output-len-range 100 1024 --max-model-len 4096 --max-num-seqs 256"
latency() {  # name model overrides [extra args]
  local name=$1 model=$2 cut=$3; shift 3
  timeout "${LAT_TIMEOUT:-150}" $BENCH latency --model "$model" --hf-overrides "$cut" $LAT "$@" \
      --output-json "$W/latency_$name.json" > "$W/latency_$name.log" 2>&1
  echo "== latency $name (rc $?)"; tail -6 "$W/latency_$name.log"
}
throughput() {
  local name=$1 model=$2 cut=$3; shift 3
  timeout "${THR_TIMEOUT:-200}" $BENCH throughput --model "$model" --hf-overrides "$cut" $THR "$@" \
      --output-json "$W/throughput_$name.json" > "$W/throughput_$name.log" 2>&1
  echo "== throughput $name (rc $?)"; tail -6 "$W/throughput_$name.log"
}
hf_latency() {
  local name=$1 model=$2 cut=$3
  timeout "${HF_TIMEOUT:-200}" python3 benchmarks/hf_baseline.py latency --model "$model" --hf-overrides "$cut" \
      --input-len 512 --output-len 128 --output-json "$W/hf_latency_$name.json" > "$W/hf_latency_$name.log" 2>&1
  echo "== transformers latency $name (rc $?)"; tail -4 "$W/hf_latency_$name.log"
}
run_if() {  # script [args]: run a benchmark script if it exists yet
  local script=$1; shift
  if [ -f "$script" ]; then
    local log="$W/$(basename "$script" .py).log"
    timeout "${KBENCH_TIMEOUT:-150}" python3 "$script" "$@" > "$log" 2>&1
    echo "== $script (rc $?)"; tail -40 "$log"
  else
    echo "== $script: not in this tree"
  fi
}
for mode in ${MODES//,/ }; do
  case $mode in
    tests)
      TESTS=$(ls tests/gpu/test_gpu_mla*.py tests/gpu/test_gpu_dsa*.py tests/gpu/test_gpu_indexer*.py 2>/dev/null)
      timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -v -rs -m gpu -p no:cacheprovider ${MLA_TESTS:-$TESTS} \
          --durations=12 > "$W/gpu_tests.log" 2>&1
      grep -cE " PASSED" "$W/gpu_tests.log"; grep -E "FAILED|ERROR|passed|failed" "$W/gpu_tests.log" | tail -20 ;;
    kernels)
      run_if benchmarks/mla_decode_bench.py ${MLA_BENCH_ARGS:-}
      run_if benchmarks/indexer_bench.py ${INDEXER_BENCH_ARGS:-}
      run_if benchmarks/indexer_fp8_agreement.py ;;
    glm)
      latency glm45_air GLM-4.5-Air "$GLM_CUT"
      throughput glm45_air GLM-4.5-Air "$GLM_CUT" ;;
    glm_latency)
      latency glm45_air GLM-4.5-Air "$GLM_CUT" ;;
    deepseek)
      latency dsv3_bf16 DeepSeek-V3-BF16 "$DSV3_CUT"
      latency dsv3_fp8 DeepSeek-V3 "$DSV3_CUT"
      throughput dsv3_bf16 DeepSeek-V3-BF16 "$DSV3_CUT" ;;
    deepseek_latency)
      latency dsv3_bf16 DeepSeek-V3-BF16 "$DSV3_CUT" ;;
    hf)
      hf_latency glm45_air GLM-4.5-Air "$GLM_CUT"
      hf_latency dsv3_bf16 DeepSeek-V3-BF16 "$DSV3_CUT" ;;
  esac
done
