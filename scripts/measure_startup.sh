#!/usr/bin/env bash
# Time from launching `met serve` (built-in demo model) to its first 200 on /health, then the
# time of a 40-token chat completion; optionally with the machine's other cores kept busy.
# usage: scripts/measure_startup.sh [--busy N] [PORT]   (N busy-loop processes beside the server)
set -euo pipefail
busy=0
if [[ "${1:-}" == "--busy" ]]; then busy=$2; shift 2; fi
port=${1:-18765}
pids=()
for _ in $(seq 1 "$busy"); do python3 -c "while True: pass" & pids+=($!); done
trap 'kill "${pids[@]}" 2>/dev/null || true; kill "$server" 2>/dev/null || true' EXIT
start=$(date +%s.%N)
met serve --port "$port" > "/tmp/met_startup_$port.log" 2>&1 &
server=$!
until curl -s -o /dev/null -w "%{http_code}" "localhost:$port/health" 2>/dev/null | grep -q 200; do
  kill -0 "$server" 2>/dev/null || { cat "/tmp/met_startup_$port.log"; exit 1; }
  sleep 0.05
done
ready=$(date +%s.%N)
chat_start=$(date +%s.%N)
curl -s "localhost:$port/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"model": "demo", "max_tokens": 40, "temperature": 0, "ignore_eos": true,
       "messages": [{"role": "user", "content": "What is the assert statement?"}]}' > /dev/null
chat_end=$(date +%s.%N)
printf 'ready after %.2f s; a 40-token chat took %.2f s (%d busy processes beside it)\n' \
  "$(echo "$ready - $start" | bc)" "$(echo "$chat_end - $chat_start" | bc)" "$busy"
kill -TERM "$server"; wait "$server" || true
