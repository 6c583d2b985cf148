"""`met bench serve`: drive a running OpenAI-compatible server over HTTP at request rates or a concurrency.

Streams /v1/completions with the prompts of the random workload (token ids, or their text for
servers that take strings only, such as `transformers serve`; ignore_eos where the server takes
it, so every request produces its max_tokens) and reports TTFT, TPOT (per request: (e2e - ttft) /
(tokens - 1)), ITL (gaps between streamed tokens) and end-to-end latency (mean, median, p99),
request and token throughput, goodput under the SLOs given, and, from a met server's GET /memory
plan, the floor of the same requests run offline. Several request rates run the same workload
once each, in order, and end with one table of the sweep.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field



def _rates(text: str) -> list[float]:
    try:
        rates = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated request rates (or inf), got {text!r}")
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"request rates must be positive, got {text!r}")
    return rates


SLO_METRICS = ("ttft", "tpot", "e2e")


def _slo(text: str) -> tuple[str, float]:
    name, _, ms = text.partition(":")
    try:
        value = float(ms)
    except ValueError:
        value = -1.0
    if name not in SLO_METRICS or value <= 0:
        raise argparse.ArgumentTypeError(f"an SLO is METRIC:MILLISECONDS with METRIC one of {', '.join(SLO_METRICS)}, "
                                         f"got {text!r}")
    return name, value / 1e3


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="served model name (default: the server's first)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--input-len-range", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len-range", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX"))
    parser.add_argument("--max-token-id", type=int, default=10000)
    parser.add_argument("--dataset-seed", type=int, default=0)
    parser.add_argument("--request-rate", type=_rates, default=[float("inf")],
                        help="requests per second, Poisson arrivals (inf: all at once); a comma-separated "
                             "list runs the workload once per rate, in order (a sweep from light load to saturation)")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--goodput", type=_slo, nargs="+", default=[], metavar="METRIC:MS",
                        help="service-level objectives, e.g. ttft:500 tpot:50 (METRIC in ttft, tpot, e2e): "
                             "goodput is the completed requests per second that meet all of them")
    parser.add_argument("--prompt-format", choices=("ids", "text"), default="ids",
                        help="ids: the prompts' token ids as sent; text: decoded with --tokenizer first, for "
                             "servers that take string prompts only (transformers serve)")
    parser.add_argument("--tokenizer", default=None, help="the tokenizer directory of --prompt-format text")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="ask for every request's max_tokens (servers without the field refuse it: "
                             "--no-ignore-eos; random weights rarely sample the EOS token)")
    parser.add_argument("--num-warmups", type=int, default=0,
                        help="requests sent (all at once, not timed) before the first rate: a server's "
                             "first requests may pay for compilation and allocation")
    parser.add_argument("--output-json", default=None)


@dataclass
class RequestResult:
    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def _one(client, url, headers, model, prompt, max_tokens, ignore_eos: bool) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    chunks = 0
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
                if chunk.get("choices") and any(c.get("text") for c in chunk["choices"]):
                    chunks += 1
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
        result.e2e = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks  # a server without usage: one token per chunk
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


def _prompts(args, work) -> list:
    """The workload's prompts as the server takes them: token ids, or their text (--prompt-format)."""
    if args.prompt_format == "ids":
        return work.prompts
    if not args.tokenizer:
        raise SystemExit("--prompt-format text needs --tokenizer (the directory whose tokenizer decodes the ids)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    return [tokenizer.decode(ids) for ids in work.prompts]


async def _drive(args, rate: float, work, prompts) -> tuple[list[RequestResult], float, dict | None]:
    """One pass of the workload at `rate` requests per second: (results, seconds, the server's
    GET /memory, or None where it has none)."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or args.num_prompts)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=None, limits=limits) as client:
        model = args.model or (await client.get("/v1/models", headers=headers)).json()["data"][0]["id"]
        response = await client.get("/memory", headers=headers)
        memory = response.json() if response.status_code == 200 else None
        gate = asyncio.Semaphore(args.max_concurrency or args.num_prompts)
        rng = random.Random(args.dataset_seed)

        async def limited(prompt, params):
            async with gate:
                return await _one(client, "/v1/completions", headers, model, prompt, params.max_tokens,
                                  args.ignore_eos)

        tasks = []
        start = time.perf_counter()
        for prompt, params in zip(prompts, work.params):
            tasks.append(asyncio.create_task(limited(prompt, params)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start, memory


def _meets(r: RequestResult, slos: list[tuple[str, float]]) -> bool:
    tpot = (r.e2e - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
    measured = {"ttft": r.ttft, "tpot": tpot, "e2e": r.e2e}
    return all(measured[name] <= limit for name, limit in slos)


def _result(args, rate: float, results: list[RequestResult], seconds: float, work, memory) -> dict:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    result = {
        "benchmark": "serve", "request_rate": rate, "num_prompts": args.num_prompts, "completed": len(done),
        "failed": len(results) - len(done), "seconds": seconds,
        "request_throughput": len(done) / seconds, "output_token_throughput": output_tokens / seconds,
        "total_token_throughput": (output_tokens + sum(work.input_lens)) / seconds,
        "ttft_s": _summary([r.ttft for r in done]),
        "tpot_s": _summary([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]),
        "itl_s": _summary([x for r in done for x in r.itl]), "e2e_s": _summary([r.e2e for r in done]),
    }
    if args.goodput:
        result["slo_ms"] = {name: limit * 1e3 for name, limit in args.goodput}
        result["goodput"] = sum(_meets(r, args.goodput) for r in done) / seconds
    if memory is not None:
        result.update(_floor(memory, work, seconds))
    return result


def _print(result: dict, results: list[RequestResult]) -> None:
    rate = result["request_rate"]
    print(f"request rate {'inf' if rate == float('inf') else f'{rate:g}/s'}: {result['completed']}/{len(results)} "
          f"requests in {result['seconds']:.2f} s: {result['request_throughput']:.2f} req/s, "
          f"{result['output_token_throughput']:.1f} output tok/s, {result['total_token_throughput']:.1f} total tok/s")
    for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        s = result[name]
        print(f"  {name[:-2].upper():5} mean {s['mean'] * 1e3:9.2f} ms   median {s['median'] * 1e3:9.2f} ms   "
              f"p99 {s['p99'] * 1e3:9.2f} ms")
    if "goodput" in result:
        slos = ", ".join(f"{name} <= {ms:g} ms" for name, ms in result["slo_ms"].items())
        print(f"  goodput {result['goodput']:.2f} req/s ({slos})")
    if "floor_seconds" in result:
        print(f"  floor {result['floor_seconds']:.2f} s for the same requests offline ({result['bound']}-bound); "
              f"achieved / floor {result['floor_ratio']:.1%}")
    for r in results:
        if not r.ok:
            print(f"  failed: {r.error}")
            break


def _table(runs: list[dict]) -> None:
    """The sweep as one markdown table (ms; goodput where SLOs were given)."""
    goodput = "goodput" in runs[0]
    print("| request rate | req/s | output tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | ITL p50 | ITL p99 |"
          + (" goodput req/s |" if goodput else ""))
    print("|---" * (9 + goodput) + "|")
    for r in runs:
        rate = "inf" if r["request_rate"] == float("inf") else f"{r['request_rate']:g}"
        ms = [r[k][q] * 1e3 for k in ("ttft_s", "tpot_s", "itl_s") for q in ("median", "p99")]
        print(f"| {rate} | {r['request_throughput']:.2f} | {r['output_token_throughput']:.0f} | "
              + " | ".join(f"{v:.1f}" for v in ms) + " |" + (f" {r['goodput']:.2f} |" if goodput else ""))


def run(args: argparse.Namespace) -> dict:
    """The workload once per --request-rate; returns the run's result (one rate) or {"runs": [...]}
    (a sweep), as --output-json writes it."""
    import logging

    from metrale.bench.workload import random_workload  # imports torch: not at the top, for `met --help`

    logging.getLogger("httpx").setLevel(logging.WARNING)
    work = random_workload(args.num_prompts, tuple(args.input_len_range), tuple(args.output_len_range),
                           args.dataset_seed, args.max_token_id)
    prompts = _prompts(args, work)
    if args.num_warmups > 0:
        warm = argparse.Namespace(**{**vars(args), "num_prompts": min(args.num_warmups, args.num_prompts)})
        asyncio.run(_drive(warm, float("inf"), work, prompts[:warm.num_prompts]))
    runs = []
    for rate in args.request_rate:
        results, seconds, memory = asyncio.run(_drive(args, rate, work, prompts))
        runs.append(_result(args, rate, results, seconds, work, memory))
        _print(runs[-1], results)
    if len(runs) > 1:
        _table(runs)
    out = runs[0] if len(runs) == 1 else {"benchmark": "serve", "runs": runs}
    if args.output_json:  # strict JSON: an unbounded rate is written "inf", as vLLM's results write it
        def strict(run):
            return {**run, "request_rate": "inf"} if run["request_rate"] == float("inf") else run

        written = strict(out) if len(runs) == 1 else {**out, "runs": [strict(r) for r in runs]}
        with open(args.output_json, "w") as f:
            json.dump(written, f, indent=2, allow_nan=False)
    return out


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
