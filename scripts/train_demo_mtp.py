#!/usr/bin/env python3
"""Train the multi-token-prediction (MTP) layer of met's demo model, the trunk frozen, on the CPU.

The layer is met's dense-family MTP layout (models/qwen_mtp.py, docs/speculative.md), the shape
of Qwen3-Next's published `mtp.*` layer with the Llama trunk's own RMSNorm and decoder layer:

    x_p   = mtp.fc([mtp.pre_fc_norm_embedding(embed(t_{p+1})), mtp.pre_fc_norm_hidden(h_p)])
    out_p = mtp.norm(mtp.layers.0(x_0..x_p at positions 0..p))       (causal, RoPE at position p)
    logits of t_{p+2} = the trunk's (tied) LM head over out_p

with h_p the trunk's final hidden state (after its final norm) at position p. The loss is the
cross entropy of t_{p+2}; the trunk, its embedding and its head are frozen. Data: the demo's own
corpus, built by scripts/train_demo_model.py's `build_corpus` from the Python installation that
runs this, tokenized with the shipped tokenizer; sequences start at a conversation's or a
document's start, 60% chat, as the trunk was trained. The decoder layer starts as a copy of the
trunk's last layer, fc as [0 | I] (so the layer first sees h_p alone) plus noise.

Usage (one thread, as the demo's MTP weights were trained; the wall-clock budget fixes the step
count after a short calibration, `--steps N` replays a run)::

    python3 scripts/train_demo_mtp.py --out /tmp/demo_mtp --minutes 17

Writes to --out: mtp.safetensors (bfloat16, the `mtp.*` tensors met loads beside
model.safetensors), mtp_loss.csv (loss and top-1 accuracy of t_{p+2} on the training batches) and
mtp_loss.png; the log goes to stdout.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "metrale" / "demo_model"


def build_sequences(seed: int):
    """The demo corpus as token streams: (chat ids, chat starts, plain ids, plain starts)."""
    import torch
    from transformers import PreTrainedTokenizerFast

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from train_demo_model import ENDOFTEXT, build_corpus  # noqa: E402 (scripts/ is not a package)

    docs, chats, stats = build_corpus(seed)
    print("corpus:", json.dumps(stats), flush=True)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(DEMO / "tokenizer.json"))
    eot = tok.convert_tokens_to_ids(ENDOFTEXT)

    def stream(texts):
        ids, starts = [], []
        for enc in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
            starts.append(len(ids))
            ids.extend(enc.ids)
            ids.append(eot)
        return torch.tensor(ids, dtype=torch.long), torch.tensor(starts, dtype=torch.long)

    return stream(chats) + stream(docs)


class MTPLayer:
    """The trainable parts, as plain modules under met's checkpoint names (`state_dict`)."""

    def __init__(self, trunk):
        import copy

        import torch
        from torch import nn
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        config = trunk.config
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.modules = nn.ModuleDict({
            "pre_fc_norm_embedding": LlamaRMSNorm(hidden, eps), "pre_fc_norm_hidden": LlamaRMSNorm(hidden, eps),
            "fc": nn.Linear(2 * hidden, hidden, bias=False), "norm": LlamaRMSNorm(hidden, eps)})
        block = copy.deepcopy(trunk.model.layers[-1])
        block.self_attn.layer_idx = config.num_hidden_layers
        self.modules["layers"] = nn.ModuleList([block])
        with torch.no_grad():
            fc = self.modules["fc"].weight
            fc.normal_(0.0, 0.01)
            fc[:, hidden:] += torch.eye(hidden)
        for p in self.modules.parameters():
            p.requires_grad_(True)
        self.trunk = trunk

    def logits(self, input_ids):
        """Logits of t_{p+2} for every p < L - 1 of input_ids [B, L] (the last has no t_{p+1})."""
        import torch

        trunk = self.trunk.model
        with torch.no_grad():
            hidden = trunk(input_ids=input_ids, use_cache=False).last_hidden_state[:, :-1]
            embedding = trunk.embed_tokens(input_ids[:, 1:])
        m = self.modules
        x = m["fc"](torch.cat([m["pre_fc_norm_embedding"](embedding), m["pre_fc_norm_hidden"](hidden)], dim=-1))
        positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
        rope = trunk.rotary_emb(x, positions)
        out = m["layers"][0](x, attention_mask=None, position_ids=positions, position_embeddings=rope)
        return self.trunk.lm_head(m["norm"](out))

    def state_dict(self) -> dict:
        return {f"mtp.{name}": t.detach() for name, t in self.modules.state_dict().items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=17.0, help="wall-clock training budget (default 17)")
    ap.add_argument("--steps", type=int, default=0, help="exact number of steps (overrides --minutes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--chat-fraction", type=float, default=0.6)
    ap.add_argument("--calib-steps", type=int, default=20)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    t_start = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, {args.threads} thread(s), python {sys.version.split()[0]}", flush=True)
    chat_ids, chat_starts, plain_ids, plain_starts = build_sequences(args.seed)
    print(f"tokens: chat {chat_ids.numel():,}, plain {plain_ids.numel():,}", flush=True)
    L = args.seq_len + 1
    chat_starts = chat_starts[chat_starts <= chat_ids.numel() - L]
    plain_starts = plain_starts[plain_starts <= plain_ids.numel() - L]
    gen = torch.Generator().manual_seed(args.seed)
    offsets = torch.arange(L)

    def get_batch():
        n_chat = int(round(args.batch_size * args.chat_fraction))
        c = chat_starts[torch.randint(len(chat_starts), (n_chat,), generator=gen)]
        p = plain_starts[torch.randint(len(plain_starts), (args.batch_size - n_chat,), generator=gen)]
        return torch.cat([chat_ids[c[:, None] + offsets], plain_ids[p[:, None] + offsets]])

    trunk = AutoModelForCausalLM.from_pretrained(str(DEMO), dtype=torch.float32).eval()
    trunk.config._attn_implementation = "sdpa"
    for p in trunk.parameters():
        p.requires_grad_(False)
    mtp = MTPLayer(trunk)
    params = list(mtp.modules.parameters())
    print(f"MTP layer: {sum(p.numel() for p in params):,} parameters", flush=True)
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    total_steps = args.steps or None

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        prog = min(1.0, (step - args.warmup) / max(1, (total_steps or 10 ** 9) - args.warmup))
        return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog)))

    rows, acc_loss, acc_hit, acc_n = [], 0.0, 0.0, 0
    t_train, t_calib, step = time.time(), 0.0, 0
    calib_start = 5
    while total_steps is None or step < total_steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        batch = get_batch()
        logits = mtp.logits(batch)[:, :-1]  # position p predicts t_{p+2}: p < L - 2
        targets = batch[:, 2:]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        acc_loss += loss.item()
        acc_hit += float((logits.argmax(-1) == targets).float().mean())
        acc_n += 1
        if total_steps is None and step == calib_start:
            t_calib = time.time()
        if total_steps is None and step == calib_start + args.calib_steps:
            per_step = (time.time() - t_calib) / args.calib_steps
            left = args.minutes * 60 - (time.time() - t_start)
            total_steps = max(step + 1, step + int(left / per_step))
            print(f"calibration: {per_step * 1000:.0f} ms/step -> {total_steps} steps "
                  f"(reproduce with --steps {total_steps})", flush=True)
        if step % args.log_every == 0:
            row = (step, step * args.batch_size * args.seq_len, time.time() - t_train, lr_at(step - 1),
                   acc_loss / acc_n, acc_hit / acc_n)
            rows.append(row)
            acc_loss, acc_hit, acc_n = 0.0, 0.0, 0
            print(f"step {row[0]:5d}  tokens {row[1] / 1e6:6.2f}M  {row[2]:5.0f}s  lr {row[3]:.2e}  "
                  f"loss {row[4]:.4f}  top-1 {row[5]:.3f}", flush=True)
    print(f"trained {step} steps ({step * args.batch_size * args.seq_len / 1e6:.2f}M tokens) in "
          f"{time.time() - t_train:.0f}s", flush=True)

    tensors = {name: t.to(torch.bfloat16).contiguous() for name, t in mtp.state_dict().items()}
    save_file(tensors, str(out / "mtp.safetensors"), metadata={"format": "pt"})
    with open(out / "mtp_loss.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "tokens", "elapsed_s", "lr", "loss", "top1"])
        for r in rows:
            w.writerow([r[0], r[1], f"{r[2]:.1f}", f"{r[3]:.6g}", f"{r[4]:.5f}", f"{r[5]:.4f}"])
    from train_demo_model import plot_loss

    if rows:
        plot_loss(out / "mtp_loss.png", [r[0] for r in rows], [r[4] for r in rows],
                  f"met demo model's MTP layer: {step} steps, final loss {rows[-1][4]:.3f}")
    size = os.path.getsize(out / "mtp.safetensors")
    print(f"wrote {len(tensors)} tensors, mtp.safetensors {size / 1e6:.2f} MB; total {time.time() - t_start:.0f}s",
          flush=True)


if __name__ == "__main__":
    main()
