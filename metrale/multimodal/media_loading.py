"""MediaRefs -> the engine's multi_modal_data: {"image": [PIL RGB, ...], "video": [DecodedVideo, ...]}.

Fetches run concurrently (at most FETCH_CONCURRENCY per request) and decoding runs on worker
threads, so the event loop keeps serving; the first failure cancels the rest. A failure is a
MediaError whose message starts with the part's field ("image_url: ...") and whose param is the
part's place in the request.
"""

from __future__ import annotations

import asyncio

from metrale.multimodal.errors import MediaError
from metrale.multimodal.fetch import fetch_media
from metrale.multimodal.fetch_policy import MediaFetchPolicy
from metrale.multimodal.chat_parts import MediaRef
from metrale.multimodal.image_decode import decode_image
from metrale.multimodal.video_decode import VideoDecodePolicy, decode_video

FETCH_CONCURRENCY = 4


def video_policy_of(policy: MediaFetchPolicy) -> VideoDecodePolicy:
    return VideoDecodePolicy(max_frame_pixels=policy.max_image_pixels)


def _decoded(ref: MediaRef, data: bytes, policy: MediaFetchPolicy):
    if ref.modality == "video":
        return decode_video(data, video_policy_of(policy))
    return decode_image(data, policy.max_image_pixels)


def _checked_image(image, policy: MediaFetchPolicy):
    """A PIL image given directly (Python): the same pixel cap, RGB."""
    width, height = image.size
    if width * height > policy.max_image_pixels:
        raise MediaError(f"the image is {width} x {height} pixels, more than the {policy.max_image_pixels:,} allowed")
    return image if image.mode == "RGB" else image.convert("RGB")


async def _load_one(ref: MediaRef, policy: MediaFetchPolicy, gate: asyncio.Semaphore):
    try:
        if not isinstance(ref.source, str):
            return _checked_image(ref.source, policy)
        async with gate:
            data = await fetch_media(ref.source, policy, ref.modality)
        return await asyncio.to_thread(_decoded, ref, data, policy)
    except MediaError as e:
        raise MediaError(f"{ref.field}: {e}", e.param or f"{ref.param}.{ref.field}") from None


async def load_media(refs: list[MediaRef], policy: MediaFetchPolicy) -> dict[str, list]:
    gate = asyncio.Semaphore(FETCH_CONCURRENCY)
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_load_one(ref, policy, gate)) for ref in refs]
    except* MediaError as failures:
        raise failures.exceptions[0] from None
    media: dict[str, list] = {}
    for ref, task in zip(refs, tasks):
        media.setdefault(ref.modality, []).append(task.result())
    return media


def load_media_sync(refs: list[MediaRef], policy: MediaFetchPolicy) -> dict[str, list]:
    """load_media for callers without an event loop (LLM.chat)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(load_media(refs, policy))
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="met-media") as worker:
        return worker.submit(asyncio.run, load_media(refs, policy)).result()
