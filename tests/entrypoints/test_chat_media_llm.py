"""LLM.chat with image parts: PIL images, data: URLs and fetched URLs become multi_modal_data
under the LLM's media fetch policy; a text model refuses them before anything is fetched."""

from __future__ import annotations

import base64

import pytest
from PIL import Image

from media_servers import MediaServer, png_bytes
from metrale import LLM
from metrale.messages.sampling_params import SamplingParams
from metrale.multimodal.errors import MediaError


@pytest.fixture(scope="module")
def llm(checkpoint_factory):
    with LLM(checkpoint_factory("llama"), dtype="float32", device="cpu", num_kv_blocks=32, max_model_len=128,
             media_allow_http=True, media_allow_private_addresses=True) as llm:
        yield llm


def test_a_text_model_refuses_images(llm):
    with MediaServer() as server:
        with pytest.raises(MediaError, match="does not take images") as info:
            llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                   {"type": "image_url", "image_url": f"http://127.0.0.1:{server.port}/png"}]}])
        assert info.value.param == "messages[0].content[1]" and server.hits == []
    reply = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                     SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(reply[0].outputs[0].token_ids) == 2


def test_images_reach_generate_as_multi_modal_data(llm, monkeypatch):
    """With an engine that takes media, chat hands generate the rendered text and the decoded images."""
    monkeypatch.setattr(llm.llm_engine, "supports_multimodal", True, raising=False)
    captured = []
    monkeypatch.setattr(llm, "generate", lambda prompts, params=None, use_tqdm=True: captured.extend(prompts) or [])
    data_url = "data:image/png;base64," + base64.b64encode(png_bytes(3, 2)).decode()
    with MediaServer() as server:
        llm.chat([{"role": "user", "content": [
            {"type": "image_pil", "image_pil": Image.new("L", (4, 4))}, {"type": "text", "text": "and"},
            {"type": "image_url", "image_url": {"url": data_url}},
            {"type": "image_url", "image_url": f"http://127.0.0.1:{server.port}/png"}]}])
    (prompt,) = captured
    assert set(prompt) == {"prompt", "multi_modal_data"} and isinstance(prompt["prompt"], str)
    assert [(i.size, i.mode) for i in prompt["multi_modal_data"]["image"]] == [((4, 4), "RGB"), ((3, 2), "RGB"),
                                                                               ((7, 5), "RGB")]
    with pytest.raises(MediaError, match="^image_url: file:// URLs are refused"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": "file:///etc/passwd"}]}])
