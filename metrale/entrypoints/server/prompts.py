"""The HTTP side's tokenizer: chat templates, tokenize, detokenize, and the cheap bounds that
come before them.

The engine thread owns the engine's tokenizer (detokenization of outputs); the server loads its
own copies from the same directory, so threads never share a tokenizer object (a Hugging Face
fast tokenizer is not safe to call from two threads at once). The work runs in two lanes, each
one worker thread with its own tokenizer: texts of at least LONG_TEXT_CHARS characters take the
long lane, everything else the short one, so one huge prompt never delays another request's
first token. The Rust tokenizer releases the GIL while it encodes, so neither lane holds up the
event loop.

Content parts (multimodal/chat_parts.py): text, image_url and video_url; media parts are refused
(400, "model X does not take images") unless the engine takes them, and are fetched and decoded
under the media fetch policy (`load_media`) only after the messages rendered.

Bounds before work, cheapest first (the body-size cap of the gate comes before all of them):
- a text longer in characters than the context could hold (max_model_len times the longest
  token's length) is refused without tokenizing it;
- a text of more than PIECE_CHARS characters is counted piece by piece, and refused as soon as
  the count is past the context, so tokenizing costs about one context's worth of text at most.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from metrale.entrypoints.server.errors import bad_request
from metrale.entrypoints.server.protocol import ChatMessage
from metrale.multimodal.chat_parts import MediaRef, check_modalities, split_content
from metrale.multimodal.fetch_policy import MediaFetchPolicy
from metrale.multimodal.media_loading import load_media

LONG_TEXT_CHARS = 32 * 1024
PIECE_CHARS = 256 * 1024
# Tokens a piece boundary can add over tokenizing the text whole (a split word or space run).
TOKENS_PER_CUT = 16


def _object_arguments(text: str):
    """A past call's arguments as the mapping most templates read, or None if they are not a JSON object."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _parts_of(message: ChatMessage) -> list[dict]:
    return [part.model_dump() for part in message.content]


def _content_of(message: ChatMessage, i: int) -> str | list[dict]:
    """The content the template sees: text parts joined, or, with media, the parts in order with
    each image or video as {"type": "image"} / {"type": "video"} (multimodal/chat_parts.py)."""
    content = message.content
    if not isinstance(content, list):
        return content or ""
    return split_content(_parts_of(message), f"messages[{i}]")[0]


def media_refs_of(messages: list[ChatMessage]) -> list[MediaRef]:
    """The images and videos of the messages, in order; unknown part types refused by name."""
    refs = []
    for i, message in enumerate(messages):
        if isinstance(message.content, list):
            refs += split_content(_parts_of(message), f"messages[{i}]")[1]
    return refs


@dataclass(frozen=True)
class MediaSupport:
    """What the served model does with media. `modalities` empty: a text model, and every media
    part is refused before anything is fetched."""

    model_name: str
    modalities: frozenset = frozenset()
    policy: MediaFetchPolicy | None = None

    def check(self, refs: list[MediaRef]) -> None:
        check_modalities(refs, self.modalities, self.model_name)


def messages_for_template(messages: list[ChatMessage], arguments_as_text: bool = False) -> list[dict]:
    """OpenAI messages -> the plain dicts a chat template reads; text parts are joined. Tool results
    carry their tool_call_id; an assistant's past calls keep OpenAI's shape, with their arguments
    as a mapping, which most templates read (Qwen3-Coder's, GLM's, MiniMax's, Llama's), or, with
    `arguments_as_text`, as the JSON text the client sent (DeepSeek's templates concatenate it)."""
    rendered = []
    for i, message in enumerate(messages):
        role = "system" if message.role == "developer" else message.role
        entry = {"role": role, "content": _content_of(message, i)}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_calls:
            if role != "assistant":
                raise bad_request("only assistant messages carry tool_calls", f"messages[{i}].tool_calls")
            entry["tool_calls"] = []
            for call in message.tool_calls:
                arguments = None if arguments_as_text else _object_arguments(call.function.arguments)
                entry["tool_calls"].append({"id": call.id, "type": "function", "function": {
                    "name": call.function.name,
                    "arguments": call.function.arguments if arguments is None else arguments}})
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.reasoning_content is not None and role == "assistant":
            entry["reasoning_content"] = message.reasoning_content
        rendered.append(entry)
    return rendered


def message_chars(message: ChatMessage) -> int:
    """The characters a message adds, before the template's own."""
    content = message.content
    chars = len(content) if isinstance(content, str) else sum(len(p.text or "") for p in content or ())
    return (chars + len(message.reasoning_content or "")
            + sum(len(c.function.arguments) + len(c.function.name) for c in message.tool_calls or ()))


@dataclass
class _Lane:
    """One worker thread and the tokenizer only it calls."""

    tokenizer: object
    worker: ThreadPoolExecutor


def context_error(limit: int, what: str, param: str):
    return bad_request(f"This model's maximum context length is {limit} tokens. However, {what}. "
                       f"Please reduce the length of the {'messages' if param == 'messages' else 'prompt'}.", param)


class PromptRenderer:
    def __init__(self, tokenizers: list | None, vocab_size: int, max_model_len: int):
        """`tokenizers`: two copies of the same tokenizer (one per lane), or None (token ids only)."""
        self.tokenizer = tokenizers[0] if tokenizers else None  # read-only uses: chat_template, eos
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        names = ("met-tokenizer", "met-tokenizer-long")
        self._lanes = [_Lane(t, ThreadPoolExecutor(max_workers=1, thread_name_prefix=n))
                       for t, n in zip(tokenizers or [None, None], names)]
        longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1) if self.tokenizer else 1
        self.max_prompt_chars = max_model_len * longest
        self.media = MediaSupport("this model")  # set at ready time (app.py): until then, text only

    @classmethod
    def load(cls, path: str | None, vocab_size: int, max_model_len: int) -> "PromptRenderer":
        tokenizers = None
        if path is not None:
            from transformers import AutoTokenizer

            tokenizers = [AutoTokenizer.from_pretrained(path, trust_remote_code=False) for _ in range(2)]
        return cls(tokenizers, vocab_size, max_model_len)

    def close(self) -> None:
        for lane in self._lanes:
            lane.worker.shutdown(wait=False, cancel_futures=True)

    async def _run(self, chars: int, fn, *args):
        """fn(tokenizer, *args) on the lane for a text of `chars` characters."""
        lane = self._lanes[1 if chars >= LONG_TEXT_CHARS else 0]
        return await asyncio.get_running_loop().run_in_executor(lane.worker, fn, lane.tokenizer, *args)

    def _need_tokenizer(self, tokenizer, param: str):
        if tokenizer is None:
            raise bad_request("the server runs without a tokenizer (--skip-tokenizer-init): send token ids", param)
        return tokenizer

    def check_length(self, chars: int, param: str) -> None:
        """The cheap bound: no tokenizer can fit more than max_prompt_chars characters into the context."""
        if chars > self.max_prompt_chars:
            raise context_error(self.max_model_len, f"the {'messages hold' if param == 'messages' else 'prompt has'} "
                                f"{chars:,} characters, more than any {self.max_model_len}-token text can "
                                f"({self.max_prompt_chars:,})", param)

    def _count_or_refuse(self, tokenizer, text: str, param: str) -> None:
        """Count a long text's tokens piece by piece (pieces end before a space, where tokens start),
        and refuse it once the count is certainly past the context."""
        limit, count, cuts, start = self.max_model_len, 0, 0, 0
        while start < len(text):
            end = min(len(text), start + PIECE_CHARS)
            if end < len(text):
                space = text.rfind(" ", start + PIECE_CHARS // 2, end)
                end = space if space > start else end
            count += len(tokenizer.encode(text[start:end], add_special_tokens=False))
            cuts += end < len(text)
            if count > limit + TOKENS_PER_CUT * cuts:
                raise context_error(limit, f"the {param} has more than {count - TOKENS_PER_CUT * cuts:,} tokens", param)
            start = end

    def _encode_bounded(self, tokenizer, text: str, add_special_tokens: bool, param: str) -> list[int]:
        if len(text) > PIECE_CHARS:
            self._count_or_refuse(tokenizer, text, param)
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    # -- chat ----------------------------------------------------------------------------------

    def _render_chat(self, tokenizer, conversations: list[list[dict]], add_generation_prompt: bool,
                     continue_final_message: bool, tools: list[dict] | None,
                     template_kwargs: dict) -> tuple[str, list[int]]:
        """`conversations`: the messages, then the same with past calls' arguments as text, for a
        template that refuses them as mappings (one entry when there are no past calls)."""
        tokenizer = self._need_tokenizer(tokenizer, "messages")
        if not getattr(tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template; use /v1/completions", "messages")
        messages = conversations[0]
        if continue_final_message and (add_generation_prompt or messages[-1]["role"] != "assistant"):
            raise bad_request("continue_final_message needs a final assistant message and "
                              "add_generation_prompt false", "continue_final_message")
        for attempt, messages in enumerate(conversations):
            try:
                text = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                     add_generation_prompt=add_generation_prompt,
                                                     continue_final_message=continue_final_message,
                                                     **template_kwargs)
                break
            except Exception as e:  # noqa: BLE001 - jinja raise_exception(), bad roles, ...
                if attempt == len(conversations) - 1:
                    raise bad_request(f"the chat template refused the messages: {e}", "messages") from None
        self.check_length(len(text), "messages")
        # The template writes any BOS itself: do not let the tokenizer add another.
        return text, self._encode_bounded(tokenizer, text, False, "messages")

    async def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                          continue_final_message: bool = False, tools: list[dict] | None = None,
                          template_kwargs: dict | None = None) -> tuple[str, list[int]]:
        """The prompt text and its token ids. `tools` (OpenAI's function definitions) and
        `template_kwargs` (a request's chat_template_kwargs, checked by the protocol) reach the
        template."""
        if not messages:
            raise bad_request("messages must not be empty", "messages")
        self.media.check(media_refs_of(messages))
        chars = sum(message_chars(m) for m in messages)
        self.check_length(chars, "messages")
        conversations = [messages_for_template(messages)]
        if any(m.tool_calls for m in messages):
            conversations.append(messages_for_template(messages, arguments_as_text=True))
        return await self._run(chars, self._render_chat, conversations, add_generation_prompt, continue_final_message,
                               tools, template_kwargs or {})

    async def load_media(self, messages: list[ChatMessage]) -> dict[str, list] | None:
        """The messages' images and videos fetched and decoded under the policy (the engine's
        multi_modal_data), or None when they hold none. Each failure is a 400 naming the part."""
        refs = media_refs_of(messages)
        if not refs:
            return None
        self.media.check(refs)
        return await load_media(refs, self.media.policy)

    # -- text <-> token ids ----------------------------------------------------------------------

    def _encode(self, tokenizer, text: str, add_special_tokens: bool) -> list[int]:
        return self._encode_bounded(self._need_tokenizer(tokenizer, "prompt"), text, add_special_tokens, "prompt")

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.check_length(len(text), "prompt")
        return await self._run(len(text), self._encode, text, add_special_tokens)

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        if any(not 0 <= t < self.vocab_size for t in token_ids):
            raise bad_request(f"token ids must be in 0..{self.vocab_size - 1}", param)

    def _decode(self, tokenizer, token_ids: list[int]) -> str:
        return self._need_tokenizer(tokenizer, "tokens").decode(token_ids, skip_special_tokens=False)

    async def decode(self, token_ids: list[int], param: str = "tokens") -> str:
        self.check_token_ids(token_ids, param)
        return await self._run(len(token_ids), self._decode, token_ids)
