"""Chat content parts with media through the server (reliability cases 15 and 16).

The demo model is text-only: every image_url / video_url part is a 400 naming that, before
anything is fetched, and the server goes on serving. The content-part handling the server runs
for a model that takes media (PromptRenderer.load_media: parse, check, fetch under the policy,
decode) is driven directly below, against servers on loopback.
"""

from __future__ import annotations

import asyncio
import base64
import time

import openai
import pytest

from media_servers import MediaServer, png_bytes, png_claiming
from metrale.entrypoints.server.errors import api_error_of
from metrale.entrypoints.server.prompts import MediaSupport, PromptRenderer
from metrale.entrypoints.server.protocol import ChatCompletionRequest
from metrale.multimodal.errors import MediaError
from metrale.multimodal.fetch_policy import MediaFetchPolicy
from server_process import ServerProcess


def image_message(url) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


BAD_MEDIA = [
    image_message("http://169.254.169.254/latest/meta-data/"),
    image_message("http://127.0.0.1:1/png"),
    image_message("file:///etc/passwd"),
    image_message(data_url(png_claiming(30000, 30000))),
    image_message(data_url(b"\x89PNG corrupt")),
    [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}]}],
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(None, str(tmp_path_factory.mktemp("media") / "serve.log"))
    try:
        s.wait_ready()
        yield s
    finally:
        code = s.stop()
    assert code == 0, s.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=30)


def text_works(client) -> None:
    reply = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert reply.usage.completion_tokens == 2


@pytest.mark.parametrize("messages", BAD_MEDIA, ids=["metadata", "loopback", "file", "bomb", "corrupt", "video"])
def test_a_text_model_refuses_media_with_a_400(client, messages):
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="demo", messages=messages, max_tokens=2)
    assert time.monotonic() - started < 5
    error = info.value.body
    kind = "videos" if "video_url" in str(messages) else "images"
    assert error["message"] == f"model demo does not take {kind}" and "0x" not in error["message"]
    assert error["param"].startswith("messages[0].content[")
    text_works(client)


def test_unknown_part_types_are_refused_by_name(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="demo", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}])
    assert "content parts of type 'input_audio' are not supported" in info.value.body["message"]
    assert info.value.body["param"] == "messages[0].content[0]"
    text_works(client)


def test_tokenize_refuses_media(server):
    import httpx

    response = httpx.post(server.url + "/tokenize", json={"messages": image_message("https://example.com/a.png")})
    assert response.status_code == 400 and "does not take images" in response.json()["error"]["message"]


def test_text_parts_still_work(client):
    reply = client.chat.completions.create(model="demo", max_tokens=2, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}])
    assert reply.usage.completion_tokens == 2


# -- what the server does for a model that takes media ------------------------------------------------


def renderer(policy: MediaFetchPolicy) -> PromptRenderer:
    prompts = PromptRenderer(None, vocab_size=100, max_model_len=64)
    prompts.media = MediaSupport("vl", frozenset({"image", "video"}), policy)
    return prompts


def messages_of(raw: list[dict]):
    return ChatCompletionRequest.model_validate({"messages": raw}).messages


def load(prompts: PromptRenderer, raw: list[dict]):
    return asyncio.run(prompts.load_media(messages_of(raw)))


def test_the_allowed_case_fetches_and_decodes():
    with MediaServer() as media:
        prompts = renderer(MediaFetchPolicy(allow_http=True, allow_private_addresses=True))
        url = f"http://127.0.0.1:{media.port}/png"
        raw = [{"role": "user", "content": [{"type": "image_url", "image_url": url},
                                            {"type": "image_url", "image_url": {"url": data_url(png_bytes(3, 2))}}]}]
        images = load(prompts, raw)["image"]
        assert [i.size for i in images] == [(7, 5), (3, 2)]
        assert load(prompts, [{"role": "user", "content": "no media"}]) is None


def test_every_media_failure_is_a_400_naming_the_part():
    with MediaServer() as media:
        prompts = renderer(MediaFetchPolicy(total_timeout_s=1.5))
        cases = [(f"http://127.0.0.1:{media.port}/png", "plain http media URLs are refused"),
                 (f"https://127.0.0.1:{media.port}/png", "host 127.0.0.1 is a loopback address"),
                 ("https://169.254.169.254/latest/meta-data/", "host 169.254.169.254 is a link-local address"),
                 ("file:///etc/passwd", "file:// URLs are refused"),
                 (data_url(png_claiming(30000, 30000)), "pixels allowed"),
                 (data_url(b"\x89PNG corrupt"), "the image could not be decoded")]
        for url, expected in cases:
            started = time.monotonic()
            with pytest.raises(MediaError) as info:
                load(prompts, image_message(url))
            error = api_error_of(info.value)
            assert error.status == 400 and error.message.startswith("image_url: ") and expected in error.message
            assert error.param == "messages[0].content[1].image_url" and "0x" not in error.message
            assert time.monotonic() - started < 2
        assert media.hits == []


def test_a_bad_media_flag_stops_startup(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "metrale.entrypoints.cli", "serve", "--port", "0",
                           "--allowed-local-media-path", str(tmp_path / "none")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "allowed_local_media_path" in proc.stderr and "is not a directory" in proc.stderr
