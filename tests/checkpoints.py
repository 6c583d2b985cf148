"""Tiny random checkpoints, written by `transformers` itself, for end-to-end tests.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on a few sentences, the
weights are transformers' own random init (float32, a larger init range than usual so greedy
choices are clear-cut rather than near-ties), saved with save_pretrained as safetensors.
"""

from __future__ import annotations

import importlib.util
import inspect
import os

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I am fine, thank you.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Continuous batching lets many requests share each forward pass.",
    "def add(a, b):\n    return a + b\n",
    "Ünïcödé text, emoji 🙂 and CJK 漢字 must survive streaming.",
] * 20

VOCAB_SIZE = 384


def make_tokenizer(path: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3_tied": ("LlamaConfig", "LlamaForCausalLM", {
        "tie_word_embeddings": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64}}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
}


def save_random_model(path: str, config_name: str, model_name: str, fields: dict, seed: int = 0,
                      edit=None, configure=None) -> str:
    """A tokenizer and a randomly initialised transformers model of `fields` saved in `path`:
    `configure(config)` adjusts the config, `edit(model)` the weights, before saving."""
    import transformers

    os.makedirs(path, exist_ok=True)
    tokenizer = make_tokenizer(path)
    fields = dict(fields, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    config = getattr(transformers, config_name)(**fields)
    if configure is not None:
        configure(config)
    config.architectures = [model_name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float().eval()
    if edit is not None:
        with torch.no_grad():
            edit(model)
    model.save_pretrained(path, safe_serialization=True)
    model.generation_config.save_pretrained(path)
    return path


def make_checkpoint(path: str, family: str = "llama", seed: int = 0, **overrides) -> str:
    config_name, model_name, extra = FAMILIES[family]
    fields = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.2, rms_norm_eps=1e-6, tie_word_embeddings=False)
    fields.update(extra)
    fields.update(overrides)
    rope_scaling = fields.pop("rope_scaling", None)

    def configure(config):
        if rope_scaling is not None:
            params = dict(getattr(config, "rope_parameters", None) or {"rope_theta": 10000.0})
            params.update(rope_scaling)
            if hasattr(config, "rope_parameters"):
                config.rope_parameters = params
            else:
                config.rope_scaling = params

    return save_random_model(path, config_name, model_name, fields, seed, configure=configure)


def load_reference(path: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def reference_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation with its own KV cache, never stopping at EOS."""
    # transformers >= 5.2x names the cache argument `cache`; older releases `past_key_values`.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    if torch.cuda.is_available() and importlib.util.find_spec("fla") is not None:
        # transformers' linear-attention families call fla's GPU kernels whenever it is importable
        # and CUDA is there, also for this CPU model: the reference would break or change.
        raise RuntimeError("fla is importable: transformers' CPU reference would run fla's GPU kernels; "
                           "run the tests without fla-core installed")
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    tokens = []
    for _ in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        cache = getattr(out, "cache", None) or out.past_key_values
        out = model(torch.tensor([[token]]), use_cache=True, **{cache_arg: cache})
    return tokens
