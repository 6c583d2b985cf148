#!/usr/bin/env bash
# Speculative decoding under asynchronous scheduling on the GPU, in one or two device calls:
#     OUT=/tmp/out bash benchmarks/run_async_spec_suite.sh tests,table latency
# hotpath: the GPU tests of the code every asynchronous CUDA step runs (the input fix-up kernel, the
#          skinny GEMM, sm_90 compiles, the dense generation tests, structured outputs with drafts);
# tests:   the GPU tests of the drafts-on-device path (n-gram kernel at a real size, MTP planned over
#          drafts in flight, verify graphs from the device) and the speculative tests beside them;
# table:   `met benchmark spec-cost-table` on the Qwen3-8B config at batch 1, k = 0..4, n-gram drafts,
#          asynchronous (the drafter in the runner, runs of steps) and synchronous (the host's drafter);
#          with AB_DIR set (an older tree, `git archive <commit> metrale benchmarks | tar -x -C DIR`),
#          the same table from that tree follows each mode, on the same machine;
# latency: batch-1 `met bench latency` on the demo model and the Qwen3-8B config: plain, n-gram and
#          MTP drafts (the demo's trained layer; the Qwen3-8B config's dummy one), each asynchronous
#          and synchronous;
# profile: `benchmarks/spec_step_profile.py --forced-ks 1,4 --device-timeline` on the Qwen3-8B config:
#          where a verify step's extra device time goes (busy, idle, kernels by launch site);
# demo_profile: `benchmarks/spec_step_profile.py --model demo`: each engine step of the demo model,
#          plain (synchronous, asynchronous) and with n-gram drafts (asynchronous: the drafter in
#          the runner), with torch.profiler's host and kernel tables: where the asynchronous
#          n-gram run's extra ~0.9 ms a step on a host-bound model goes (docs/speculative.md).
# Carried beside the tree: .whl/ with transformers 5.24 and msgpack (the tests write Qwen3-Next
# checkpoints). Logs and JSON are packed into $OUT/results.tgz (the device tool returns 8 files at most).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/met-async-spec}"
mkdir -p "$OUT"
W=$(mktemp -d)
trap 'tar -czf "$OUT/results.tgz" -C "$W" .' EXIT
echo "${MET_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" > "$W/commit.txt"
python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))' | tee "$W/device.txt"
MET="python3 -m metrale.entrypoints.cli"
Q8=metrale/model_configs/Qwen3-8B
NG='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'
for part in $(echo "$@" | tr ',' ' '); do
  case $part in
    hotpath)
      timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -v -rs -p no:cacheprovider tests/kernels/test_step_inputs.py \
        tests/kernels/test_skinny_gemm.py tests/gpu/test_gpu_compiles.py tests/gpu/test_gpu_structured.py \
        tests/gpu/test_gpu_generation.py > "$W/hotpath_tests.log" 2>&1
      grep -E "FAILED|ERROR|passed|failed" "$W/hotpath_tests.log" | tail -15 ;;
    tests)
      timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -v -rs -p no:cacheprovider tests/kernels/test_ngram_match.py \
        tests/gpu/test_gpu_mtp.py tests/gpu/test_gpu_speculative.py tests/gpu/test_gpu_spec_cost_table.py \
        > "$W/gpu_tests.log" 2>&1
      grep -E "FAILED|ERROR|passed|failed" "$W/gpu_tests.log" | tail -15 ;;
    table)
      for mode in ${TABLE_MODES:-async sync}; do
        flag=--async-scheduling; [ $mode = sync ] && flag=--no-async-scheduling
        timeout 150 $MET benchmark spec-cost-table --model $Q8 --load-format dummy $flag \
          --speculative-config "$NG" --batch-sizes 1 --draft-counts 0,1,2,3,4 --context-len 512 \
          --warmup 3 --repetitions 9 -o "$W/spec_cost_qwen3_8b_$mode.json" > "$W/spec_cost_$mode.log" 2>&1
        echo "== table $mode"; grep -E "batch +1 +k" "$W/spec_cost_$mode.log"
        if [ -n "${AB_DIR:-}" ]; then
          (cd "$AB_DIR" && PYTHONPATH="/tmp/site:$PWD" timeout 150 $MET benchmark spec-cost-table --model $Q8 \
            --load-format dummy $flag --speculative-config "$NG" --batch-sizes 1 --draft-counts 0,1,2,3,4 \
            --context-len 512 --warmup 3 --repetitions 9 -o "$W/spec_cost_qwen3_8b_${mode}_ab.json") \
            > "$W/spec_cost_${mode}_ab.log" 2>&1
          echo "== table $mode, $AB_DIR"; grep -E "batch +1 +k" "$W/spec_cost_${mode}_ab.log"
        fi
      done ;;
    latency)
      for model in ${LATENCY_MODELS:-demo Qwen3-8B}; do
        extra=(); mtp=(); [ $model = Qwen3-8B ] && extra=(--load-format dummy) \
          && mtp=(--hf-overrides '{"num_nextn_predict_layers": 1}')
        common=(--model $model "${extra[@]}" --batch-size 1 --input-len 512 --output-len 128 --max-model-len 2048
                --max-num-seqs 8 --num-iters 5)
        for run in ${LATENCY_RUNS:-plain ngram ngram_sync mtp mtp_sync}; do
          case $run in
            plain) args=() ;;
            ngram) args=(--speculative-config "$NG") ;;
            ngram_sync) args=(--speculative-config "$NG" --no-async-scheduling) ;;
            mtp) args=("${mtp[@]}" --speculative-config '{"method": "mtp"}') ;;
            mtp_sync) args=("${mtp[@]}" --speculative-config '{"method": "mtp"}' --no-async-scheduling) ;;
          esac
          timeout 100 $MET bench latency "${common[@]}" "${args[@]}" --output-json "$W/latency_${model}_$run.json" \
            > "$W/latency_${model}_$run.log" 2>&1
          echo "== $model $run: $(grep -E 'decode per token  ' "$W/latency_${model}_$run.log" | head -1)"
          grep -E "acceptance" "$W/latency_${model}_$run.log" | head -1
        done
      done ;;
    profile)
      timeout 240 python3 benchmarks/spec_step_profile.py --model $Q8 --load-format dummy --forced-ks 1,4 \
        --device-timeline > "$W/spec_step_profile.log" 2>&1
      echo "== profile: exit $?"; head -60 "$W/spec_step_profile.log" ;;
    demo_profile)
      timeout 200 python3 benchmarks/spec_step_profile.py --model demo > "$W/spec_step_profile_demo.log" 2>&1
      echo "== demo profile: exit $?"; grep -E "ms/step|steps, median" "$W/spec_step_profile_demo.log" ;;
  esac
done
