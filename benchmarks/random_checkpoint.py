"""A random checkpoint of a shipped config, written with transformers, for servers that load weights
from disk (transformers serve has no --load-format dummy):

    PYTHONPATH=. python3 benchmarks/random_checkpoint.py --config metrale/model_configs/Qwen3-8B --out /tmp/qwen3-8b

The weights are transformers' own initialisation in --dtype (built on --device, saved as
safetensors). The tokenizer is a word-level one over the whole vocabulary: token i is the word
"t<i>" and text is the words joined by spaces, so a prompt of random token ids decodes to text
that every server encodes back to exactly those ids (`met bench serve --prompt-format text`), and
the config's EOS id is its EOS token.
"""

from __future__ import annotations

import argparse
import time

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def word_tokenizer(vocab_size: int, eos_token_id: int | None):
    """The word-level tokenizer "t0" .. "t<vocab_size - 1>" (transformers' fast tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab=words, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos = f"t{eos_token_id}" if eos_token_id is not None else None
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", eos_token=eos)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a directory with config.json (e.g. a shipped config)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    from transformers import AutoConfig, AutoModelForCausalLM

    t0 = time.time()
    config = AutoConfig.from_pretrained(args.config)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[args.dtype])
    model.save_pretrained(args.out)
    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    word_tokenizer(config.vocab_size, eos).save_pretrained(args.out)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: {config.architectures[0]}, {params / 1e9:.2f} B parameters in {args.dtype}, "
          f"word-level tokenizer of {config.vocab_size} tokens, {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
