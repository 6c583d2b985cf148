"""The scaling table of docs/benchmarks.md from run_multi_gpu.sh's JSON results."""

import glob
import json
import os
import sys


def main(out: str) -> None:
    commit_file = os.path.join(out, "commit.txt")
    commit = open(commit_file).read().strip() if os.path.isfile(commit_file) else "?"
    results = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, "*.json")))]
    print(f"commit {commit}\n")
    print("| workload | layout | met | floor (per GPU) | met / floor |")
    print("|---|---|---|---|---|")
    for r in results:
        layout = f"tp={r.get('tp_size', 1)} ep={r.get('ep_size', 1)} ({r.get('world_size', 1)} GPU)"
        if r["benchmark"] == "latency":
            print(f"| {r['model']} bs{r['batch_size']} decode, {r['input_len']} in / {r['output_len']} out | {layout} "
                  f"| {r['tpot_s'] * 1e3:.2f} ms/token | {r['floor_tpot_s'] * 1e3:.2f} ms "
                  f"| {r['tpot_floor_ratio']:.1%} |")
        elif r["benchmark"] == "throughput":
            print(f"| {r['model']} nano-vllm workload, {r['num_prompts']} req | {layout} "
                  f"| {r['output_tokens_per_s']:,.0f} output tok/s | {r['floor_output_tokens_per_s']:,.0f} tok/s "
                  f"| {r['floor_ratio']:.1%} |")


if __name__ == "__main__":
    main(sys.argv[1])
