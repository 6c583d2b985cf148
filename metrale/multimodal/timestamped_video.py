"""Video for the models whose prompts write each frame's time as text (Qwen3-VL, Qwen3-VL-MoE,
Qwen3.5; their model class carries `frame_timestamps`), as transformers' Qwen3VLVideoProcessor
and Qwen3VLProcessor do it (the same in transformers 5.17 and 5.24).

The placeholder's expansion (Qwen3VLProcessor.replace_video_token), per temporal patch i:

    <|video_pad|>  ->  "<{t_i:.1f} seconds>" <|vision_start|> <|video_pad|> x (h*w / merge^2) <|vision_end|>  ...

Only the placeholder token is replaced: the prompt's own <|vision_start|> / <|vision_end|> around
it stay, so a chat template's prompt reads <|vision_start|><0.5 seconds><|vision_start|>...
<|vision_end|><|vision_end|>. t_i is the mean time of the patch's first and last frame (the
model's `frame_timestamps`: source frame index / source fps, the last frame repeated to fill the
final patch). Each timestamp is tokenized on its own: in transformers' whole-text tokenization
the special tokens around it cut it from its neighbours, so the ids are the same.

Frames: the frames given are kept as they are (a DecodedVideo's frames with their source indices
and the source's fps; bare numpy frames are consecutive frames at DEFAULT_SOURCE_FPS) unless
`fps` or `max_frames` is asked or there are more than the processor's max_frames; then
transformers' sample_frames rule picks among them: int(duration x fps) frames, clamped to
[min_frames, max_frames] and to the frames given, spread by np.linspace (rounded).

Size: transformers' smart_resize over the whole clip: the frame count (rounded to whole temporal
patches) x h x w within the video processor's size bounds (shortest_edge .. longest_edge
pixels in all). `max_pixels` / `min_pixels` (mm_processor_kwargs) and --vision-max-pixels are
per frame here too: they bound the clip's pixels as that many times the frame count. Frames are
resized with PIL (the config's resample, bicubic), rescaled and normalized as transformers' PIL
backend does (float64 rescale, float32 normalize), and laid out as its patchify.
"""

from __future__ import annotations

import numpy as np

from metrale.messages.errors import InvalidRequestError

DEFAULT_SOURCE_FPS = 2.0  # bare numpy frames carry no rate (transformers would assume 24 fps)


class SourceFrames:
    """The frames given, each frame's index in the source video, and the source's fps."""

    def __init__(self, video):
        frames = getattr(video, "frames", video)
        if not isinstance(frames, np.ndarray) or frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise InvalidRequestError("a video is uint8 frames [T, H, W, 3] (numpy, or DecodedVideo.frames)",
                                      "multi_modal_data")
        if frames.shape[0] < 1:
            raise InvalidRequestError("a video needs at least one frame", "multi_modal_data")
        self.frames = frames
        if getattr(video, "frames", None) is None:  # bare frames: consecutive, at the default rate
            self.indices = list(range(frames.shape[0]))
            self.source_fps = self.rate = DEFAULT_SOURCE_FPS
            return
        self.indices = [int(i) for i in video.frame_indices]
        self.source_fps = float(video.fps or 0.0)
        if len(self.indices) != frames.shape[0] or self.source_fps <= 0:
            raise InvalidRequestError("a DecodedVideo needs one frame index per frame and a positive fps",
                                      "multi_modal_data")
        duration = float(video.duration_s or 0.0)
        self.rate = frames.shape[0] / duration if duration > 0 else self.source_fps

    def __len__(self) -> int:
        return self.frames.shape[0]


class TimestampedVideo:
    def __init__(self, model_dir: str, vl_config, tokenizer, frame_timestamps):
        """`frame_timestamps(indices, fps, temporal_patch_size)`: the model's rule for each
        temporal patch's seconds; `tokenizer`: the engine's (None: videos are refused)."""
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        # The checkpoint's video_preprocessor_config.json, else its preprocessor_config.json, over
        # the class defaults: what transformers' AutoProcessor would load.
        self.settings = Qwen3VLVideoProcessor.from_pretrained(model_dir)
        self.tokenizer = tokenizer
        self.frame_timestamps = frame_timestamps
        self.video_token_id = int(vl_config.video_token_id)
        self.vision_start_id = int(vl_config.vision_start_token_id)
        self.vision_end_id = int(vl_config.vision_end_token_id)
        self._timestamp_ids: dict[str, list[int]] = {}

    def process(self, video, kwargs: dict, vision_max_pixels: int | None):
        """(pixel values float32 [t*h*w, C*T*P*P], grid (t, h, w), the span's token ids)."""
        if self.tokenizer is None:
            raise InvalidRequestError("video on this model needs the tokenizer to write each frame's timestamp, and "
                                      "the engine runs without one (skip_tokenizer_init)", "multi_modal_data")
        source = SourceFrames(video)
        picked = self.sample(source, kwargs)
        frames = source.frames[picked]
        pixels, grid = self.pixel_values(frames, kwargs, vision_max_pixels)
        seconds = self.frame_timestamps([source.indices[i] for i in picked], source.source_fps,
                                        self.settings.temporal_patch_size)
        return pixels, grid, self.span_tokens(grid, seconds)

    def sample(self, source: SourceFrames, kwargs: dict) -> list[int]:
        """Indices into the frames given (transformers' sample_frames over them, when asked)."""
        s = self.settings
        max_frames = int(kwargs.get("max_frames", s.max_frames))
        if "fps" not in kwargs and "max_frames" not in kwargs and len(source) <= max_frames:
            return list(range(len(source)))
        fps = float(kwargs.get("fps", s.fps))
        # round(.., 6): a duration computed as frames / rate must not lose a frame to float error
        count = int(round(len(source) / source.rate * fps, 6))
        count = min(max(count, s.min_frames), max_frames, len(source))
        return np.linspace(0, len(source) - 1, count).round().astype(int).tolist()

    def pixel_bounds(self, frame_count: int, kwargs: dict, vision_max_pixels: int | None) -> tuple[int, int]:
        """(min, max) pixels of the whole clip, as smart_resize compares them."""
        s = self.settings
        tp = s.temporal_patch_size
        frames = max(tp, round(frame_count / tp) * tp)  # smart_resize's t_bar
        max_pixels = int(kwargs["max_pixels"]) * frames if "max_pixels" in kwargs else int(s.size.longest_edge)
        min_pixels = int(kwargs["min_pixels"]) * frames if "min_pixels" in kwargs else int(s.size.shortest_edge)
        if vision_max_pixels is not None:
            max_pixels = min(max_pixels, vision_max_pixels * frames)
        factor = s.patch_size * s.merge_size
        if max_pixels < factor * factor * frames:
            raise InvalidRequestError(f"max_pixels {max_pixels // frames} per video frame is below one "
                                      f"{factor}x{factor} patch group", "mm_processor_kwargs")
        return min(min_pixels, max_pixels), max_pixels

    def pixel_values(self, frames: np.ndarray, kwargs: dict, vision_max_pixels: int | None):
        from PIL import Image
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

        s = self.settings
        tp, patch, merge = s.temporal_patch_size, s.patch_size, s.merge_size
        min_pixels, max_pixels = self.pixel_bounds(len(frames), kwargs, vision_max_pixels)
        try:
            # A clip of fewer frames than a temporal patch is sized as the padded clip (transformers
            # refuses it; its last frame fills the patch either way).
            height, width = smart_resize(max(len(frames), tp), frames.shape[1], frames.shape[2], temporal_factor=tp,
                                         factor=patch * merge, min_pixels=min_pixels, max_pixels=max_pixels)
        except ValueError as e:  # an aspect ratio beyond 200:1
            raise InvalidRequestError(f"the video cannot be processed: {e}", "multi_modal_data") from None
        if (height, width) != frames.shape[1:3]:
            resample = Image.Resampling(int(s.resample))
            frames = np.stack([np.asarray(Image.fromarray(f).resize((width, height), resample)) for f in frames])
        x = frames
        if s.do_rescale:
            x = (x.astype(np.float64) * s.rescale_factor).astype(np.float32)
        if s.do_normalize:
            x = x.astype(np.float32, copy=False)
            x = (x - np.asarray(s.image_mean, dtype=np.float32)) / np.asarray(s.image_std, dtype=np.float32)
        x = np.asarray(x, dtype=np.float32).transpose(0, 3, 1, 2)  # [frames, C, H, W]
        if pad := -len(x) % tp:  # the last frame repeated to fill the final temporal patch
            x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
        t, h, w = len(x) // tp, height // patch, width // patch
        # transformers' patchify: (t, tp, C, h/m, m, P, w/m, m, P) -> (t, h/m, w/m, m, m, C, tp, P, P)
        x = x.reshape(t, tp, 3, h // merge, merge, patch, w // merge, merge, patch)
        x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(t * h * w, 3 * tp * patch * patch)
        return np.ascontiguousarray(x), (t, h, w)

    def span_tokens(self, grid: tuple[int, int, int], seconds: list[float]) -> list[int]:
        t, h, w = grid
        if len(seconds) != t:
            raise ValueError(f"{len(seconds)} timestamps for {t} temporal patches")
        per_frame = h * w // self.settings.merge_size ** 2
        frame = [self.vision_start_id] + [self.video_token_id] * per_frame + [self.vision_end_id]
        return [token for second in seconds for token in self._timestamp(second) + frame]

    def _timestamp(self, second: float) -> list[int]:
        text = f"<{second:.1f} seconds>"
        if text not in self._timestamp_ids:
            self._timestamp_ids[text] = list(self.tokenizer.encode(text, add_special_tokens=False))
        return self._timestamp_ids[text]
