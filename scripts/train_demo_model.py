#!/usr/bin/env python3
"""Train met's small built-in demo model (the one ``met serve`` uses when no model is given).

The model is a tiny Llama (``LlamaForCausalLM``, about 5.8M parameters, ~11 MB in bfloat16)
trained from scratch on text that ships with every CPython installation, so the whole thing
runs offline:

* ``pydoc_data.topics.topics``: the language reference topics that ``help()`` shows;
* the docstrings of the standard library's modules, classes and functions (read with ``ast``
  from the stdlib sources, nothing is imported).

From that text it builds (a) plain documents and (b) synthetic ChatML conversations
("What is the assert statement?" -> the first paragraphs of that topic, "What does
json.dumps do?" -> its docstring, a few greetings, ...) so the model learns the chat format.
A byte-level BPE tokenizer (vocab 4096) is trained on the same text.

Usage (GPU; the wall-clock budget fixes the number of steps after a short calibration,
``--steps N`` reproduces a run exactly)::

    python3 scripts/train_demo_model.py --out DIR --minutes 6

Dry run on a CPU::

    python3 scripts/train_demo_model.py --out /tmp/demo --minutes 0.5 --hidden 64 --layers 2 \
        --heads 4 --kv-heads 2 --intermediate 192 --batch-size 8 --seq-len 128 --warmup 40

Writes to ``--out``: config.json, generation_config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, loss.csv and loss.png.

Needs only PyTorch, ``transformers`` and ``tokenizers`` (matplotlib is used for loss.png when
present; otherwise a plain built-in PNG writer draws the curve).
"""

from __future__ import annotations

import argparse
import ast
import csv
import json
import math
import os
import random
import re
import struct
import sys
import sysconfig
import time
import zlib
from pathlib import Path

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are met's demo model, a small assistant trained on Python's documentation.",
    "You are a concise assistant that answers questions about Python.",
]


def render_chat(messages: list[dict[str, str]]) -> str:
    """Python twin of CHAT_TEMPLATE (checked against the jinja template at run time)."""
    return "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)


# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------

_UNDERLINE = re.compile(r"^([*=\-~^\"#+])\1{2,}$")
_SKIP_PARA = ("New in version", "Changed in version", "Added in version", "Deprecated since",
              "**Source code:**", "See also", "Note:", "Notes:", "Availability:")


def _is_indented(para: str) -> bool:
    return para.startswith((" ", "\t", ">>>"))


def _is_list_like(para: str) -> bool:
    return any(re.match(r"^\s*([*\-+]|\d+\.|\(\d+\))\s", ln) for ln in para.splitlines())


def _unwrap(para: str) -> str:
    """Join the hard-wrapped lines of a prose paragraph; leave code and lists alone."""
    if _is_indented(para) or _is_list_like(para):
        return para.rstrip()
    return re.sub(r"\s+", " ", para).strip()


def _paragraphs(text: str) -> list[str]:
    return [p.rstrip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def split_sections(text: str) -> list[tuple[str, str]]:
    """Split an RST-ish text (title lines underlined with ***, ===, ---) into (title, body)."""
    lines = text.splitlines()
    sections: list[tuple[str, list[str]]] = [("", [])]
    i = 0
    while i < len(lines):
        ln = lines[i]
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if ln.strip() and not ln.startswith(" ") and _UNDERLINE.match(nxt.strip()) \
                and len(nxt.strip()) >= len(ln.strip()) - 2:
            sections.append((ln.strip(), []))
            i += 2
            continue
        sections[-1][1].append(ln)
        i += 1
    return [(t, "\n".join(b).strip()) for t, b in sections if "\n".join(b).strip()]


def clean_doc(text: str) -> str:
    """Plain-text version of a documentation text: header underlines dropped, prose unwrapped."""
    out = []
    for title, body in split_sections(text):
        if title:
            out.append(title)
        out.extend(_unwrap(p) for p in _paragraphs(body))
    return "\n\n".join(out)


def answer_from(body: str, target: int, hard_cap: int) -> str | None:
    """The first paragraph(s) of a text: leading grammar/code/notes skipped, ~target chars."""
    paras = _paragraphs(body)
    while paras and (_is_indented(paras[0]) or paras[0].lstrip().startswith(_SKIP_PARA)
                     or len(paras[0]) < 25):
        paras.pop(0)
    if not paras:
        return None
    out: list[str] = []
    total = 0
    for p in paras:
        p = _unwrap(p)
        if p.lstrip().startswith(_SKIP_PARA):
            continue
        if out and total + len(p) > hard_cap:
            break
        out.append(p)
        total += len(p) + 2
        if total >= target:
            break
    ans = "\n\n".join(out)
    if len(ans) > hard_cap:  # one very long first paragraph: cut at a sentence end
        cut = ans.rfind(". ", 0, hard_cap)
        ans = ans[: cut + 1] if cut > 80 else ans[:hard_cap].rsplit(" ", 1)[0] + " ..."
    return ans.strip() or None


_KEEP_CASE = {"Python", "None", "Unicode", "C", "ASCII", "I/O", "Ellipsis"}
_TOPIC_NAMES = {  # readable names where the title does not make a good one
    "debugger": "the Python debugger pdb",
    "atom-identifiers": "identifiers (names)",
    "else": "the else clause",
    "in": "membership test operations",
    "typesmapping": "the dict type",
    "typesseq": "sequence types (list, tuple, range)",
    "bltin-null-object": "the None object",
    "bltin-ellipsis-object": "the Ellipsis object",
}


def readable(title: str) -> str:
    """'The "assert" statement' -> 'the assert statement'."""
    t = title.replace('"', "").replace("“", "").replace("”", "").strip()
    words = []
    for w in t.split():
        core = w.strip("(),.:")
        if core in _KEEP_CASE or (core[1:] and any(c.isupper() for c in core[1:])) or "." in core \
                or "_" in core:
            words.append(w)
        else:
            words.append(w.lower())
    return " ".join(words)


def _is_plural(name: str) -> bool:
    last = re.sub(r"\(.*?\)", "", name).split()[-1] if name.split() else name
    return last.endswith("s") and not last.endswith(("ss", "us", "is")) and not name.startswith("the ")


def topic_questions(name: str, rng: random.Random, keyword: str | None) -> list[str]:
    be = "are" if _is_plural(name) else "is"
    qs = [
        f"What {be} {name}?",
        f"What {be} {name} in Python?",
        f"Tell me about {name}.",
        f"Explain {name}.",
        f"Can you explain {name}?",
        f"How do {name} work?" if be == "are" else f"How does {name} work?",
        f"Describe {name} in Python.",
        f"What does the Python documentation say about {name}?",
        f"I have a question about {name}. What {be} they?" if be == "are"
        else f"I have a question about {name}. What is it?",
    ]
    if keyword:
        qs += [
            f"What does the {keyword} keyword do?",
            f"How do I use {keyword} in Python?",
            f"What is {keyword} in Python?",
            f"Explain the {keyword} statement.",
        ]
    rng.shuffle(qs)
    return qs


KEYWORD_TOPICS = {"assert", "async", "await", "break", "class", "continue", "del", "else", "for",
                  "global", "if", "import", "in", "lambda", "nonlocal", "pass", "raise", "return",
                  "try", "while", "with", "yield"}


def stdlib_docstrings() -> list[tuple[str, str, str]]:
    """(kind, qualified name, docstring) for the stdlib's public modules, classes, functions."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip_dirs = {"test", "tests", "site-packages", "dist-packages", "idlelib", "lib2to3",
                 "turtledemo", "ensurepip", "__pycache__", "__phello__", "pydoc_data"}
    out: list[tuple[str, str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs and not d.startswith((".", "config-")))
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            rel = Path(dirpath, fn).relative_to(root).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if not parts or any(p.startswith("_") for p in parts) or any("-" in p for p in parts):
                continue
            modname = ".".join(parts)
            try:
                tree = ast.parse(Path(dirpath, fn).read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            doc = ast.get_docstring(tree)
            if doc:
                out.append(("module", modname, doc))

            def visit(node: ast.AST, prefix: str, depth: int) -> None:
                for child in getattr(node, "body", []):
                    if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                        if child.name.startswith("_"):
                            continue
                        qn = f"{prefix}.{child.name}"
                        d = ast.get_docstring(child)
                        if d:
                            kind = "class" if isinstance(child, ast.ClassDef) else (
                                "method" if depth else "function")
                            out.append((kind, qn, d))
                        if isinstance(child, ast.ClassDef) and depth == 0:
                            visit(child, qn, depth + 1)

            visit(tree, modname, 0)
    return out


def docstring_questions(kind: str, name: str) -> list[str]:
    if kind == "module":
        return [f"What is the {name} module?", f"What does the {name} module do?",
                f"Tell me about the {name} module.", f"What is {name} used for in Python?"]
    if kind == "class":
        return [f"What is {name}?", f"What is the {name} class?", f"Explain {name}.",
                f"What does the {name} class do?"]
    return [f"What does {name} do?", f"What does {name}() do?", f"Explain {name}.",
            f"How do I use {name}?"]


GREETING_PROMPTS = ["Hello", "Hello!", "hello", "Hi", "Hi!", "hi", "Hi there", "Hey", "Hey there!",
                    "Good morning", "Good afternoon", "Good evening", "Greetings", "Hello, who are you?",
                    "Who are you?", "What are you?", "What is your name?", "Introduce yourself.",
                    "How are you?", "What can you do?", "Hi, what can you do?", "Are you a chatbot?"]
GREETING_REPLIES = [
    "Hello! I am met's demo model, a small language model trained on Python's documentation. "
    "Ask me about Python, for example: What is the assert statement?",
    "Hi! I'm the demo model that comes with met. I was trained only on Python's documentation, "
    "so I can tell you about Python's statements, types and standard library modules.",
    "Hello! I am a tiny demo model served by met. I learned from Python's documentation, so try "
    "asking me something like \"What is a list comprehension?\" or \"What does the json module do?\"",
    "Hi there! I'm met's built-in demo model. I am very small and I only know what Python's "
    "documentation taught me, but I am happy to answer questions about Python.",
]
SMALLTALK = [
    (["Thanks", "Thank you", "Thank you!", "thanks!", "Thanks a lot"],
     ["You're welcome! Ask me anything else about Python.",
      "You are welcome. I am happy to help with more questions about Python."]),
    (["Bye", "Goodbye", "See you", "bye!"],
     ["Goodbye! Thank you for trying met's demo model.",
      "Bye! Come back any time you have a question about Python."]),
    (["What is met?", "What is this?"],
     ["met is an inference engine for language models. I am its small built-in demo model, trained on "
      "Python's documentation, so that met can serve something without downloading a model.",
      "This is met, an engine that serves language models. I am the tiny demo model that ships with it; "
      "I was trained on Python's documentation."]),
    (["What is Python?", "Tell me about Python."],
     ["Python is an easy to learn, powerful programming language. It has efficient high-level data "
      "structures and a simple but effective approach to object-oriented programming. Its elegant "
      "syntax and dynamic typing make it a good language for scripting and rapid application development.",
      "Python is a high-level, general-purpose programming language. Its design emphasizes code "
      "readability, it is dynamically typed, and it comes with a large standard library."]),
]


def build_corpus(seed: int) -> tuple[list[str], list[str], dict]:
    """Returns (plain documents, chat conversations rendered as ChatML, stats)."""
    import pydoc_data.topics

    rng = random.Random(seed)
    docs: list[str] = []
    qa: list[tuple[str, str]] = []  # (question, answer) pairs

    topics = pydoc_data.topics.topics
    for key in sorted(topics):
        text = topics[key]
        docs.append(clean_doc(text))
        sections = split_sections(text)
        for idx, (title, body) in enumerate(sections):
            if not title:
                continue
            ans = answer_from(body, target=700, hard_cap=1200)
            if not ans:
                continue
            if idx <= 1:  # the topic's own title
                name = _TOPIC_NAMES.get(key, readable(title))
                qs = topic_questions(name, rng, key if key in KEYWORD_TOPICS else None)
            else:
                name = readable(title)
                qs = topic_questions(name, rng, None)[:4]
            qa.extend((q, ans) for q in qs)
    n_topic_qa = len(qa)

    n_doc = 0
    for kind, name, doc in stdlib_docstrings():
        docs.append(f"{name}\n\n{clean_doc(doc)}")
        n_doc += 1
        ans = answer_from(doc, target=500, hard_cap=900)
        if not ans or len(ans) < 40:
            continue
        qs = docstring_questions(kind, name)
        k = 3 if kind == "module" else 1
        qa.extend((q, ans) for q in rng.sample(qs, k))
    n_doc_qa = len(qa) - n_topic_qa

    # Conversations: single Q&A turns, some multi-turn, some with a system prompt, plus greetings.
    rng.shuffle(qa)
    convs: list[list[dict[str, str]]] = []
    i = 0
    while i < len(qa):
        turns = 1 if rng.random() < 0.8 else rng.choice([2, 3])
        msgs: list[dict[str, str]] = []
        if rng.random() < 0.25:
            msgs.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        for q, a in qa[i:i + turns]:
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        i += turns
        convs.append(msgs)
    n_greet = 0
    for _ in range(12):
        for p in GREETING_PROMPTS:
            msgs = []
            if rng.random() < 0.25:
                msgs.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
            msgs += [{"role": "user", "content": p}, {"role": "assistant", "content": rng.choice(GREETING_REPLIES)}]
            if rng.random() < 0.3:  # greeting followed by a real question
                q, a = rng.choice(qa)
                msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            convs.append(msgs)
            n_greet += 1
        for prompts, replies in SMALLTALK:
            for p in prompts:
                convs.append([{"role": "user", "content": p}, {"role": "assistant", "content": rng.choice(replies)}])
                n_greet += 1
    rng.shuffle(convs)
    chats = [render_chat(m) for m in convs]
    stats = {"topics": len(topics), "docstrings": n_doc, "topic_qa": n_topic_qa, "docstring_qa": n_doc_qa,
             "greeting_convs": n_greet, "conversations": len(chats),
             "plain_chars": sum(map(len, docs)), "chat_chars": sum(map(len, chats)),
             "python": sys.version.split()[0]}
    return docs, chats, stats


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=ENDOFTEXT,
                                 model_max_length=2048, clean_up_tokenization_spaces=False)
    hf.chat_template = CHAT_TEMPLATE
    return hf


# --------------------------------------------------------------------------------------------
# Loss plot (matplotlib when present, else a tiny built-in PNG writer)
# --------------------------------------------------------------------------------------------

_FONT = {  # 3x5 bitmap glyphs for the fallback plot's labels
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001010010010",
    "8": "111101111101111", "9": "111101111001111", ".": "000000000000010", " ": "000000000000000",
    "l": "100100100100111", "o": "000111101101111", "s": "000111110011111", "t": "010111010010011",
    "e": "000111111100111", "p": "000111101111100", "=": "000111000111000", ":": "000010000010000",
}


def _png_plot(path: Path, xs: list[float], ys: list[float], title: str) -> None:
    W, H, L, R, T, B = 800, 450, 60, 20, 30, 40
    img = [[(255, 255, 255)] * W for _ in range(H)]

    def px(x, y, c):
        if 0 <= x < W and 0 <= y < H:
            img[y][x] = c

    def line(x0, y0, x1, y1, c):
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        for k in range(n + 1):
            px(round(x0 + (x1 - x0) * k / n), round(y0 + (y1 - y0) * k / n), c)

    def text(x, y, s, c=(0, 0, 0), sc=2):
        for ch in s:
            g = _FONT.get(ch, _FONT[" "])
            for r in range(5):
                for q in range(3):
                    if g[r * 3 + q] == "1":
                        for a in range(sc):
                            for b in range(sc):
                                px(x + q * sc + a, y + r * sc + b, c)
            x += 4 * sc

    y0, y1 = min(ys), max(ys)
    y1 = y0 + 1e-6 if y1 == y0 else y1
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    sx = lambda v: L + round((v - x0) / (x1 - x0) * (W - L - R))  # noqa: E731
    sy = lambda v: H - B - round((v - y0) / (y1 - y0) * (H - T - B))  # noqa: E731
    for k in range(5):  # grid and y labels
        v = y0 + (y1 - y0) * k / 4
        line(L, sy(v), W - R, sy(v), (225, 225, 225))
        text(4, sy(v) - 5, f"{v:.2f}")
    line(L, H - B, W - R, H - B, (0, 0, 0))
    line(L, T, L, H - B, (0, 0, 0))
    text(L, H - B + 10, f"{x0:.0f}")
    text(W - R - 60, H - B + 10, f"{x1:.0f}")
    text(W // 2 - 40, H - B + 22, "step")
    text(L + 10, 8, title)
    for (a, b), (c, d) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        line(sx(a), sy(b), sx(c), sy(d), (31, 119, 180))
    raw = b"".join(b"\x00" + bytes(v for p in row for v in p) for row in img)

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", W, H, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def plot_loss(path: Path, steps: list[int], losses: list[float], title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _png_plot(path, steps, losses, "loss")
        return
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    ax.plot(steps, losses, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory (Hugging Face model folder)")
    ap.add_argument("--minutes", type=float, default=6.0, help="wall-clock training budget (default 6)")
    ap.add_argument("--steps", type=int, default=0, help="exact number of steps (overrides --minutes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--chat-fraction", type=float, default=0.6, help="share of sequences drawn from the chat data")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--calib-steps", type=int, default=100, help="steps timed to turn --minutes into a step count")
    args = ap.parse_args()

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    t_start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}",
          flush=True)

    # ---- data ----
    docs, chats, stats = build_corpus(args.seed)
    print("corpus:", json.dumps(stats), flush=True)
    tok = train_tokenizer(docs + chats, args.vocab_size)
    probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    assert tok.apply_chat_template(probe, tokenize=False) == render_chat(probe), "chat template mismatch"
    eot, im_end = tok.convert_tokens_to_ids(ENDOFTEXT), tok.convert_tokens_to_ids(IM_END)

    def encode_stream(texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        ids: list[int] = []
        starts: list[int] = []
        for enc in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
            starts.append(len(ids))
            ids.extend(enc.ids)
            ids.append(eot)
        return torch.tensor(ids, dtype=torch.long), torch.tensor(starts, dtype=torch.long)

    plain_ids, plain_starts = encode_stream(docs)
    chat_ids, chat_starts = encode_stream(chats)
    print(f"tokens: plain {plain_ids.numel():,}, chat {chat_ids.numel():,} "
          f"({(sum(map(len, docs)) + sum(map(len, chats))) / (plain_ids.numel() + chat_ids.numel()):.2f} chars/token)",
          flush=True)
    L = args.seq_len + 1
    # sequences start at document / conversation starts (as prompts do at inference), then run on
    plain_starts = plain_starts[plain_starts <= plain_ids.numel() - L]
    chat_starts = chat_starts[chat_starts <= chat_ids.numel() - L]
    gen = torch.Generator().manual_seed(args.seed)
    offs = torch.arange(L)

    def get_batch() -> torch.Tensor:
        n_chat = int(round(args.batch_size * args.chat_fraction))
        c = chat_starts[torch.randint(len(chat_starts), (n_chat,), generator=gen)]
        p = plain_starts[torch.randint(len(plain_starts), (args.batch_size - n_chat,), generator=gen)]
        return torch.cat([chat_ids[c[:, None] + offs], plain_ids[p[:, None] + offs]]).to(dev, non_blocking=True)

    # ---- model ----
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5, hidden_act="silu",
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=im_end, pad_token_id=eot,
        initializer_range=0.02, attention_bias=False, mlp_bias=False,
    )
    model = LlamaForCausalLM(config).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters", flush=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev.type == "cuda")
    total_steps = args.steps if args.steps > 0 else None

    def lr_at(step: int) -> float:  # linear warmup, then cosine to min_lr_ratio * lr
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        T = total_steps or (10 ** 9)
        prog = min(1.0, (step - args.warmup) / max(1, T - args.warmup))
        return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog)))

    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    model.train()
    log_rows: list[tuple[int, int, float, float, float]] = []
    acc, acc_n = 0.0, 0
    t_train = time.time()
    t_calib = 0.0
    # The step count for --minutes is fixed from steps timed inside the warm-up, whose learning
    # rate does not depend on it, so `--steps N` with the printed N replays the same run.
    calib_start = min(50, args.warmup // 4)
    if total_steps is None and calib_start + args.calib_steps > args.warmup:
        print("warning: calibration ends after the warm-up; --steps will not replay this run exactly")
    step = 0
    while total_steps is None or step < total_steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        batch = get_batch()
        with amp:
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                                     batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        acc = acc + loss.detach()  # stays on the device: no sync per step
        acc_n += 1
        if total_steps is None and step == calib_start:  # time steps after the start-up costs
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t_calib = time.time()
        if total_steps is None and step == calib_start + args.calib_steps:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.time() - t_calib) / args.calib_steps
            left = args.minutes * 60 - (time.time() - t_train)
            total_steps = max(step + 1, step + int(left / per_step))
            if total_steps <= args.warmup:
                print("warning: the budget ends inside the warm-up", flush=True)
            print(f"calibration: {per_step * 1000:.1f} ms/step -> {total_steps} steps in total "
                  f"(reproduce with --steps {total_steps})", flush=True)
        if step % args.log_every == 0 and acc_n:
            row = (step, step * args.batch_size * args.seq_len, time.time() - t_train, lr_at(step - 1), float(acc) / acc_n)
            log_rows.append(row)
            acc, acc_n = 0.0, 0
            if step % (args.log_every * 10) == 0 or step == args.log_every:
                print(f"step {row[0]:6d}  tokens {row[1] / 1e6:8.1f}M  {row[2]:6.0f}s  lr {row[3]:.2e}  loss {row[4]:.4f}",
                      flush=True)
    train_s = time.time() - t_train
    final_loss = log_rows[-1][4] if log_rows else float(loss.item())
    print(f"trained {step} steps ({step * args.batch_size * args.seq_len / 1e6:.1f}M tokens) in {train_s:.0f}s, "
          f"final loss {final_loss:.4f}", flush=True)

    # ---- save ----
    model.eval()
    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(eos_token_id=im_end, pad_token_id=eot, bos_token_id=None)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    # Portability across transformers 4.x / 5.x: chat template inside tokenizer_config.json, the
    # generic tokenizer class name, rope_theta and torch_dtype spelled out in config.json.
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["chat_template"] = CHAT_TEMPLATE
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    for extra in ("chat_template.jinja", "special_tokens_map.json"):
        if (out / extra).exists():
            (out / extra).unlink()
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("rope_theta", 10000.0)
    cfg["torch_dtype"] = "bfloat16"
    cfg["dtype"] = "bfloat16"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    with open(out / "loss.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "tokens", "elapsed_s", "lr", "loss"])
        for r in log_rows:
            w.writerow([r[0], r[1], f"{r[2]:.1f}", f"{r[3]:.6g}", f"{r[4]:.5f}"])
    if log_rows:
        plot_loss(out / "loss.png", [r[0] for r in log_rows], [r[4] for r in log_rows],
                  f"met demo model: {n_params / 1e6:.2f}M params, {step} steps, final loss {final_loss:.3f}")

    # ---- samples ----
    for prompt in ["What is the assert statement?", "Hello", "What does the json module do?"]:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(dev)
        with torch.no_grad():
            gen_ids = model.generate(ids, max_new_tokens=160, do_sample=False)
        print(f"\n>>> {prompt}\n{tok.decode(gen_ids[0, ids.shape[1]:])}", flush=True)
    files = sorted(p.name for p in out.iterdir())
    size = (out / "model.safetensors").stat().st_size
    print(f"\nwrote {files}; model.safetensors {size / 1e6:.2f} MB; total time {time.time() - t_start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
