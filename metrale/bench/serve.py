"""`met bench serve`: drive a running `met serve` over HTTP at a request rate or a concurrency.

Streams /v1/completions with token-id prompts of the random workload (ignore_eos, so every
request produces its max_tokens) and reports TTFT, TPOT (per request: (e2e - ttft) / (tokens - 1)),
ITL (gaps between stream chunks) and end-to-end latency (mean, median, p99), request and token
throughput, and, from the server's GET /memory plan, the floor of the same requests run offline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field



def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="served model name (default: the server's first)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-len-range", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len-range", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX"))
    parser.add_argument("--max-token-id", type=int, default=10000)
    parser.add_argument("--dataset-seed", type=int, default=0)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second, Poisson arrivals (inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--output-json", default=None)


@dataclass
class RequestResult:
    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def _one(client, url, headers, model, prompt, max_tokens) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - start
        result.ok = True
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        result.error = repr(e)
    return result


def _summary(values: list[float]) -> dict:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    return {"mean": statistics.fmean(ordered), "median": statistics.median(ordered),
            "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


async def _drive(args) -> tuple[list[RequestResult], float, dict | None]:
    import httpx

    from metrale.bench.workload import random_workload  # imports torch: not at the top, for `met --help`

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    work = random_workload(args.num_prompts, tuple(args.input_len_range), tuple(args.output_len_range),
                           args.dataset_seed, args.max_token_id)
    limits = httpx.Limits(max_connections=args.max_concurrency or args.num_prompts)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=None, limits=limits) as client:
        model = args.model or (await client.get("/v1/models", headers=headers)).json()["data"][0]["id"]
        memory = (await client.get("/memory", headers=headers)).json()
        gate = asyncio.Semaphore(args.max_concurrency or args.num_prompts)
        rng = random.Random(args.dataset_seed)

        async def limited(prompt, params):
            async with gate:
                return await _one(client, "/v1/completions", headers, model, prompt, params.max_tokens)

        tasks = []
        start = time.perf_counter()
        for prompt, params in zip(work.prompts, work.params):
            tasks.append(asyncio.create_task(limited(prompt, params)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start, {"memory": memory, "work": work}


def run(args: argparse.Namespace) -> dict:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)
    results, seconds, extra = asyncio.run(_drive(args))
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    work = extra["work"]
    result = {
        "benchmark": "serve", "num_prompts": args.num_prompts, "completed": len(done),
        "failed": len(results) - len(done), "seconds": seconds,
        "request_throughput": len(done) / seconds, "output_token_throughput": output_tokens / seconds,
        "total_token_throughput": (output_tokens + sum(work.input_lens)) / seconds,
        "ttft_s": _summary([r.ttft for r in done]),
        "tpot_s": _summary([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]),
        "itl_s": _summary([x for r in done for x in r.itl]), "e2e_s": _summary([r.e2e for r in done]),
    }
    result.update(_floor(extra["memory"], work, seconds))
    print(f"{len(done)}/{len(results)} requests in {seconds:.2f} s: {result['request_throughput']:.2f} req/s, "
          f"{result['output_token_throughput']:.1f} output tok/s, {result['total_token_throughput']:.1f} total tok/s")
    for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        s = result[name]
        print(f"  {name[:-2].upper():5} mean {s['mean'] * 1e3:9.2f} ms   median {s['median'] * 1e3:9.2f} ms   "
              f"p99 {s['p99'] * 1e3:9.2f} ms")
    if "floor_seconds" in result:
        print(f"  floor {result['floor_seconds']:.2f} s for the same requests offline ({result['bound']}-bound); "
              f"achieved / floor {result['floor_ratio']:.1%}")
    for r in results:
        if not r.ok:
            print(f"  failed: {r.error}")
            break
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _floor(memory: dict, work, seconds: float) -> dict:
    """The offline floor of the same requests, from the server's plan and a bandwidth measured here
    (only when this client runs on the server's GPU host; otherwise no floor is printed)."""
    try:
        import torch

        from metrale.bench.hardware import measure, offline_floor

        plan = memory["devices"][0]["ledger"]["plan"]
        if plan["device"] != "cuda" or not torch.cuda.is_available():
            return {}
        rates = measure(torch.device("cuda"))
        # The server's plan has no per-expert breakdown: every step reads all weights (exact for dense).
        floor = offline_floor(lambda tokens: plan["weight_bytes"], plan["weight_bytes"] // 2,
                              plan["kv_bytes_per_token"], work.input_lens, work.output_lens, rates,
                              plan.get("state_bytes_per_slot", 0))
        return {"floor_seconds": floor.seconds, "floor_ratio": floor.seconds / seconds, "bound": floor.bound}
    except (KeyError, IndexError, TypeError):
        return {}
