"""An image through the OpenAI-compatible server on a tiny Qwen2.5-VL checkpoint: a data: URL
image_url part is fetched, decoded, processed and answered with transformers' greedy tokens;
--limit-mm-per-prompt is a 400 naming it, and the server goes on serving."""

from __future__ import annotations

import base64
import io

import openai
import pytest
import torch

from server_process import ServerProcess
from test_vl_engine import NEW_TOKENS, hf_image_tokens
from vl_checkpoints import make_vl_checkpoint, tiny_images
from vl_reference import Media


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_image_url_part_through_the_server(tmp_path):
    import transformers

    checkpoint = make_vl_checkpoint(str(tmp_path / "qwen2_5_vl"), "qwen2_5_vl")
    reference = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32)
    media = Media(checkpoint)
    a, b = tiny_images()
    rendered = ("<|im_start|>user\nWhat is this?<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
                "<|im_start|>assistant\n")
    expected = hf_image_tokens(media, reference.eval(), media.tokenizer.encode(rendered, add_special_tokens=False), [a])
    server = ServerProcess(checkpoint, str(tmp_path / "serve.log"), "--limit-mm-per-prompt", '{"image": 1}')
    try:
        server.wait_ready()
        client = server.client(timeout=60)
        content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": data_url(a)}}]
        reply = client.chat.completions.create(model=checkpoint, messages=[{"role": "user", "content": content}],
                                               max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        assert reply.choices[0].message.content == media.tokenizer.decode(expected)
        assert reply.usage.prompt_tokens == len(media.tokenizer.encode(rendered, add_special_tokens=False)) - 1 + 4
        two = content + [{"type": "image_url", "image_url": {"url": data_url(b)}}]
        with pytest.raises(openai.BadRequestError, match="limit-mm-per-prompt"):
            client.chat.completions.create(model=checkpoint, messages=[{"role": "user", "content": two}], max_tokens=2)
        again = client.chat.completions.create(model=checkpoint, messages=[{"role": "user", "content": content}],
                                               max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        assert again.choices[0].message.content == reply.choices[0].message.content
    finally:
        code = server.stop()
    assert code == 0, server.log()
