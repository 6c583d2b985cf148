"""A tiny Llama checkpoint whose greedy output is known in advance: a script of texts.

Random models never write tool calls by themselves, so the server's tool and reasoning plumbing is
tested with a model built to write them. Each text of the script is an added token of the
tokenizer (not special, so it decodes as text, as Qwen's `<tool_call>` and `<think>` do), and the
model is a bigram table: every layer's output projections are zero, so the residual stream is the
embedding of the last token, and the LM head maps each token of the script to the next one. The
model then writes, after a prompt that ends with a trigger text, the script that follows it, then
its end-of-sequence token; nothing in the server knows.
"""

from __future__ import annotations

import os

import torch

from checkpoints import make_tokenizer

# Qwen3's chat format (tools in the system turn, calls as <tool_call> JSON, results in a user turn
# as <tool_response>, `enable_thinking: false` closing an empty <think> in the generation prompt),
# written here for these tests.
QWEN3_STYLE_TEMPLATE = (
    # Every newline that follows a tag is written as {{ NL }}: transformers renders with trim_blocks,
    # which drops a newline right after a block tag.
    "{% set NL = '\\n' %}"
    "{% if tools %}<|im_start|>system{{ NL }}"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{{ NL }}{{ NL }}{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ NL }}{{ tool | tojson }}{% endfor %}{{ NL }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
    "</tool_call><|im_end|>{{ NL }}"
    "{% elif messages[0].role == 'system' %}<|im_start|>system{{ NL }}{{ messages[0].content }}<|im_end|>{{ NL }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ message.role }}{{ NL }}{{ message.content }}<|im_end|>{{ NL }}"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant{{ NL }}"
    "{% if message.reasoning_content %}<think>{{ NL }}{{ message.reasoning_content }}{{ NL }}</think>{{ NL }}{{ NL }}"
    "{% endif %}{{ message.content }}"
    "{% for call in message.tool_calls or [] %}{% if message.content or not loop.first %}{{ NL }}{% endif %}"
    "<tool_call>{{ NL }}{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments if call.function.arguments is string else call.function.arguments | tojson }}}"
    "{{ NL }}</tool_call>{% endfor %}<|im_end|>{{ NL }}"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ NL }}<tool_response>{{ NL }}{{ message.content }}{{ NL }}</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ NL }}{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ NL }}"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>{{ NL }}{{ NL }}</think>{{ NL }}{{ NL }}"
    "{% endif %}{% endif %}")

EDGE_LOGIT = 30.0


def make_scripted_checkpoint(path: str, scripts: dict[str, list[str]], chat_template: str) -> str:
    """`scripts`: trigger text -> the texts the model writes after a prompt ending with it. Texts
    may be shared between scripts only where what follows them is the same."""
    import transformers
    from tokenizers import AddedToken

    os.makedirs(path, exist_ok=True)
    tokenizer = make_tokenizer(path)
    pieces = list(dict.fromkeys(t for script in scripts.values() for t in script))
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in pieces])
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(path)

    successor: dict[int, int] = {}
    for trigger, script in scripts.items():
        chain = [tokenizer.encode(trigger, add_special_tokens=False)[-1]]
        chain += [tokenizer.convert_tokens_to_ids(t) for t in script] + [tokenizer.eos_token_id]
        for a, b in zip(chain, chain[1:]):
            if successor.setdefault(a, b) != b:
                raise ValueError(f"token {tokenizer.convert_ids_to_tokens(a)!r} is followed by two different texts")

    hidden = 64
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                      bos_token_id=None)
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:  # every block adds nothing: the residual is the embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        # Orthonormal embeddings (RMS 1) for the tokens that have a successor, so each one's
        # normalised embedding scores exactly EDGE_LOGIT for its successor and 0 for every other token.
        sources = sorted(successor)
        basis, _ = torch.linalg.qr(torch.randn(hidden, hidden))
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        for row, token in enumerate(sources):
            embed[token] = basis[:, row] * hidden ** 0.5
            head[successor[token]] += EDGE_LOGIT * basis[:, row] / hidden ** 0.5
    model.save_pretrained(path, safe_serialization=True)
    model.generation_config.save_pretrained(path)
    return path
