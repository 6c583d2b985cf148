"""A verify step's cost against a plain decode step on the GPU (issue 17's bar: k <= 4 drafts at
batch 1 cost at most 1.15x a plain step), with random weights of a shipped config:

    PYTHONPATH=. python3 benchmarks/spec_verify_bench.py --model metrale/model_configs/Qwen3-8B
    PYTHONPATH=. python3 benchmarks/spec_verify_bench.py --model metrale/model_configs/Qwen3-8B --batch-sizes 1,4,16
    PYTHONPATH=. python3 benchmarks/spec_verify_bench.py --model demo            # the built-in demo model

For each batch size B (requests at --context-len tokens) it times, with CUDA events over
--iters back-to-back replays:
  * plain: the engine's captured decode graph of B rows;
  * verify k: a verify graph of B x (1 + k) rows (executor/cuda_graphs.VerifyGraphs, every row
    real), for k in --ks; "eager" is the same forward launched without the graph;
  * the samplers on those graphs' logits, host included (wall time, synchronized): the plain
    sampler's greedy argmax, and the rejection sampler (kernels/rejection_sampling.py) for greedy
    and for sampled requests (temperature 0.7, top-p 0.9), k drafts each;
and prints verify / plain (the forward alone) and (verify + rejection) / (plain + sampler) (the
whole device step). In the engine a verify step replays the graph of its longest draft count
(shorter ones padded with dummy rows), so its cost is that row's.
"""

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from metrale import LLM  # noqa: E402
from metrale.executor.cuda_graphs import VerifyGraphs  # noqa: E402
from metrale.executor.rejection_sampler import verify_drafts  # noqa: E402
from metrale.executor.sampler import SamplingRow, sample_tokens  # noqa: E402
from metrale.kernels import skinny_gemm  # noqa: E402
from metrale.layers import linear  # noqa: E402
from metrale.layers.attention import triton_backend  # noqa: E402
from metrale.messages.sampling_params import SamplingParams  # noqa: E402


def int_list(text):
    return sorted({int(v) for v in text.split(",") if v.strip()})


def fill(graphs, batch: int, context_len: int, num_queries: int, blocks_per_seq: int, vocab: int) -> None:
    """The static buffers of `graphs` for `batch` sequences of context_len cached tokens, each
    computing num_queries new ones (all real), sequence i on blocks i * blocks_per_seq ..."""
    bs, device = graphs.runner.block_size, graphs.device
    rows = batch * num_queries
    seq = torch.arange(batch, device=device).repeat_interleave(num_queries)
    positions = context_len + torch.arange(num_queries, device=device).repeat(batch)
    tables = (torch.arange(batch, device=device)[:, None] * blocks_per_seq
              + torch.arange(blocks_per_seq, device=device)[None, :]).to(torch.int32)
    graphs.input_ids[:rows].copy_(torch.randint(0, vocab, (rows,), device=device))
    graphs.positions[:rows].copy_(positions)
    graphs.slot_mapping[:rows].copy_(tables[seq, positions // bs].long() * bs + positions % bs)
    graphs.block_tables[:batch].zero_()
    graphs.block_tables[:batch, :blocks_per_seq].copy_(tables)
    graphs.seq_lens[:batch].fill_(context_len + num_queries)
    graphs.real_query_lens[:batch].fill_(num_queries)


def device_us(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(3):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(samples)


def wall_us(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - begin) * 1e6 / iters


def kernel_us(fn, replays: int) -> dict[str, float]:
    """Microseconds per replay of fn spent in each kernel (by name), from torch.profiler."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.self_device_time_total / replays for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA}


def print_kernel_diff(plain: dict[str, float], verify: dict[str, float], k: int, rows: int = 25) -> None:
    """The kernels of a verify step against a plain step, largest difference first."""
    names = sorted(set(plain) | set(verify), key=lambda n: -abs(verify.get(n, 0.0) - plain.get(n, 0.0)))
    print(f"  kernels, batch 1, k={k}: plain {sum(plain.values()):.1f} us, verify {sum(verify.values()):.1f} us")
    for name in names[:rows]:
        p, v = plain.get(name, 0.0), verify.get(name, 0.0)
        print(f"    {p:9.1f} {v:9.1f} {v - p:+8.1f}  {name[:110]}")


def force_verify_kv_splits(num_splits: int) -> None:
    """Verify steps' decode attention (more than one query row per sequence) with num_splits KV
    splits instead of the engine's choice, for an A/B of the attention's share."""
    decode = triton_backend.decode_attention_triton

    def with_splits(*args, num_queries: int = 1, **kwargs):
        if num_queries > 1:
            kwargs["num_kv_splits"] = num_splits
        return decode(*args, num_queries=num_queries, **kwargs)

    triton_backend.decode_attention_triton = with_splits


def rows_of(batch: int, params: SamplingParams, context_len: int) -> list[SamplingRow]:
    return [SamplingRow(params, 1234 + i, list(range(context_len + 1)), context_len) for i in range(batch)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="metrale/model_configs/Qwen3-8B")
    parser.add_argument("--batch-sizes", type=int_list, default=int_list("1,4,16"))
    parser.add_argument("--ks", type=int_list, default=int_list("1,2,3,4,5,6,7,8"))
    parser.add_argument("--context-len", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--output", help="also write the rows as JSON here")
    parser.add_argument("--skinny-gemm", action=argparse.BooleanOptionalAction, default=linear.SKINNY_GEMM,
                        help="linear layers of 2..16 rows on the skinny GEMM where the layer picks it (the "
                             "engine's default), or on cuBLAS")
    parser.add_argument("--skinny-pdl", action=argparse.BooleanOptionalAction, default=False,
                        help="the skinny GEMM takes programmatic dependent launch too (skinny_gemm.PDL_LAUNCH)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the engine's context length, which sets the attention's KV split count "
                             "(default: the context + k + 64; the engine's own default is the model's)")
    parser.add_argument("--verify-kv-splits", type=int, default=None,
                        help="split count of the verify graphs' decode attention (default: as the engine picks)")
    parser.add_argument("--programmatic-launch", action=argparse.BooleanOptionalAction, default=None,
                        help="the engine's --programmatic-launch (default: on where supported)")
    parser.add_argument("--profile", action="store_true",
                        help="also print, for batch 1, the kernel times of each verify graph against the plain one")
    args = parser.parse_args()
    linear.SKINNY_GEMM = args.skinny_gemm  # before the engine captures its graphs
    skinny_gemm.PDL_LAUNCH = args.skinny_pdl
    if args.verify_kv_splits:
        force_verify_kv_splits(args.verify_kv_splits)
    max_batch, max_k = max(args.batch_sizes), max(args.ks)
    max_model_len = args.max_model_len or args.context_len + max_k + 64
    llm = LLM(args.model, load_format="dummy", skip_tokenizer_init=True, max_model_len=max_model_len,
              max_num_seqs=max_batch, max_num_batched_tokens=max(2048, max_batch * (1 + max_k)),
              programmatic_launch=args.programmatic_launch)
    runner = llm.llm_engine.runner
    if runner.graphs is None or not runner.supports_verify_graphs:
        raise SystemExit(f"no decode or verify graphs on this runner (backends {runner.backend_names})")
    vocab = runner.model_config.vocab_size
    bs = runner.block_size
    blocks_per_seq = -(-(args.context_len + max_k + 1) // bs)
    if runner.caches.num_blocks < max_batch * blocks_per_seq:
        raise SystemExit(f"{runner.caches.num_blocks} KV blocks: fewer than {max_batch} x {blocks_per_seq}")
    max_blocks = -(-max_model_len // bs)
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_p=0.9)
    print(f"{args.model}: backends {runner.backend_names}, skinny GEMM {'on' if args.skinny_gemm else 'off'} "
          f"(PDL {'on' if args.skinny_pdl else 'off'}), engine PDL {args.programmatic_launch}, "
          f"verify KV splits {args.verify_kv_splits or 'default'}, "
          f"context {args.context_len} of max_model_len {max_model_len}, "
          f"{args.iters} replays per figure (us)")
    print(f"{'batch':>5} {'k':>2} {'plain':>8} {'verify':>8} {'ratio':>6} {'eager':>8} {'sampler':>8} "
          f"{'rej.greedy':>10} {'rej.sampled':>11} {'step ratio':>10}")
    results = []
    for batch in args.batch_sizes:
        if batch not in runner.graphs.graphs:
            print(f"batch {batch}: no decode graph of that size (captured: {runner.graphs.sizes})")
            continue
        fill(runner.graphs, batch, args.context_len, 1, blocks_per_seq, vocab)
        plain = device_us(runner.graphs.graphs[batch].replay, args.iters)
        plain_logits = runner.graphs.outputs[batch].logits
        plain_rows = rows_of(batch, greedy, args.context_len)
        sampler = wall_us(lambda: sample_tokens(plain_logits, plain_rows), args.iters)
        plain_kernels = kernel_us(runner.graphs.graphs[batch].replay, 10) if args.profile and batch == 1 else None
        for k in args.ks:
            graphs = VerifyGraphs(runner, [batch], max_blocks, max_model_len, 1 + k)
            graphs.capture()
            fill(graphs, batch, args.context_len, 1 + k, blocks_per_seq, vocab)
            verify = device_us(graphs.graphs[batch].replay, args.iters)
            if plain_kernels is not None:
                print_kernel_diff(plain_kernels, kernel_us(graphs.graphs[batch].replay, 10), k)
            with torch.inference_mode(), runner.kernel_context():
                eager = device_us(lambda: graphs._forward(batch), max(5, args.iters // 5))
            logits = graphs.outputs[batch].logits
            drafts = [list(np.random.default_rng(i).integers(0, vocab, k)) for i in range(batch)]
            drafts = [[int(t) for t in d] for d in drafts]
            times = {}
            for name, params in (("greedy", greedy), ("sampled", sampled)):
                rows = rows_of(batch, params, args.context_len)
                with runner.kernel_context():
                    times[name] = wall_us(lambda: verify_drafts(logits, rows, drafts), args.iters)
            graphs.release()
            del graphs
            row = dict(batch=batch, k=k, plain_us=plain, verify_us=verify, ratio=verify / plain, eager_us=eager,
                       sampler_us=sampler, rejection_greedy_us=times["greedy"],
                       rejection_sampled_us=times["sampled"],
                       step_ratio=(verify + times["greedy"]) / (plain + sampler))
            results.append(row)
            print(f"{batch:>5} {k:>2} {plain:>8.1f} {verify:>8.1f} {row['ratio']:>6.3f} {eager:>8.1f} "
                  f"{sampler:>8.1f} {times['greedy']:>10.1f} {times['sampled']:>11.1f} {row['step_ratio']:>10.3f}")
    batch1 = [r for r in results if r["batch"] == 1 and r["k"] <= 4]
    if batch1:
        worst = max(r["ratio"] for r in batch1)
        print(f"batch 1, k <= 4: verify / plain at most {worst:.3f} (the bar: 1.15)")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"model": args.model, "context_len": args.context_len, "skinny_gemm": args.skinny_gemm,
                       "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
