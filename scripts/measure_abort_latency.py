"""How soon a `met serve` frees what clients that went away held (docs/server.md, "Abort latency").

Starts `met serve` (the built-in demo model unless the server arguments say otherwise) on
loopback, then per round opens --streams chat streams at once (every --n4-every-th with n = 4),
each with --max-tokens and a prompt of the question repeated --prompt-repeat times; each client
closes its connection after its first SSE chunk (the role, sent once the engine took the
request) or, with --first content, after its first token. Prints, per round, the seconds from
the last close until GET /metrics shows no running or waiting request and the KV usage of the
idle server. --busy N keeps N busy-loop processes beside it (a loaded machine).

usage: python scripts/measure_abort_latency.py [--rounds 5] [--busy 2] [-- SERVE ARGS...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

QUESTION = "What is the assert statement? "


def metrics(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("met:") and "{" in line:
            name, _, rest = line.partition("{")
            labels, _, value = rest.rpartition("} ")
            if labels.count("=") == 1:
                values[name] = float(value)
    return values


def busy(m: dict[str, float], idle_usage: float) -> bool:
    return (m["met:num_requests_running"] > 0 or m["met:num_requests_waiting"] > 0
            or m["met:kv_cache_usage_perc"] != idle_usage)


async def one_round(url: str, args: argparse.Namespace, idle_usage: float, round_index: int) -> float:
    prompt = QUESTION * args.prompt_repeat

    async def open_and_drop(client: httpx.AsyncClient, i: int) -> float:
        # A prefix of its own: no prefix-cache hit on an earlier round spares the prefill.
        content = f"round {round_index}, stream {i}: {prompt}"
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": args.max_tokens,
                "temperature": 1.0, "n": 4 if args.n4_every and i % args.n4_every == 0 else 1, "stream": True,
                "ignore_eos": True}
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: ") and (args.first == "role" or '"content":""' not in line):
                    break
        return time.monotonic()

    limits = httpx.Limits(max_connections=args.streams + 8)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        last_close = max(await asyncio.gather(*(open_and_drop(client, i) for i in range(args.streams))))
    while busy(metrics(url), idle_usage):
        if time.monotonic() - last_close > 60:
            raise SystemExit(f"still busy a minute after the clients left: {metrics(url)}")
        await asyncio.sleep(0.01)
    return time.monotonic() - last_close


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--n4-every", type=int, default=16, help="every Nth stream asks n=4 (0: none)")
    parser.add_argument("--max-tokens", type=int, default=1800)
    parser.add_argument("--prompt-repeat", type=int, default=30, help="about 7 demo-model tokens each")
    parser.add_argument("--first", choices=("role", "content"), default="role")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--busy", type=int, default=0, help="busy-loop processes beside the server")
    parser.add_argument("--serve", default="-m metrale.entrypoints.cli",
                        help="what python runs with 'serve ...' after it (a wrapper script, say)")
    parser.add_argument("serve_args", nargs="*", help="after --: more `met serve` arguments")
    args = parser.parse_args()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    log = open(f"/tmp/met_abort_latency_{port}.log", "wb")
    server = subprocess.Popen([sys.executable, *args.serve.split(), "serve", "--port", str(port), *args.serve_args],
                              stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"met serve did not start; see {log.name}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        idle_usage = metrics(url)["met:kv_cache_usage_perc"]
        waits = []
        for r in range(args.rounds):
            waits.append(asyncio.run(one_round(url, args, idle_usage, r)))
            print(f"round {r}: idle {waits[-1]:.3f} s after the last of {args.streams} clients left", flush=True)
            time.sleep(0.5)
        print(f"max {max(waits):.3f} s, median {sorted(waits)[len(waits) // 2]:.3f} s over {args.rounds} rounds "
              f"({args.busy} busy processes beside the server; serve args: {' '.join(args.serve_args) or 'none'})")
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        for burner in burners:
            burner.kill()
            burner.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
