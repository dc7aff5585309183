"""Images through the APIs of a tiny random Qwen3-VL: `LLM.chat` and `LLM.generate` with image parts and
files, the `generate --image` command, and a real server that the official openai client sends data: URLs
to: the same tokens each way, and a clear 4xx for a bad image, too many images, a URL the server does not
fetch, or an image sent to a text model."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys

import numpy as np
import openai
import pytest
from PIL import Image

from slotserve import LLM, SamplingParams
from tests.helpers import assert_figures
from tests.servers import MODEL, Server
from tests.test_qwen3_vl import build_tiny_vl

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# Small budgets keep the tiny tower's work small: 64x64 to 128x128 pixels, 4 to 16 image tokens.
PREPROCESSOR = {"min_pixels": 64 * 64, "max_pixels": 128 * 128, "patch_size": 16, "merge_size": 2,
                "temporal_patch_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}


@pytest.fixture(scope="module")
def vl_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-vl-api")
    build_tiny_vl(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return path


@pytest.fixture(scope="module")
def llm(vl_model):
    with LLM(str(vl_model), kv_cache_memory=32 << 20, limit_mm_per_prompt=2) as llm:
        yield llm


def png(seed: int, size: tuple[int, int] = (90, 70)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def user(text: str, *images: bytes) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(image)}} for image in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def test_chat_image_parts_equal_the_dict_prompt_and_each_image_counts(llm, tmp_path):
    a, b = png(1), png(2)
    (path := tmp_path / "a.png").write_bytes(a)
    by_url = llm.chat(user("What is this?", a), GREEDY)[0].outputs[0].token_ids
    by_part = llm.chat([{"role": "user", "content": [{"type": "image", "image": Image.open(io.BytesIO(a))},
                                                     {"type": "text", "text": "What is this?"}]}],
                       GREEDY)[0].outputs[0].token_ids
    prompt = llm.render_chat(user("What is this?", a))
    by_file = llm.generate({"prompt": prompt["prompt"], "multi_modal_data": {"image": path}},
                           GREEDY)[0].outputs[0].token_ids
    assert by_url == by_part == by_file
    assert llm.chat(user("What is this?", b), GREEDY)[0].outputs[0].token_ids != by_url
    assert prompt["prompt"].count("<|image_pad|>") == 1


def test_bad_images_are_value_errors_that_leave_nothing_queued(llm):
    with pytest.raises(ValueError, match="cannot decode"):
        llm.chat(user("x", b"not an image"), GREEDY)
    with pytest.raises(ValueError, match="at most 2 per prompt"):
        llm.chat(user("x", png(1), png(2), png(3)), GREEDY)
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\].type"):
        llm.chat([{"role": "user", "content": [{"type": "audio"}]}], GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_generate_command_takes_an_image(vl_model, tmp_path):
    (path := tmp_path / "a.png").write_bytes(png(1))
    out = subprocess.run([sys.executable, "-m", "slotserve.entrypoints.cli", "--log-level", "WARNING", "generate",
                          "--model", str(vl_model), "--image", str(path), "--chat", "--temperature", "0",
                          "--max-tokens", "4", "--kv-cache-memory", "16M", "What is this?"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()


@pytest.fixture(scope="module")
def server(vl_model):
    s = Server(vl_model, "--limit-mm-per-prompt", "2")
    yield s
    s.stop()


def test_openai_client_sends_an_image_and_gets_the_offline_tokens(server, llm):
    image = png(5)
    result = llm.chat(user("Describe it.", image), GREEDY)[0]
    offline = result.outputs[0]
    client = server.client()
    reply = client.chat.completions.create(model=MODEL, messages=user("Describe it.", image), temperature=0,
                                           max_tokens=12, extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == offline.text
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model=MODEL, messages=user("Describe it.", image), temperature=0, max_tokens=12, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == offline.text
    assert reply.usage.prompt_tokens == len(result.prompt_token_ids)  # the image's tokens counted


@pytest.mark.parametrize("messages,match", [
    (user("x", b"\x89PNG garbage"), "cannot decode"),
    (user("x", png(1), png(2), png(3)), "at most 2 per prompt"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/a.png"}}]}],
     "data: URLs only"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "/etc/passwd"}}]}],
     "must be a data: or http"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "must be an object with a 'url'"),
])
def test_bad_images_get_a_400(server, messages, match):
    with pytest.raises(openai.BadRequestError, match=match):
        server.client(max_retries=0).chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert server.client().chat.completions.create(model=MODEL, messages=user("x", png(1)),
                                                   max_tokens=2).choices[0].message.content is not None


@pytest.mark.slow
def test_an_image_to_a_text_model_gets_a_400(tiny_qwen3):
    s = Server(tiny_qwen3)
    try:
        with pytest.raises(openai.BadRequestError, match="text model"):
            s.client(max_retries=0).chat.completions.create(model=MODEL, messages=user("x", png(1)), max_tokens=2)
    finally:
        s.stop()


@pytest.mark.slow
def test_bench_vision_prints_both_engines_figures(vl_model):
    out = subprocess.run([sys.executable, "-m", "slotserve.entrypoints.cli", "--log-level", "WARNING", "bench",
                          "vision", "-m", str(vl_model), "--image-size", "64", "--images", "2", "--repeats", "1",
                          "--prefill-precision", "bfloat16"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert_figures(figures, "slotserve.images_per_s", "slotserve.ttft_one_image_s", "transformers.images_per_s",
                   "transformers.ttft_one_image_s", "images_per_s_ratio", "ttft_ratio",
                   "slotserve_float32_tower.images_per_s", "slotserve_float32_tower.ttft_one_image_s",
                   "tower_speedup_over_float32")
    assert figures["slotserve"]["vision_dtype"] == "bfloat16"
    assert figures["tokens_per_image"] == 4 and figures["images_per_call"] == 2


@pytest.fixture
def image_site():
    """A real HTTP server on 127.0.0.1 with one small and one large image, and nothing else."""
    import http.server
    import threading

    files = {"/small.png": png(7, (40, 40)), "/large.png": png(8, (400, 400))}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = files.get(self.path)
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{site.server_address[1]}", files
    site.shutdown()


@pytest.mark.slow
def test_http_image_urls_are_fetched_when_allowed_within_the_size_cap(vl_model, image_site, llm):
    base, files = image_site
    s = Server(vl_model, "--allow-image-urls", "--max-image-bytes", "20K")
    try:
        client = s.client(max_retries=0)

        def ask(url: str) -> str:
            messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                     {"type": "text", "text": "Describe it."}]}]
            return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12,
                                                  extra_body={"ignore_eos": True}).choices[0].message.content

        assert ask(f"{base}/small.png") == llm.chat(user("Describe it.", files["/small.png"]),
                                                    GREEDY)[0].outputs[0].text
        with pytest.raises(openai.BadRequestError, match="over 20480 bytes"):
            ask(f"{base}/large.png")
        with pytest.raises(openai.BadRequestError, match="answered HTTP 404"):
            ask(f"{base}/missing.png")
    finally:
        s.stop()
