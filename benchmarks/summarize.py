"""Turn the GPU suite's JSON results into the markdown table of docs/benchmarks.md."""

import json
import os
import sys


def load(out, name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.isfile(path) else None


def main(out: str) -> None:
    commit = open(os.path.join(out, "commit.txt")).read().strip() if os.path.isfile(os.path.join(out, "commit.txt")) else "?"
    hf_lat, hf_thr = load(out, "hf_latency_qwen3_8b.json"), load(out, "hf_throughput_qwen3_0_6b.json")
    print(f"commit {commit}\n")
    print("| workload | met | floor | met / floor | transformers | met / transformers |")
    print("|---|---|---|---|---|---|")
    for mode in ("async", "sync"):
        print_rows(load(out, f"latency_qwen3_8b_{mode}.json"), load(out, f"throughput_qwen3_0_6b_{mode}.json"),
                   hf_lat, hf_thr, mode)


def print_rows(lat, thr, hf_lat, hf_thr, mode: str) -> None:
    scheduling = "" if mode == "async" else ", --no-async-scheduling"
    if lat:
        hf = f"{hf_lat['tpot_s'] * 1e3:.2f} ms" if hf_lat else "n/a"
        speedup = f"{hf_lat['tpot_s'] / lat['tpot_s']:.1f}x" if hf_lat else "n/a"
        print(f"| Qwen3-8B bs1 decode, 512 in / 128 out ({lat['device']}{scheduling}) | {lat['tpot_s'] * 1e3:.2f} ms/token "
              f"| {lat['floor_tpot_s'] * 1e3:.2f} ms | {lat['tpot_floor_ratio']:.1%} | {hf} | {speedup} |")
        hf = f"{hf_lat['ttft_s'] * 1e3:.1f} ms" if hf_lat else "n/a"
        print(f"| Qwen3-8B bs1 time to first token, 512 in{scheduling} | {lat['ttft_s'] * 1e3:.1f} ms "
              f"| {lat['floor_ttft_s'] * 1e3:.1f} ms | {lat['floor_ttft_s'] / lat['ttft_s']:.1%} | {hf} | |")
    if thr:
        hf = f"{hf_thr['output_tokens_per_s']:.0f} tok/s ({hf_thr['num_prompts']} req x {hf_thr['max_new_tokens']})" \
            if hf_thr else "n/a"
        speedup = f"{thr['output_tokens_per_s'] / hf_thr['output_tokens_per_s']:.1f}x" if hf_thr else "n/a"
        print(f"| Qwen3-0.6B nano-vllm workload, 256 req{scheduling} | {thr['output_tokens_per_s']:.0f} output tok/s "
              f"| {thr['floor_output_tokens_per_s']:.0f} tok/s | {thr['floor_ratio']:.1%} | {hf} | {speedup} |")


if __name__ == "__main__":
    main(sys.argv[1])
