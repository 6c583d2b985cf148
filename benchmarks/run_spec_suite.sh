#!/usr/bin/env bash
# Speculative decoding on the GPU (issue 17), in one or two device calls:
#     OUT=/tmp/out bash benchmarks/run_spec_suite.sh tests|bench|latency
# tests:   the speculative GPU tests (verify graphs, rejection kernel, multi-query decode, hybrid
#          rollback, DFlash, cost table) with the decode path's tests beside them;
# verify:  benchmarks/spec_verify_bench.py alone (VERIFY_BATCHES, VERIFY_KS);
# bench:   benchmarks/spec_verify_bench.py (a verify step against a plain one) and
#          `met benchmark spec-cost-table` on the Qwen3-8B config;
# latency: batch-1 `met bench latency` plain, with n-gram drafts and with MTP drafts (asynchronous
#          scheduling, then synchronous; the demo's
#          trained mtp.safetensors; the Qwen3-8B config's dummy MTP layer, declared by
#          --hf-overrides num_nextn_predict_layers 1), demo model and Qwen3-8B config
#          (after `bench`, also with --spec-cost-model measured over the table it wrote; SPEC_TABLE
#          names another, TABLE_SPEC the --speculative-config it was measured with).
# Install the carried wheels without fla-core: transformers' CPU references call fla's GPU kernels
# whenever it is importable (tests/checkpoints.py refuses to run them so).
# Everything lands in a temporary folder packed into $OUT/results.tgz (logs and JSON).
set -uo pipefail
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/met-spec}"
mkdir -p "$OUT"
W=$(mktemp -d)
export MET_COMMIT="${MET_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
echo "$MET_COMMIT" > "$W/commit.txt"
python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))' | tee "$W/device.txt"
MET="python3 -m metrale.entrypoints.cli"  # a variable, not a function: `timeout` runs it
Q8=metrale/model_configs/Qwen3-8B
for part in "$@"; do
  case $part in
    tests)
      TESTS=${SPEC_TESTS:-"tests/gpu/test_gpu_speculative.py tests/kernels/test_multi_query_decode.py
        tests/kernels/test_rejection_kernel.py tests/kernels/test_skinny_gemm.py tests/gpu/test_gpu_spec_hybrid.py
        tests/gpu/test_gpu_mtp.py tests/gpu/test_gpu_dflash.py tests/gpu/test_gpu_spec_cost_table.py
        tests/gpu/test_gpu_generation.py tests/gpu/test_gpu_mla_backend.py tests/gpu/test_gpu_glm5_next.py"}
      timeout "${TEST_TIMEOUT:-330}" python3 -m pytest -v -rs -p no:cacheprovider --durations=15 $TESTS \
        > "$W/gpu_tests.log" 2>&1
      grep -E "FAILED|ERROR|passed|failed" "$W/gpu_tests.log" | tail -25 ;;
    bench|verify)
      timeout 150 python3 benchmarks/spec_verify_bench.py --model $Q8 --batch-sizes ${VERIFY_BATCHES:-1,4,16} \
        --ks ${VERIFY_KS:-1,2,3,4,5,6,7,8} --context-len 1024 --output "$W/spec_verify_qwen3_8b.json" \
        > "$W/spec_verify.log" 2>&1
      tail -30 "$W/spec_verify.log"
      [ $part = verify ] && continue
      timeout 240 $MET benchmark spec-cost-table --model $Q8 --load-format dummy \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 8}' \
        --batch-sizes 1,2,4,8,16,32,64,128,256 --draft-counts 0,1,2,3,4,5,6,7,8 --context-len 512 \
        --warmup 3 --repetitions 7 -o "$W/spec_cost_qwen3_8b_h200.json" > "$W/spec_cost.log" 2>&1
      tail -15 "$W/spec_cost.log" ;;
    latency)
      NG='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
      for model in ${LATENCY_MODELS:-demo Qwen3-8B}; do
        extra=""; [ $model = Qwen3-8B ] && extra="--load-format dummy"
        common="--model $model $extra --batch-size 1 --input-len 512 --output-len 128 --max-model-len 2048 --max-num-seqs 8"
        timeout 100 $MET bench latency $common --output-json "$W/latency_${model}_plain.json" > "$W/latency_${model}_plain.log" 2>&1
        tail -4 "$W/latency_${model}_plain.log"
        timeout 100 $MET bench latency $common --speculative-config "$NG" \
          --output-json "$W/latency_${model}_ngram.json" > "$W/latency_${model}_ngram.log" 2>&1
        tail -5 "$W/latency_${model}_ngram.log"
        mtp_overrides=(); [ $model = Qwen3-8B ] && mtp_overrides=(--hf-overrides '{"num_nextn_predict_layers": 1}')
        timeout 100 $MET bench latency $common "${mtp_overrides[@]}" --speculative-config '{"method": "mtp"}' \
          --output-json "$W/latency_${model}_mtp.json" > "$W/latency_${model}_mtp.log" 2>&1
        tail -5 "$W/latency_${model}_mtp.log"
        # the same, its verify steps read one by one (planned after the step before is read)
        timeout 100 $MET bench latency $common "${mtp_overrides[@]}" --speculative-config '{"method": "mtp"}' \
          --no-async-scheduling --output-json "$W/latency_${model}_mtp_sync.json" > "$W/latency_${model}_mtp_sync.log" 2>&1
        tail -5 "$W/latency_${model}_mtp_sync.log"
      done
      TABLE=${SPEC_TABLE:-$W/spec_cost_qwen3_8b_h200.json}
      if [ -f "$TABLE" ]; then  # after `bench` (or SPEC_TABLE): k chosen per step from the table
        # the drafter settings the table was measured with: its key covers them
        timeout 100 $MET bench latency $common --speculative-config "${TABLE_SPEC:-$NG}" --spec-cost-model measured \
          --spec-cost-calibration "$TABLE" \
          --output-json "$W/latency_Qwen3-8B_ngram_measured.json" > "$W/latency_Qwen3-8B_ngram_measured.log" 2>&1
        tail -5 "$W/latency_Qwen3-8B_ngram_measured.log"
      fi ;;
  esac
done
tar -czf "$OUT/results.tgz" -C "$W" .
