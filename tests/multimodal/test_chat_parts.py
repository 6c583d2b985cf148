"""OpenAI content parts -> the template's content and the media to load; loading under the policy."""

from __future__ import annotations

import asyncio
import base64

import pytest
from PIL import Image

from media_servers import MediaServer, mp4_bytes, png_bytes
from metrale.multimodal.chat_parts import (MAX_MEDIA_ITEMS, MediaRef, check_modalities, engine_modalities,
                                           split_content)
from metrale.multimodal.errors import MediaError
from metrale.multimodal.fetch_policy import MediaFetchPolicy
from metrale.multimodal.media_loading import load_media, load_media_sync
from metrale.multimodal.video_decode import DecodedVideo

PNG_URL = "data:image/png;base64," + base64.b64encode(png_bytes()).decode()


def test_parts_in_order_several_images():
    parts = [{"type": "text", "text": "Compare"}, {"type": "image_url", "image_url": {"url": "https://a.example/1.png",
                                                                                        "detail": "high"}},
             {"type": "image_url", "image_url": PNG_URL}, {"type": "text", "text": "and"},
             {"type": "video_url", "video_url": {"url": "https://a.example/v.mp4"}}]
    content, refs = split_content(parts, "messages[0]")
    assert content == [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "image"},
                       {"type": "text", "text": "and"}, {"type": "video"}]
    assert [(r.modality, r.source, r.param) for r in refs] == [
        ("image", "https://a.example/1.png", "messages[0].content[1]"), ("image", PNG_URL, "messages[0].content[2]"),
        ("video", "https://a.example/v.mp4", "messages[0].content[4]")]


def test_text_only_parts_stay_one_string():
    assert split_content([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "messages[0]") == ("a\nb", [])


@pytest.mark.parametrize("part,message,param", [
    ({"type": "input_audio", "input_audio": {}}, "type 'input_audio' are not supported; met takes text, image_url and video_url",
     "messages[1].content[0]"),
    ({"type": "image_pil", "image_pil": None}, "type 'image_pil' are not supported", "messages[1].content[0]"),
    ({"type": "image_url", "image_url": {"detail": "low"}}, "image_url needs a URL", "messages[1].content[0].image_url"),
    ({"type": "image_url", "image_url": 5}, "image_url needs a URL", "messages[1].content[0].image_url"),
    ({"type": "text"}, "needs a string 'text'", "messages[1].content[0]"),
    ({"text": "no type"}, "type 'None' are not supported", "messages[1].content[0]"),
])
def test_refused_by_name(part, message, param):
    with pytest.raises(MediaError, match=message) as info:
        split_content([part], "messages[1]")
    assert info.value.param == param


def test_pil_images_from_python_only():
    image = Image.new("RGBA", (4, 4))
    content, refs = split_content([{"type": "image_pil", "image_pil": image},
                                   {"type": "image_url", "image_url": image}], "messages[0]", allow_objects=True)
    assert content == [{"type": "image"}, {"type": "image"}] and [r.source for r in refs] == [image, image]
    media = load_media_sync(refs, MediaFetchPolicy())
    assert [m.mode for m in media["image"]] == ["RGB", "RGB"]


def test_modalities_and_counts():
    class TextEngine:
        model_config = object()

    class VisionEngine:
        supports_multimodal = True

    assert engine_modalities(TextEngine()) == frozenset()
    assert engine_modalities(VisionEngine()) == {"image", "video"}
    refs = [MediaRef("image", PNG_URL, "image_url", "messages[0].content[0]")]
    with pytest.raises(MediaError, match="model demo does not take images") as info:
        check_modalities(refs, frozenset(), "demo")
    assert info.value.param == "messages[0].content[0]"
    with pytest.raises(MediaError, match=f"more than the {MAX_MEDIA_ITEMS} allowed"):
        check_modalities(refs * (MAX_MEDIA_ITEMS + 1), frozenset({"image"}), "demo")


def test_load_media_fetches_decodes_and_names_the_part():
    video = mp4_bytes(frames=8, fps=4)
    with MediaServer() as server:
        server.files["/v.mp4"] = video
        base = f"http://127.0.0.1:{server.port}"
        refs = [MediaRef("image", f"{base}/png", "image_url", "messages[0].content[0]"),
                MediaRef("image", PNG_URL, "image_url", "messages[0].content[1]"),
                MediaRef("video", f"{base}/v.mp4", "video_url", "messages[0].content[2]"),
                MediaRef("video", "data:video/mp4;base64," + base64.b64encode(video).decode(), "video_url", "m")]
        unsafe = MediaFetchPolicy(allow_http=True, allow_private_addresses=True)
        media = asyncio.run(load_media(refs, unsafe))
        assert [i.size for i in media["image"]] == [(7, 5), (7, 5)]
        assert isinstance(media["video"][0], DecodedVideo) and media["video"][0].frames.shape[1:] == (24, 32, 3)
        assert media["video"][1].frame_indices == media["video"][0].frame_indices
        # The first failure is the error, prefixed by the part's field, with the part's place as param.
        with pytest.raises(MediaError) as info:
            asyncio.run(load_media(refs + [MediaRef("image", f"{base}/missing", "image_url", "messages[1].content[0]")],
                                   unsafe))
        assert str(info.value) == "image_url: host 127.0.0.1 answered the image request with HTTP 404"
        assert info.value.param == "messages[1].content[0].image_url"
        with pytest.raises(MediaError, match="^image_url: host 127.0.0.1 is a loopback address"):
            asyncio.run(load_media(refs, MediaFetchPolicy(allow_http=True)))
        server.files["/bad.png"] = b"\x89PNG\r\n\x1a\nnot really"
        with pytest.raises(MediaError, match="^image_url: the image could not be decoded$"):
            asyncio.run(load_media([MediaRef("image", f"{base}/bad.png", "image_url", "m")], unsafe))
