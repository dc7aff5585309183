"""Tokenizer and chat template: Hugging Face `tokenizers` plus a Jinja environment that renders
chat templates the way `transformers`' `apply_chat_template` does (same filters, globals, options)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


class TokenizerError(ValueError):
    """Tokenizer files are missing or malformed, or a chat cannot be rendered."""


@dataclass
class SpecialTokens:
    eos_token: str | None = None
    bos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None

    def as_template_vars(self) -> dict[str, str]:
        return {k: v for k, v in vars(self).items() if v is not None}


@dataclass
class Tokenizer:
    """Encodes, decodes and renders chats. Built from a model directory or from GGUF metadata."""

    backend: HFTokenizer
    chat_template: str | None = None
    special: SpecialTokens = field(default_factory=SpecialTokens)
    name: str = ""

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"{tok_file}: not found; slotserve needs a fast tokenizer (tokenizer.json)")
        try:
            backend = HFTokenizer.from_file(str(tok_file))
        except Exception as e:
            raise TokenizerError(f"{tok_file}: cannot be parsed ({e})") from None
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        special = SpecialTokens(**{k: _token_content(cfg.get(k)) for k in vars(SpecialTokens())})
        return cls(backend=backend, chat_template=template, special=special, name=str(path))

    # ---- encoding -----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """TokenizerError for text that is not valid Unicode (a lone surrogate)."""
        try:
            if len(text) < _LONG_TEXT:
                return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
            # The batch call releases the GIL; the single one holds it for the whole text.
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        except TypeError:
            if isinstance(text, str) and not _is_valid_unicode(text):
                raise TokenizerError("prompt: the text is not valid Unicode (it holds a lone surrogate)") from None
            raise

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for (a byte-level token's string has one per byte)."""
        return max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(t_id for t_id, t in self.backend.get_added_tokens_decoder().items() if t.special)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.special.eos_token) if self.special.eos_token else None

    # ---- chat ---------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation to the prompt text, exactly as `transformers` would."""
        if self.chat_template is None:
            raise TokenizerError(f"{self.name or 'tokenizer'}: the model has no chat template; use a plain prompt")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise TokenizerError("messages: must be a list of objects with 'role' and 'content'")
        messages = [_alias_reasoning({k: v for k, v in m.items() if v is not None}) for m in messages]
        variables = {**self.special.as_template_vars(), **template_kwargs}
        try:
            return self._template.render(
                messages=messages, tools=tools, documents=None,
                add_generation_prompt=add_generation_prompt, **variables,
            )
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template: {e}") from None

    @cached_property
    def _template(self) -> jinja2.Template:
        return _jinja_env().from_string(self.chat_template)


# Texts from this many characters on are encoded through the call that lets other threads run meanwhile.
_LONG_TEXT = 1 << 14


def _is_valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    # Templates read the reasoning under different names; transformers fills them all from any one.
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` without dunder attributes, so a template cannot reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set attribute {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes; chat templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = dict
    env.globals["namespace"] = _TemplateNamespace
    return env
