"""Qwen2.5-VL with images on the GPU (issue 19): time to first token and batch throughput, met
against its floor and against transformers, in one job.

    python benchmarks/vl_bench.py --output-json /tmp/vl.json          # the H200 run, < 300 s
    python benchmarks/vl_bench.py --tiny                               # CPU smoke run, < 60 s
    python benchmarks/vl_bench.py --met-only | --hf-only

For each count of images per request (1 and 4 of 1024x1024 by default):
- TTFT: one request at a time, --num-iters times after one warm-up, median and p99 (numpy's
  linear interpolation: of 10, nearly the slowest). met: from `LLM.generate` with the PIL
  images to the first token (max_tokens 1; the image processor, the tower, the prefill and the
  sampler included). transformers: its image processor, then one
  forward (`logits_to_keep=1`) and the argmax; the processor's share is reported on its own too.
- Throughput: --batch-size requests run to --output-len tokens each (ignore_eos / min_new_tokens),
  from PIL images to the last token; transformers' `generate` on the batch (no padding: every
  prompt has the same length).
- Floors (metrale/bench/vision_floor.py): matmul FLOPs of the tower and the text model over the
  measured bf16 matmul rate, or the weights' (and KV's) bytes over the measured bandwidth,
  whichever is larger. On the CPU the rates are float32 ones: the --tiny floors mean nothing.

The model is metrale/model_configs/Qwen2.5-VL-7B-Instruct with random weights in bf16: met's
`--load-format dummy`, transformers' own random init (so their tokens differ; only time is
compared). transformers runs first and is freed before met starts, so met's memory plan sees the
whole GPU. --tiny writes a tiny checkpoint with transformers that both load, in float32 on the
CPU, with 1 and 2 small images and a few tokens; there the greedy tokens of both must be equal
(`tokens_equal` in the JSON), which checks that the prompts and images reach both the same way.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from metrale.bench.hardware import measure  # noqa: E402
from metrale.bench.vision_floor import VLWeights, batch_floor, ttft_floor  # noqa: E402
from metrale.bench.vl_workload import (TINY_IMAGE_SIZE, VisionTokens, image_token_count, make_requests,  # noqa: E402
                                       write_tiny_checkpoint)

SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "metrale", "model_configs",
                       "Qwen2.5-VL-7B-Instruct")
TTFT_SEED, BATCH_SEED, WARMUP_SEED = 1, 2, 3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _summary(seconds: list[float]) -> dict:
    return {"ttft_median_s": statistics.median(seconds), "ttft_p99_s": float(np.percentile(seconds, 99)),
            "ttft_per_iter_s": seconds}


class Case:
    """One count of images per request: the inputs every framework gets."""

    def __init__(self, args, tokens: VisionTokens, images_per_request: int, tokens_per_image: int):
        self.images_per_request = images_per_request
        self.tokens_per_image = tokens_per_image

        def requests(count, seed):
            return make_requests(tokens, count, images_per_request, args.image_size, tokens_per_image,
                                 seed * 100 + images_per_request)
        # Iteration i of the TTFT loop is request i (the first the warm-up, not counted).
        self.ttft_requests = requests(args.num_iters + 1, TTFT_SEED)
        self.batch_requests = requests(args.batch_size, BATCH_SEED)
        self.prompt_len = len(self.batch_requests[0].prompt_token_ids)


# -- met --------------------------------------------------------------------------------------

def run_met(args, model_dir: str, cases: list[Case]) -> dict:
    from metrale import LLM, SamplingParams

    max_images = max(c.images_per_request for c in cases)
    llm = LLM(model=model_dir, load_format="auto" if args.tiny else "dummy", dtype=args.dtype, device=args.device,
              skip_tokenizer_init=True, max_model_len=args.max_model_len, max_num_seqs=max(args.batch_size, 1),
              enforce_eager=args.enforce_eager, limit_mm_per_prompt={"image": max_images})
    try:
        device = llm.llm_engine.device
        first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        results = {}
        for case in cases:
            seconds, first_tokens = [], []
            for i, request in enumerate(case.ttft_requests):
                _sync(device)
                start = time.perf_counter()
                (out,) = llm.generate([request.met_prompt()], first, use_tqdm=False)
                _sync(device)
                if i:  # request 0 is the warm-up
                    seconds.append(time.perf_counter() - start)
                first_tokens.append(out.outputs[0].token_ids[0])
            params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
            warm = make_warmup(case)
            llm.generate([r.met_prompt() for r in warm], params.clone(max_tokens=2), use_tqdm=False)
            _sync(device)
            start = time.perf_counter()
            outs = llm.generate([r.met_prompt() for r in case.batch_requests], params, use_tqdm=False)
            _sync(device)
            batch_seconds = time.perf_counter() - start
            output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            results[case.images_per_request] = dict(
                _summary(seconds), first_tokens=first_tokens, **_throughput(batch_seconds, output_tokens, case, args),
                batch_tokens=[list(o.outputs[0].token_ids) for o in outs] if args.tiny else None)
        return results
    finally:
        llm.close()


def make_warmup(case: Case) -> list:
    """Two of the TTFT requests, run as a batch of 2 tokens before the timed batch, so that the
    first batched prefill and decode are not the timed ones. Their images are not the batch's:
    they warm no cache entry that the timed batch could reuse."""
    return case.ttft_requests[:2]


def _throughput(seconds: float, output_tokens: int, case: Case, args) -> dict:
    return {"batch_seconds": seconds, "output_tokens": output_tokens, "output_tokens_per_s": output_tokens / seconds,
            "total_tokens_per_s": (output_tokens + args.batch_size * case.prompt_len) / seconds}


# -- transformers -----------------------------------------------------------------------------

def _hf_model(args, model_dir: str, device: torch.device):
    import transformers

    dtype = getattr(torch, args.dtype)
    if args.tiny:
        return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
            model_dir, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = transformers.Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=dtype,
                                                                             attn_implementation="sdpa")
    return model.eval()


def _meta_weights(config, dtype: torch.dtype) -> VLWeights:
    """The floors' weight counts, from transformers' model built on the meta device (the same
    counts as met's: tests/models/test_qwen2_5_vl_parts.py), whichever framework runs."""
    import transformers

    with torch.device("meta"):
        model = transformers.Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=dtype)
    return _hf_weights(model)


def _hf_weights(model) -> VLWeights:
    visual = model.model.visual if hasattr(model.model, "visual") else model.visual
    embedding = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight is embedding
    vision_ids = {id(p) for p in visual.parameters()}
    vision = [p for p in model.parameters() if id(p) in vision_ids]
    text = [p for p in model.parameters() if id(p) not in vision_ids and (tied or p is not embedding)]
    count = lambda ps: sum(p.numel() for p in ps)  # noqa: E731
    size = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731
    return VLWeights(count(vision), size(vision), count(text), size(text), model.get_output_embeddings().weight.numel())


def _hf_inputs(model, processor, requests, device):
    images = [image for r in requests for image in r.images]
    processed = processor(images=images, return_tensors="pt")
    ids = torch.tensor([r.prompt_token_ids for r in requests], device=device)
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                  pixel_values=processed["pixel_values"].to(device),
                  image_grid_thw=processed["image_grid_thw"].to(device))
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
        # Later 5.x releases find the images' positions from these (1: image), not from the ids,
        # and without them silently rotate every token with 1-D positions.
        inputs["mm_token_type_ids"] = (ids == requests[0].image_pad).int()
    return inputs


@torch.no_grad()
def run_hf(args, model_dir: str, cases: list[Case]) -> dict:
    from transformers import AutoImageProcessor

    device = torch.device(args.device)
    model = _hf_model(args, model_dir, device)
    processor = AutoImageProcessor.from_pretrained(model_dir)
    results = {}
    try:
        for case in cases:
            seconds, processing, first_tokens = [], [], []
            for i, request in enumerate(case.ttft_requests):
                _sync(device)
                start = time.perf_counter()
                inputs = _hf_inputs(model, processor, [request], device)
                processed = time.perf_counter()
                logits = model(**inputs, logits_to_keep=1).logits
                token = int(logits[0, -1].argmax())
                _sync(device)
                if i:
                    seconds.append(time.perf_counter() - start)
                    processing.append(processed - start)
                first_tokens.append(token)
            inputs = _hf_inputs(model, processor, make_warmup(case), device)
            model.generate(**inputs, max_new_tokens=2, min_new_tokens=2, do_sample=False)
            _sync(device)
            start = time.perf_counter()
            inputs = _hf_inputs(model, processor, case.batch_requests, device)
            out = model.generate(**inputs, max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                                 do_sample=False)
            _sync(device)
            batch_seconds = time.perf_counter() - start
            new = out[:, inputs["input_ids"].shape[1]:]
            results[case.images_per_request] = dict(
                _summary(seconds), processor_median_s=statistics.median(processing), first_tokens=first_tokens,
                **_throughput(batch_seconds, int(new.numel()), case, args),
                batch_tokens=new.tolist() if args.tiny else None)
    finally:
        del model
    return results


# -- the run ----------------------------------------------------------------------------------

def _cases(args, model_dir: str) -> tuple[list[Case], object]:
    from transformers import AutoConfig, AutoImageProcessor

    config = AutoConfig.from_pretrained(model_dir)
    processor = AutoImageProcessor.from_pretrained(model_dir)
    probe = make_requests(VisionTokens.from_config(config), 1, 1, args.image_size, 1, 0)[0].images
    grid = processor(images=probe, return_tensors="pt")["image_grid_thw"][0].tolist()
    per_image = image_token_count(grid, config.vision_config.spatial_merge_size)
    tokens = VisionTokens.from_config(config)
    cases = [Case(args, tokens, n, per_image) for n in args.images_per_request]
    return cases, (config, grid)


def _floors(case: Case, weights: VLWeights, config, grid, rates, args) -> dict:
    text = getattr(config, "text_config", None) or config
    ttft = ttft_floor(weights, text, config.vision_config, [grid] * case.images_per_request, case.prompt_len, rates)
    batch = batch_floor(weights, text, config.vision_config, [grid] * (case.images_per_request * args.batch_size),
                        [case.prompt_len] * args.batch_size, args.output_len, rates)
    return {"floor_ttft_s": ttft.seconds, "floor_ttft_bound": ttft.bound, "floor_batch_s": batch.seconds,
            "floor_batch_bound": batch.bound,
            "floor_output_tokens_per_s": args.batch_size * args.output_len / batch.seconds}


def run(args) -> dict:
    model_dir = write_tiny_checkpoint(tempfile.mkdtemp(prefix="vl-bench-")) if args.tiny else args.model
    cases, (config, grid) = _cases(args, model_dir)
    rates = measure(torch.device(args.device))
    weights = _meta_weights(config, getattr(torch, args.dtype))
    frameworks, wall = {}, {}
    for name, part, skip in (("transformers", run_hf, args.met_only), ("met", run_met, args.hf_only)):
        if skip:
            continue
        start = time.perf_counter()
        try:
            frameworks[name] = part(args, model_dir, cases)
        except Exception as e:  # noqa: BLE001  (the other framework's figures still come back)
            if args.tiny:
                raise
            print(f"{name} failed: {type(e).__name__}: {e}", file=sys.stderr)
            frameworks[name] = {"error": f"{type(e).__name__}: {e}"}
        wall[name] = time.perf_counter() - start
        gc.collect()  # transformers' model and inputs gone before met's memory plan reads the free memory
        if torch.device(args.device).type == "cuda":
            torch.cuda.empty_cache()
    result = {"benchmark": "vl", "model": "tiny" if args.tiny else os.path.basename(model_dir.rstrip("/")),
              "device": rates.device, "dtype": args.dtype, "image_size": args.image_size, "image_grid_thw": grid,
              "batch_size": args.batch_size, "output_len": args.output_len, "num_iters": args.num_iters,
              "bandwidth_tb_s": rates.bandwidth_bytes_per_s / 1e12, "matmul_tflops": rates.matmul_flops_per_s / 1e12,
              "weights": vars(weights), "wall_seconds": wall, "commit": os.environ.get("MET_COMMIT"), "cases": []}
    for case in cases:
        row = {"images_per_request": case.images_per_request, "tokens_per_image": case.tokens_per_image,
               "prompt_len": case.prompt_len, **_floors(case, weights, config, grid, rates, args)}
        for name, per_case in frameworks.items():
            row[name] = per_case.get(case.images_per_request, per_case)
        if args.tiny and len(frameworks) == 2:  # the same weights: the same greedy tokens
            met, hf = row["met"], row["transformers"]
            row["tokens_equal"] = (met["first_tokens"] == hf["first_tokens"]
                                   and met["batch_tokens"] == hf["batch_tokens"])
        result["cases"].append(row)
    print_table(result, rates)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def print_table(result: dict, rates) -> None:
    print(rates.describe())
    print(f"{result['model']} ({result['dtype']}), images {result['image_size']}x{result['image_size']} "
          f"(grid {result['image_grid_thw']}), batch {result['batch_size']} x {result['output_len']} tokens")
    print(f"{'images':>6} {'framework':>12} {'TTFT med ms':>12} {'p99 ms':>9} {'floor ms':>9} {'floor/med':>9} "
          f"{'batch s':>8} {'out tok/s':>10} {'floor tok/s':>11} {'floor/run':>9}")
    for row in result["cases"]:
        for name in ("met", "transformers"):
            r = row.get(name)
            if r is None:
                continue
            if "error" in r:
                print(f"{row['images_per_request']:>6} {name:>12} failed: {r['error'][:200]}")
                continue
            print(f"{row['images_per_request']:>6} {name:>12} {r['ttft_median_s'] * 1e3:12.2f} "
                  f"{r['ttft_p99_s'] * 1e3:9.2f} "
                  f"{row['floor_ttft_s'] * 1e3:9.2f} {row['floor_ttft_s'] / r['ttft_median_s']:9.1%} "
                  f"{r['batch_seconds']:8.2f} {r['output_tokens_per_s']:10.1f} "
                  f"{row['floor_output_tokens_per_s']:11.1f} "
                  f"{row['floor_batch_s'] / r['batch_seconds']:9.1%}")
        if "tokens_equal" in row:
            print(f"{'':>6} greedy tokens met == transformers: {row['tokens_equal']}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=SHIPPED, help="a Qwen2.5-VL config directory (random weights)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run on a tiny checkpoint written now")
    parser.add_argument("--images-per-request", type=lambda s: [int(v) for v in s.split(",")], default=None)
    parser.add_argument("--image-size", type=int, default=None)
    parser.add_argument("--num-iters", type=int, default=None, help="TTFT iterations after one warm-up")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--device", default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--met-only", action="store_true")
    only.add_argument("--hf-only", action="store_true")
    parser.add_argument("--output-json")
    args = parser.parse_args(argv)
    defaults = (dict(images_per_request=[1, 2], image_size=TINY_IMAGE_SIZE, num_iters=3, batch_size=2, output_len=4,
                     max_model_len=256, dtype="float32", device="cpu") if args.tiny else
                dict(images_per_request=[1, 4], image_size=1024, num_iters=10, batch_size=16, output_len=128,
                     max_model_len=8192, dtype="bfloat16", device="cuda"))
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.num_iters < 1 or args.batch_size < 1 or args.output_len < 1:
        parser.error("--num-iters, --batch-size and --output-len must be at least 1")
    return args


if __name__ == "__main__":
    run(parse_args())
