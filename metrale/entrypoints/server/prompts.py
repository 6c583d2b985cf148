"""The HTTP side's tokenizer: chat templates, tokenize, detokenize.

The engine thread owns the engine's tokenizer (detokenization of outputs); the server loads a
second copy from the same directory, so the two threads never share a tokenizer object. Its
work runs on one worker thread, which keeps long prompts off the event loop and the tokenizer
single-threaded.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from metrale.entrypoints.server.errors import bad_request
from metrale.entrypoints.server.protocol import ChatMessage


def messages_for_template(messages: list[ChatMessage]) -> list[dict]:
    """OpenAI messages -> the plain dicts a chat template reads; text parts are joined."""
    rendered = []
    for i, message in enumerate(messages):
        if message.role == "tool":
            raise bad_request("tool messages are not supported yet", f"messages[{i}].role")
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise bad_request(f"content parts of type {part.type!r} are not supported; only text",
                                      f"messages[{i}].content[{j}]")
                texts.append(part.text)
            content = "\n".join(texts)
        role = "system" if message.role == "developer" else message.role
        entry = {"role": role, "content": content or ""}
        if message.name is not None:
            entry["name"] = message.name
        rendered.append(entry)
    return rendered


class PromptRenderer:
    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="met-tokenizer")

    @classmethod
    def load(cls, path: str | None, vocab_size: int) -> "PromptRenderer":
        tokenizer = None
        if path is not None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        return cls(tokenizer, vocab_size)

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    def _need_tokenizer(self, param: str):
        if self.tokenizer is None:
            raise bad_request("the server runs without a tokenizer (--skip-tokenizer-init): send token ids", param)
        return self.tokenizer

    # -- chat ----------------------------------------------------------------------------------

    def _render_chat(self, messages: list[dict], add_generation_prompt: bool,
                     continue_final_message: bool) -> tuple[str, list[int]]:
        tokenizer = self._need_tokenizer("messages")
        if not getattr(tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        if continue_final_message and (add_generation_prompt or messages[-1]["role"] != "assistant"):
            raise bad_request("continue_final_message needs a final assistant message and "
                              "add_generation_prompt false", "continue_final_message")
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message)
        except Exception as e:  # noqa: BLE001 - jinja raise_exception(), bad roles, ...
            raise bad_request(f"the chat template refused the messages: {e}", "messages") from None
        # The template writes any BOS itself: do not let the tokenizer add another.
        return text, tokenizer.encode(text, add_special_tokens=False)

    async def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                          continue_final_message: bool = False) -> tuple[str, list[int]]:
        plain = messages_for_template(messages)
        if not plain:
            raise bad_request("messages must not be empty", "messages")
        return await self._run(self._render_chat, plain, add_generation_prompt, continue_final_message)

    # -- text <-> token ids ----------------------------------------------------------------------

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._need_tokenizer("prompt").encode(text, add_special_tokens=add_special_tokens)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self._run(self._encode, text, add_special_tokens)

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        if any(not 0 <= t < self.vocab_size for t in token_ids):
            raise bad_request(f"token ids must be in 0..{self.vocab_size - 1}", param)

    def _decode(self, token_ids: list[int]) -> str:
        return self._need_tokenizer("tokens").decode(token_ids, skip_special_tokens=False)

    async def decode(self, token_ids: list[int], param: str = "tokens") -> str:
        self.check_token_ids(token_ids, param)
        return await self._run(self._decode, token_ids)
