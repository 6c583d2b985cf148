"""OpenAI chat content parts -> (the content a chat template sees, the media to load).

Parts taken: `text`; `image_url` (a string, or {"url": ..., "detail": ...}: detail is accepted
and has no effect); vLLM's `video_url` (the same shapes); and, from Python only (LLM.chat),
vLLM's `image_pil` holding a PIL image. Any other type is refused by name. A message with
media gets its content as a list of {"type": "text", "text": ...}, {"type": "image"} and
{"type": "video"} in the parts' order, the shape transformers' processors' chat templates read;
a message of text alone keeps its parts joined into one string, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from metrale.multimodal.errors import MediaError

# More media than this in one request is refused before anything is fetched: the body cap alone
# would let one request name hundreds of thousands of URLs.
MAX_MEDIA_ITEMS = 64

MEDIA_PART_TYPES = {"image_url": "image", "video_url": "video", "image_pil": "image"}
_PART_TYPES = ("text", "image_url", "video_url")


@dataclass
class MediaRef:
    modality: str  # "image" or "video"
    source: Any  # a URL (str), or a PIL image from Python
    field: str  # the part's field ("image_url"), for messages
    param: str  # where the part is in the request: messages[0].content[1]


def _url_of(value, field: str, param: str) -> str:
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise MediaError(f"{field} needs a URL: a string, or an object with a string 'url'", f"{param}.{field}")
    return url


def split_content(parts: list[dict], param: str, allow_objects: bool = False) -> tuple[str | list[dict], list[MediaRef]]:
    """One message's parts -> its template content and its media, in order. `param`: the
    message's place (messages[0]); `allow_objects`: PIL images may stand in for URLs (Python)."""
    content, refs, texts = [], [], []
    for j, part in enumerate(parts):
        where = f"{param}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise MediaError("a text part needs a string 'text'", where)
            content.append({"type": "text", "text": text})
            texts.append(text)
        elif kind in MEDIA_PART_TYPES and (kind != "image_pil" or allow_objects):
            modality = MEDIA_PART_TYPES[kind]
            value = part.get(kind)
            if kind == "image_pil" or (allow_objects and _is_pil(value)):
                if not _is_pil(value):
                    raise MediaError("image_pil needs a PIL image", f"{where}.image_pil")
                source = value
            else:
                source = _url_of(value, kind, where)
            refs.append(MediaRef(modality, source, kind, where))
            content.append({"type": modality})
        else:
            names = _PART_TYPES + (("image_pil",) if allow_objects else ())
            taken = ", ".join(names[:-1]) + " and " + names[-1]
            raise MediaError(f"content parts of type {str(kind)[:40]!r} are not supported; met takes {taken}", where)
    return (content if refs else "\n".join(texts)), refs


def check_media_count(refs: list[MediaRef]) -> None:
    if len(refs) > MAX_MEDIA_ITEMS:
        raise MediaError(f"the request holds {len(refs)} images and videos, more than the {MAX_MEDIA_ITEMS} "
                         f"allowed", "messages")


def engine_modalities(engine) -> frozenset:
    """Images and video when the engine says it takes them (`supports_multimodal`, on the engine
    or on its model config), else none: then media parts are refused before any fetch, and a
    prompt with multi_modal_data never reaches an engine that would not use it."""
    takes = getattr(engine, "supports_multimodal", None)
    if takes is None:
        takes = getattr(getattr(engine, "model_config", None), "supports_multimodal", False)
    return frozenset({"image", "video"}) if takes is True else frozenset()


def check_modalities(refs: list[MediaRef], modalities: frozenset, model_name: str) -> None:
    check_media_count(refs)
    for ref in refs:
        if ref.modality not in modalities:
            raise MediaError(f"model {model_name} does not take {ref.modality}s", ref.param)


def _is_pil(value) -> bool:
    try:
        from PIL import Image
    except ImportError:
        return False
    return isinstance(value, Image.Image)
