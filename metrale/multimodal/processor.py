"""Turns a prompt with media into MultiModalInputs: the checkpoint's transformers image
processor (its PIL backend: no torchvision needed) gives each item's pixel values and grid, each
placeholder token of the prompt is expanded to the item's tokens, and the model class computes
the M-RoPE positions (`mrope_positions`, transformers' get_rope_index) once, at admission.

Videos go frame by frame through the same image processor and two consecutive frames fill one
temporal patch, as transformers' video processor lays them out (that processor needs
torchvision); frames are sampled by `fps` / `max_frames` from the frames given. A model whose
class has `frame_timestamps` (Qwen3-VL, Qwen3.5) writes each frame's time as text into its video
span instead: timestamped_video.py, with the tokenizer.

Every limit is applied or refused by name: `mm_processor_kwargs` takes max_pixels, min_pixels,
fps and max_frames; anything else is refused; --vision-max-pixels caps max_pixels;
--limit-mm-per-prompt caps the items per prompt.
"""

from __future__ import annotations

import math

import numpy as np

from metrale.messages.errors import InvalidRequestError
from metrale.multimodal.inputs import MultiModalInputs, MultiModalItem
from metrale.multimodal.timestamped_video import TimestampedVideo
from metrale.multimodal.video_metadata import decoded_from_metadata, is_frames_with_metadata

MODALITY_TOKENS = {"image": "image_token_id", "video": "video_token_id"}
REQUEST_KWARGS = ("max_pixels", "min_pixels", "fps", "max_frames")
DEFAULT_LIMITS = {"image": 16, "video": 2}
DEFAULT_VIDEO_FPS = 2.0


def refuse_media(architecture: str, multi_modal_data) -> None:
    kinds = " and ".join(sorted(multi_modal_data)) if isinstance(multi_modal_data, dict) else "media"
    kinds = kinds.replace("image", "images").replace("video", "videos")
    raise InvalidRequestError(f"model {architecture} does not take {kinds}", "multi_modal_data")


def _as_list(value) -> list:
    if value is None:
        return []
    if is_frames_with_metadata(value):  # one video, vLLM's (frames, metadata)
        return [value]
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


class MultiModalProcessor:
    def __init__(self, model_dir: str, model_class, vl_config, *, limits: dict | None = None,
                 defaults: dict | None = None, vision_max_pixels: int | None = None,
                 max_item_tokens: int | None = None, tokenizer=None):
        """`vl_config`: the checkpoint's whole config (placeholder ids, vision_config);
        `defaults`: --mm-processor-kwargs; `max_item_tokens`: the encoder budget, which one item
        must fit (engine/scheduler.py); `tokenizer`: writes the frame timestamps of the models
        that take them."""
        from transformers import AutoImageProcessor

        self.model_class, self.vl_config = model_class, vl_config
        self.image_processor = AutoImageProcessor.from_pretrained(model_dir)
        self.limits = dict(DEFAULT_LIMITS, **(limits or {}))
        self.defaults = self._check_kwargs(defaults or {}, "--mm-processor-kwargs")
        self.vision_max_pixels = vision_max_pixels
        self.max_item_tokens = max_item_tokens
        self.token_ids = {m: int(getattr(vl_config, attr)) for m, attr in MODALITY_TOKENS.items()}
        # Qwen3-VL / Qwen3.5 write each video frame's timestamp as text into the prompt.
        timestamps = getattr(model_class, "frame_timestamps", None)
        self.timestamped_video = (TimestampedVideo(model_dir, vl_config, tokenizer, timestamps)
                                  if timestamps is not None else None)
        self.architecture = model_class.__name__

    @staticmethod
    def _check_kwargs(kwargs: dict, where: str) -> dict:
        if not isinstance(kwargs, dict):
            raise InvalidRequestError(f"{where} must be an object", "mm_processor_kwargs")
        unknown = sorted(set(kwargs) - set(REQUEST_KWARGS))
        if unknown:
            raise InvalidRequestError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; the processor "
                                      f"takes {', '.join(REQUEST_KWARGS)}", "mm_processor_kwargs")
        for key, value in kwargs.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise InvalidRequestError(f"{where}: {key} must be a positive number, got {value!r}",
                                          "mm_processor_kwargs")
        return dict(kwargs)

    # -- sizes ---------------------------------------------------------------------------------

    def pixel_bounds(self, kwargs: dict) -> tuple[int, int]:
        size = self.image_processor.size
        min_pixels = int(kwargs.get("min_pixels", size.shortest_edge))
        max_pixels = int(kwargs.get("max_pixels", size.longest_edge))
        if self.vision_max_pixels is not None:
            max_pixels = min(max_pixels, self.vision_max_pixels)
        factor = self.image_processor.patch_size * self.image_processor.merge_size
        if max_pixels < factor * factor:
            raise InvalidRequestError(f"max_pixels {max_pixels} is below one {factor}x{factor} patch group",
                                      "mm_processor_kwargs")
        return min(min_pixels, max_pixels), max_pixels

    def max_image_tokens(self) -> int:
        """Tokens of the largest image the defaults allow (the memory plan's dummy item)."""
        _, max_pixels = self.pixel_bounds(self.defaults)
        return max_pixels // (self.image_processor.patch_size * self.image_processor.merge_size) ** 2

    # -- one prompt ----------------------------------------------------------------------------

    def process(self, token_ids: list[int], multi_modal_data: dict, request_kwargs: dict | None) -> MultiModalInputs:
        if not isinstance(multi_modal_data, dict):
            raise InvalidRequestError("multi_modal_data must be an object of 'image' / 'video'", "multi_modal_data")
        unknown = sorted(set(multi_modal_data) - set(MODALITY_TOKENS))
        if unknown:
            raise InvalidRequestError(f"multi_modal_data: unknown modality {', '.join(map(repr, unknown))}; "
                                      f"this model takes {', '.join(MODALITY_TOKENS)}", "multi_modal_data")
        kwargs = dict(self.defaults, **self._check_kwargs(request_kwargs or {}, "mm_processor_kwargs"))
        media = {m: _as_list(multi_modal_data.get(m)) for m in MODALITY_TOKENS}
        for modality, items in media.items():
            if len(items) > self.limits.get(modality, 0):
                raise InvalidRequestError(
                    f"the prompt has {len(items)} {modality}(s), more than --limit-mm-per-prompt allows "
                    f"({self.limits.get(modality, 0)} per prompt)", "multi_modal_data")
            found = sum(1 for t in token_ids if t == self.token_ids[modality])
            if found != len(items):
                raise InvalidRequestError(f"the prompt has {found} {modality} placeholder(s) but {len(items)} "
                                          f"{modality}(s) were given", "multi_modal_data")
        media["video"] = [decoded_from_metadata(*v) if is_frames_with_metadata(v) else v for v in media["video"]]
        processed = {"image": [self._image(x, kwargs) for x in media["image"]],
                     "video": [self._video(x, kwargs) for x in media["video"]]}
        return self._expand(token_ids, processed)

    def _image(self, image, kwargs: dict):
        from PIL import Image

        if not isinstance(image, Image.Image):
            raise InvalidRequestError(f"an image must be a PIL.Image, not {type(image).__name__}", "multi_modal_data")
        min_pixels, max_pixels = self.pixel_bounds(kwargs)
        try:
            out = self.image_processor(images=[image.convert("RGB")], return_tensors="np",
                                       size={"shortest_edge": min_pixels, "longest_edge": max_pixels})
        except ValueError as e:  # an aspect ratio beyond 200:1, ...
            raise InvalidRequestError(f"the image cannot be processed: {e}", "multi_modal_data") from None
        return (out["pixel_values"].astype(np.float32, copy=False), tuple(int(v) for v in out["image_grid_thw"][0]),
                None, None)

    def _video(self, video, kwargs: dict):
        """(pixel values, grid, seconds per temporal patch, the span's token ids or None for
        the placeholder repeated)."""
        from PIL import Image

        if self.timestamped_video is not None:
            pixels, grid, span = self.timestamped_video.process(video, kwargs, self.vision_max_pixels)
            return pixels, grid, None, span

        frames = getattr(video, "frames", video)
        # The rate of the frames as given: a DecodedVideo's frames over its duration (they may be
        # sampled from the source already); bare numpy frames are taken at 2 fps.
        duration = float(getattr(video, "duration_s", 0.0) or 0.0)
        source_fps = len(frames) / duration if duration > 0 and getattr(video, "frames", None) is not None \
            else float(getattr(video, "fps", 0.0) or DEFAULT_VIDEO_FPS)
        if not isinstance(frames, np.ndarray) or frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise InvalidRequestError("a video is uint8 frames [T, H, W, 3] (numpy, or DecodedVideo.frames)",
                                      "multi_modal_data")
        tp = self.image_processor.temporal_patch_size
        want = frames.shape[0]
        if "fps" in kwargs and source_fps > 0:
            want = max(1, round(frames.shape[0] * float(kwargs["fps"]) / source_fps))
        if "max_frames" in kwargs:
            want = min(want, int(kwargs["max_frames"]))
        want = max(tp, want // tp * tp) if want >= tp else tp
        indices = np.linspace(0, frames.shape[0] - 1, want).round().astype(int) if want < frames.shape[0] \
            else np.arange(frames.shape[0])
        picked = frames[indices]
        if len(picked) % tp:  # the last frame repeated to fill the temporal patch, as transformers does
            picked = np.concatenate([picked, np.repeat(picked[-1:], tp - len(picked) % tp, axis=0)])
        sampled_fps = source_fps * len(indices) / frames.shape[0]
        min_pixels, max_pixels = self.pixel_bounds(kwargs)
        size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
        per_frame = [self.image_processor(images=[Image.fromarray(f)], return_tensors="np", size=size) for f in picked]
        _, h, w = (int(v) for v in per_frame[0]["image_grid_thw"][0])
        patches = np.stack([p["pixel_values"] for p in per_frame])  # [frames, h*w, C*T*P*P]
        n, hw, width = patches.shape
        pp = self.image_processor.patch_size ** 2
        slots = patches.reshape(n, hw, 3, tp, pp)[:, :, :, 0]  # each frame once
        slots = slots.reshape(n // tp, tp, hw, 3, pp).transpose(0, 2, 3, 1, 4)
        pixels = np.ascontiguousarray(slots.reshape(n // tp * hw, width), dtype=np.float32)
        return pixels, (n // tp, h, w), tp / sampled_fps, None

    def _expand(self, token_ids: list[int], processed: dict) -> MultiModalInputs:
        merge = self.image_processor.merge_size ** 2
        pads = {t: m for m, t in self.token_ids.items()}
        queues = {m: list(v) for m, v in processed.items()}
        out: list[int] = []
        items: list[MultiModalItem] = []
        for token in token_ids:
            modality = pads.get(token)
            if modality is None:
                out.append(token)
                continue
            pixels, grid, seconds, span = queues[modality].pop(0)
            n = math.prod(grid) // merge
            if self.max_item_tokens is not None and n > self.max_item_tokens:
                raise InvalidRequestError(
                    f"a {modality} of {n} tokens exceeds the encoder budget of {self.max_item_tokens} tokens "
                    f"(--max-num-encoder-tokens); lower max_pixels or raise the budget", "multi_modal_data")
            span = [token] * n if span is None else span  # n placeholder tokens in either
            items.append(MultiModalItem(modality, pixels, grid, len(out), len(span), n, token, seconds))
            out += span
        images = [i.grid_thw for i in items if i.modality == "image"]
        videos = [i.grid_thw for i in items if i.modality == "video"]
        video_kwargs = {}
        if videos:
            video_kwargs["second_per_grid_ts"] = [i.second_per_grid_t for i in items if i.modality == "video"]
        positions, delta = self.model_class.mrope_positions(
            self.vl_config, out, np.array(images, dtype=np.int64).reshape(-1, 3) if images else None,
            np.array(videos, dtype=np.int64).reshape(-1, 3) if videos else None, **video_kwargs)
        return MultiModalInputs(out, items, np.asarray(positions, dtype=np.int64), int(delta))
