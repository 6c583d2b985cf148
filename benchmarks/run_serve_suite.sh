#!/usr/bin/env bash
# `met bench serve` over a request-rate sweep against `met serve`, then the same client and workload
# against `transformers serve` (continuous batching), on one random checkpoint of a shipped config
# (benchmarks/random_checkpoint.py: transformers loads weights from disk only). Both servers get
# text prompts of a word-level tokenizer that encodes back to the workload's token ids, and no
# ignore_eos (transformers refuses the field; random weights rarely sample the EOS token).
#     OUT=/tmp/out bash benchmarks/run_serve_suite.sh
# Environment: CONFIG (default metrale/model_configs/Qwen3-8B), DTYPE (bf16), DEVICE (cuda),
# RATES (2,8,inf), PROMPTS (48), INPUT ("128 512"), OUTPUT ("64 256"), GOODPUT ("ttft:500 tpot:50"),
# MET_ARGS (extra `met serve` flags), HF (1: also transformers serve), DEADLINE (s per sweep, 200),
# MAX_TOKEN_ID (10000: prompt ids below the vocabulary size), CKPT (where the checkpoint goes).
# Writes $OUT/met_serve.json, $OUT/hf_serve.json, $OUT/serve.log (both servers' logs, the tables).
set -uo pipefail
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/met-serve-suite}"
CONFIG="${CONFIG:-metrale/model_configs/Qwen3-8B}"
DTYPE="${DTYPE:-bf16}" DEVICE="${DEVICE:-cuda}" RATES="${RATES:-2,8,inf}" PROMPTS="${PROMPTS:-48}"
INPUT="${INPUT:-128 512}" OUTPUT="${OUTPUT:-64 256}" GOODPUT="${GOODPUT:-ttft:500 tpot:50}" HF="${HF:-1}"
DEADLINE="${DEADLINE:-200}"
CKPT="${CKPT:-/tmp/serve-suite-checkpoint}"
mkdir -p "$OUT"
LOG="$OUT/serve.log"

wait_ready() {  # url pid: until GET /health answers 200, or the server exits
  for _ in $(seq 600); do
    curl -sf "$1/health" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.5
  done
  return 1
}

sweep() {  # url output-json
  timeout "$DEADLINE" python3 -m metrale.entrypoints.cli bench serve --base-url "$1" --num-prompts "$PROMPTS" \
    --input-len-range $INPUT --output-len-range $OUTPUT --request-rate "$RATES" --goodput $GOODPUT \
    --max-token-id "${MAX_TOKEN_ID:-10000}" --num-warmups 4 --prompt-format text --tokenizer "$CKPT" \
    --no-ignore-eos --output-json "$2" 2>&1
}

stop() {  # pid
  kill -INT "$1" 2>/dev/null; for _ in $(seq 60); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.5; done
  kill -9 "$1" 2>/dev/null
}

echo "# $(git rev-parse --short HEAD 2>/dev/null) $CONFIG $DTYPE: rates $RATES, $PROMPTS prompts, input $INPUT," \
     "output $OUTPUT, goodput $GOODPUT" | tee "$LOG"
[ -f "$CKPT/config.json" ] || python3 benchmarks/random_checkpoint.py --config "$CONFIG" --out "$CKPT" --dtype "$DTYPE" \
  --device "$DEVICE" 2>&1 | grep -v "Writing model shards" | tee -a "$LOG"

echo "## met serve" | tee -a "$LOG"
python3 -m metrale.entrypoints.cli serve --model "$CKPT" --port 8000 ${MET_ARGS:-} >"$OUT/met_server.log" 2>&1 &
MET=$!
if wait_ready http://127.0.0.1:8000 $MET; then sweep http://127.0.0.1:8000 "$OUT/met_serve.json"
else echo "met serve did not start:"; tail -20 "$OUT/met_server.log"; fi | tee -a "$LOG"
stop $MET

if [ "$HF" = 1 ]; then
  echo "## transformers serve --continuous-batching" | tee -a "$LOG"
  python3 -m transformers.cli.transformers serve "$CKPT" --continuous-batching --device "$DEVICE" \
    --dtype "$([ "$DTYPE" = bf16 ] && echo bfloat16 || ([ "$DTYPE" = fp16 ] && echo float16 || echo float32))" \
    --host 127.0.0.1 --port 8001 >"$OUT/hf_server.log" 2>&1 &
  HFPID=$!
  if wait_ready http://127.0.0.1:8001 $HFPID; then sweep http://127.0.0.1:8001 "$OUT/hf_serve.json"
  else echo "transformers serve did not start:"; tail -20 "$OUT/hf_server.log"; fi | tee -a "$LOG"
  stop $HFPID
fi
tail -n 40 "$OUT/met_server.log" "${OUT}/hf_server.log" >>"$LOG" 2>/dev/null
