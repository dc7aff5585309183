"""Incremental detokenization with stop strings, safe for streaming.

Decoding uses a prefix/read-offset window (the method of HF's `DecodeStream` and vLLM's slow path):
only the last few tokens are decoded each step, starting one committed chunk back so the decoder
sees the context it needs, and text is committed only when it does not end in U+FFFD, i.e. when
no UTF-8 character is left split across tokens. Each step costs two decodes of a short window, not
of the whole output. It is written out here rather than taken from `DecodeStream` because the
engine needs what that lacks: a final flush of an incomplete tail, and a bound on the window when
the model keeps emitting bytes that never form valid UTF-8.

Stop strings are matched on the decoded text. Text that could still grow into a stop string is
held back, so streamed deltas never contain part of one, and their concatenation is `output_text`.
"""

from __future__ import annotations

from dataclasses import dataclass

from slotserve.sampling_params import SamplingParams
from slotserve.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# A UTF-8 character has at most 4 bytes, so at most 4 tokens; a longer undecodable run is invalid
# bytes, and is committed as U+FFFD rather than re-decoded on every step.
_MAX_PENDING_TOKENS = 8


@dataclass
class DetokenizerUpdate:
    text_delta: str
    stop_string: str | None = None  # set when a stop string matched: the request must finish


class DetokenizerFinishedError(RuntimeError):
    """Tokens were fed to a detokenizer whose request already finished."""


class IncrementalDetokenizer:
    """Turns one sequence's sampled tokens into text deltas, one `update` per engine step."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._stops: list[str] = params.stop
        self._include_stop = params.include_stop_str_in_output
        self._longest_stop = max(map(len, self._stops), default=0)
        self._stop_starts = {s[0] for s in self._stops}
        # Decode window: tokens from the prefix offset on; those before `_read` are already committed.
        self._window: list[int] = []
        self._read = 0
        self._prefix_text = ""
        self._held = ""  # committed text that may be the start of a stop string
        self._released: list[str] = []  # deltas, joined lazily by output_text
        self.finished = False

    @property
    def output_text(self) -> str:
        """Text released so far: without held-back text, and without a matched stop string unless
        include_stop_str_in_output. Equals the concatenation of all deltas."""
        if len(self._released) > 1:
            self._released = ["".join(self._released)]
        return self._released[0] if self._released else ""

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> DetokenizerUpdate:
        """Feed this step's tokens. `stop_terminated`: the last id is the EOS or stop token that ends the
        request; it is left out of the text (unless include_stop_str_in_output) and the rest is flushed."""
        if self.finished:
            raise DetokenizerFinishedError("detokenizer: update after the request finished")
        if stop_terminated and not self._include_stop:
            new_token_ids = new_token_ids[:-1]
        self._window += new_token_ids
        return self._release(self._decode(final=stop_terminated), final=stop_terminated)

    def flush(self) -> DetokenizerUpdate:
        """Release everything held back: the request ended for another reason (length, abort).
        Idempotent: once finished it returns an empty delta."""
        if self.finished:
            return DetokenizerUpdate("")
        return self._release(self._decode(final=True), final=True)

    def _decode(self, final: bool) -> str:
        """Newly decodable text in the window; an incomplete trailing character waits unless `final`."""
        window = self._window
        if len(window) == self._read:
            return ""
        text = self._tokenizer.decode(window, skip_special_tokens=self._skip_special_tokens)
        if final or not text.endswith(_REPLACEMENT):
            return self._commit(len(window), text)
        # A character is split across the last tokens: commit up to the last token that completes one.
        # A UTF-8 character spans at most 4 tokens, so a few short decodes find the cut.
        for cut in range(len(window) - 1, max(self._read, len(window) - 4), -1):
            head = self._tokenizer.decode(window[:cut], skip_special_tokens=self._skip_special_tokens)
            if not head.endswith(_REPLACEMENT):
                return self._commit(cut, head)
        if len(window) - self._read <= _MAX_PENDING_TOKENS:
            return ""
        # Bytes that never form a character: commit them as U+FFFD and restart from nothing.
        delta = text[len(self._prefix_text):]
        self._window, self._read, self._prefix_text = [], 0, ""
        return delta

    def _commit(self, cut: int, text: str) -> str:
        """Commits window[:cut] (decoded as `text`); the tokens from the old read offset become the prefix."""
        delta = text[len(self._prefix_text):]
        self._window, self._read = self._window[self._read:], cut - self._read
        self._prefix_text = self._tokenizer.decode(self._window[:self._read],
                                                   skip_special_tokens=self._skip_special_tokens)
        return delta

    def _release(self, new_text: str, final: bool) -> DetokenizerUpdate:
        text = self._held + new_text
        stop = self._find_stop(text)
        if stop is not None:
            start, stop_string = stop
            delta = text[: start + len(stop_string) if self._include_stop else start]
            self._held = ""
            self.finished = True
            self._released.append(delta)
            return DetokenizerUpdate(delta, stop_string)
        keep = 0 if final else self._stop_prefix_len(text)
        delta, self._held = text[: len(text) - keep], text[len(text) - keep:]
        self.finished = final
        self._released.append(delta)
        return DetokenizerUpdate(delta)

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The stop string completed first in `text` (ties: the longest), as (index, stop string).

        Earliest end, not earliest start, so the result does not depend on how text arrives in chunks."""
        found = [(i, s) for s in self._stops if (i := text.find(s)) != -1]
        return min(found, key=lambda f: (f[0] + len(f[1]), f[0])) if found else None

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that some stop string starts with."""
        for start in range(max(0, len(text) - self._longest_stop + 1), len(text)):
            if text[start] in self._stop_starts:
                tail = text[start:]
                if any(s.startswith(tail) for s in self._stops):
                    return len(text) - start
        return 0
