"""The built-in chat page at `/`, in a real headless Chromium against a real server (tiny Qwen3, with Qwen3's
reasoning parser and an API key): what the page shows must be what the server returns through the `openai` client
for the same greedy request."""

from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest
from playwright.sync_api import Page, sync_playwright

from tests.helpers import THINKING
from tests.servers import MODEL, Server
from tests.test_qwen3_vl_api import png

KEY = "page-secret"
ASK = "What is the capital of France?"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CITY = {"type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 12}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    srv = Server(tiny_qwen3, "--reasoning-parser", "qwen3", "--api-key", KEY)
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium")
    if chromium is None:
        if os.environ.get("CI"):  # CI installs it (.ci/run): missing there is a failure, not a skip
            pytest.fail("chromium is not installed")
        pytest.skip("chromium is not installed (apt-get install -y chromium chromium-driver)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True)
        yield browser
        browser.close()


def open_page(browser, server, key: str | None = KEY) -> tuple[Page, list[str]]:
    """A fresh browser context (its own localStorage) on the page, and the console errors it logs."""
    context = browser.new_context()
    if key is not None:  # as if typed on an earlier visit: the page keeps the key in localStorage
        context.add_init_script(f"localStorage.setItem('slotserve.api-key', {json.dumps(key)})")
    page = context.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    response = page.goto(server.url + "/")
    assert response.status == 200
    return page, errors


@pytest.fixture
def page(browser, server):
    page, errors = open_page(browser, server)
    page.wait_for_function("document.getElementById('model').textContent !== ''")
    yield page
    page.context.close()
    assert errors == []


def settings(page: Page, *, temperature: float = 0, max_tokens: int = 12, extra: dict | None = None) -> None:
    """Through the page's own controls, as a user sets them."""
    if page.get_attribute("#settings", "open") is None:
        page.click("#settings summary")
    page.fill("#temperature", str(temperature))
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#extra", json.dumps(extra) if extra else "")


def send(page: Page, text: str) -> dict:
    """Types and sends a message, waits for the answer to finish, and returns what its bubble shows."""
    page.fill("#prompt", text)
    page.click("#send")
    page.wait_for_selector("body[data-state=idle]")
    return page.locator(".msg.assistant").last.evaluate("""el => ({
        content: el.querySelector('.content').textContent,
        reasoning: el.querySelector('.reasoning').hidden ? null : el.querySelector('.reasoning .text').textContent,
        tools: [...el.querySelectorAll('.tool-call')].map(t => t.textContent),
        error: el.querySelector('.error')?.textContent ?? null})""")


def expected(server, messages, max_tokens=12, **extra):
    return server.client(api_key=KEY).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, extra_body=extra or None,
    ).choices[0].message


def test_page_loads_without_errors(page, server, tmp_path):
    assert page.text_content("#model") == MODEL
    card = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]
    assert card["input_modalities"] == ["text"] and page.is_hidden("#image-label")  # a text model: no image upload
    assert page.text_content("#notice") == ""
    shot = tmp_path / "chat.png"
    page.screenshot(path=str(shot), full_page=True)
    data = shot.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000, len(data)


def test_exchange_equals_the_api(page, server):
    settings(page)
    first = send(page, ASK)
    reply = expected(server, [{"role": "user", "content": ASK}])
    assert first["error"] is None and first["content"]
    assert (first["content"], first["reasoning"]) == (reply.content or "", reply.reasoning_content)

    # The second turn carries the first: the page keeps the conversation.
    second = send(page, "And of Spain?")
    history = [{"role": "user", "content": ASK}, {"role": "assistant", "content": first["content"]},
               {"role": "user", "content": "And of Spain?"}]
    assert second["content"] == (expected(server, history).content or "")

    page.click("#new-chat")
    assert page.locator(".msg").count() == 0
    assert send(page, ASK)["content"] == first["content"]


def test_reasoning_is_shown_in_its_own_block(page, server):
    # The grammar forces a think block then an answer, so the split is known (as in test_responses_api.py).
    settings(page, max_tokens=200, extra={"guided_grammar": THINKING})
    shown = send(page, ASK)
    reply = expected(server, [{"role": "user", "content": ASK}], max_tokens=200, guided_grammar=THINKING)
    assert reply.reasoning_content and reply.content
    assert (shown["reasoning"], shown["content"]) == (reply.reasoning_content, reply.content)
    block = page.locator(".msg.assistant .reasoning")
    assert block.evaluate("el => el.tagName") == "DETAILS"
    assert not block.evaluate("el => el.open")  # folded once the answer began; a click opens it
    block.locator("summary").click()
    assert block.evaluate("el => el.open")


def test_tool_calls_are_shown(page, server):
    settings(page, max_tokens=60, extra={"tools": TOOLS, "tool_choice": NAMED})
    shown = send(page, "What is the weather in Paris?")
    call = expected(server, [{"role": "user", "content": "What is the weather in Paris?"}], max_tokens=60,
                    tools=TOOLS, tool_choice=NAMED).tool_calls[0].function
    assert shown["tools"] == [f"get_weather({call.arguments})"] and shown["error"] is None


def test_stop_ends_a_running_answer(page, server):
    # Thinking off: the reasoning parser would hold back text that may yet turn out to be reasoning.
    settings(page, max_tokens=1000, extra={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
    # The tiny model writes 1000 tokens in about a second: Stop is clicked from the page, on the first text drawn.
    page.evaluate("""new MutationObserver((_, observer) => {
        if (document.querySelector('.msg.assistant .content')?.textContent) {
            observer.disconnect();
            document.getElementById('stop').click();
        }
    }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true})""")
    shown = send(page, ASK)
    assert page.locator(".msg.assistant .stopped").count() == 1 and shown["error"] is None
    assert 0 < len(shown["content"]) < 500, shown["content"]
    settings(page)  # the server is free again, and the stopped answer stays in the conversation
    history = [{"role": "user", "content": ASK}, {"role": "assistant", "content": shown["content"]},
               {"role": "user", "content": "And of Spain?"}]
    assert send(page, "And of Spain?")["content"] == (expected(server, history).content or "")


def test_api_key_is_asked_for(browser, server):
    page, errors = open_page(browser, server, key=None)
    for path in ("/static/chat.js", "/static/chat.css"):  # the page and its files load without the key
        assert httpx.get(server.url + path).status_code == 200
    page.wait_for_function("document.getElementById('notice').textContent.includes('API key')")
    settings(page)
    refused = send(page, ASK)
    assert refused["error"] == "401 AuthenticationError: missing or invalid API key"
    assert page.locator(".msg.user.unsent").count() == 1
    assert page.input_value("#prompt") == ASK  # put back, to send again

    page.fill("#api-key", KEY)
    page.click("#send")
    page.wait_for_selector("body[data-state=idle]")
    answer = page.locator(".msg.assistant").last.locator(".content").text_content()
    assert answer == (expected(server, [{"role": "user", "content": ASK}]).content or "")
    assert page.evaluate("localStorage.getItem('slotserve.api-key')") == KEY
    # Only the refused calls (/v1/models on load, the first message) logged errors.
    assert len(errors) == 2 and all("401" in e for e in errors), errors
    page.context.close()


def test_errors_from_the_server_are_shown(browser, server):
    # An HTTP 400 in OpenAI's error body, from the real server: an image sent to a text model.
    page, errors = open_page(browser, server)
    settings(page)
    page.evaluate("document.getElementById('image-label').hidden = false")  # as for a vision model
    page.set_input_files("#image", files=[{"name": "dot.png", "mimeType": "image/png", "buffer": png(0)}])
    with page.expect_request("**/v1/chat/completions") as request:
        shown = send(page, "What is this?")
    content = request.value.post_data_json["messages"][-1]["content"]
    assert content[0] == {"type": "text", "text": "What is this?"}
    assert content[1]["image_url"]["url"].startswith("data:image/png;base64,")
    assert shown["error"] == "400 BadRequestError: images: this is a text model; it takes no images"

    # An error event after the stream started (the shape serving.py sends): the text so far stays, the error shows.
    error = {"error": {"message": "the engine is not running", "type": "ServiceUnavailableError", "param": None,
                       "code": 503}}
    chunk = {"choices": [{"index": 0, "delta": {"content": "Par"}}]}
    body = "".join(f"data: {json.dumps(event)}\n\n" for event in (chunk, error)) + "data: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(body=body, content_type="text/event-stream"))
    shown = send(page, "Again?")
    assert (shown["content"], shown["error"]) == ("Par", "503 ServiceUnavailableError: the engine is not running")
    assert len(errors) == 1 and "400" in errors[0], errors  # the browser's own line for the refused request
    page.context.close()
