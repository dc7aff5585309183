"""Turns the engine core's token ids into what users see: incremental text, stop strings, logprobs,
grouped back into user requests (n sequences each)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from slotserve.engine.detokenizer import IncrementalDetokenizer
from slotserve.engine.protocol import EngineCoreOutput, ProcessedRequest
from slotserve.outputs import CompletionOutput, EmbeddingOutput, PositionLogprobs, RequestOutput
from slotserve.tokenizer import Tokenizer


@dataclass
class _Sequence:
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0  # what delta outputs have already handed out
    sent_chars: int = 0
    sent_logprobs: int = 0
    sent_finish: bool = False


@dataclass
class _Group:
    request: ProcessedRequest
    sequences: dict[str, _Sequence]
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    sent_prompt_logprobs: bool = False
    num_cached_tokens: int = 0
    num_saved_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences.values())


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    stopped: list[str]  # sequence ids finished here by a stop string: the core must finish them too
    embeddings: list[EmbeddingOutput] = field(default_factory=list)


class OutputProcessor:
    """`delta=False`: each RequestOutput holds everything so far; `delta=True`: only what is new: the
    sequences that changed, their new tokens and text, and no prompt (the receiver has it)."""

    def __init__(self, tokenizer: Tokenizer, delta: bool = False) -> None:
        self.tokenizer, self.delta = tokenizer, delta
        self._groups: dict[str, _Group] = {}
        self._owner: dict[str, str] = {}  # sequence id -> request id

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def add_request(self, request: ProcessedRequest) -> None:
        if request.request_id in self._groups:
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        sequences = {}
        for index, seq in enumerate(request.sequences):
            sequences[seq.request_id] = _Sequence(
                index, IncrementalDetokenizer(self.tokenizer, seq.params),
                logprobs=[] if seq.params.logprobs is not None else None)
            self._owner[seq.request_id] = request.request_id
        self._groups[request.request_id] = _Group(request, sequences)

    def abort_request(self, request_id: str) -> list[str]:
        """Forgets a request; returns its sequence ids still to be finished in the core."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return []
        for seq_id in group.sequences:
            self._owner.pop(seq_id, None)
        return [seq_id for seq_id, seq in group.sequences.items() if seq.finish_reason is None]

    def process(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        touched: dict[str, _Group] = {}
        stopped, embeddings = [], []
        now = time.monotonic()
        for out in outputs:
            request_id = self._owner.get(out.request_id)
            if request_id is None:
                continue  # aborted, or finished by a stop string while the core ran on
            group = self._groups[request_id]
            if out.embedding is not None:
                embeddings.append(EmbeddingOutput(request_id, group.request.prompt_token_ids, out.embedding,
                                                  num_cached_tokens=out.num_cached_tokens))
                self.abort_request(request_id)
                continue
            seq = group.sequences[out.request_id]
            if seq.finish_reason is not None:
                continue
            group.first_token_time = group.first_token_time or now
            if out.prompt_logprobs is not None:
                group.prompt_logprobs = [self._name_tokens(p) for p in out.prompt_logprobs]
            group.num_cached_tokens = out.num_cached_tokens
            group.num_saved_tokens = max(group.num_saved_tokens, out.num_saved_tokens)
            if self._update(seq, out):
                stopped.append(out.request_id)
            touched[request_id] = group
        results = [self._output(group) for group in touched.values()]
        for group in touched.values():
            if group.finished:
                self.abort_request(group.request.request_id)
        return ProcessedOutputs(results, stopped, embeddings)

    def _update(self, seq: _Sequence, out: EngineCoreOutput) -> bool:
        """Applies one core output; True when a stop string ended the sequence here. Its tokens (several where the
        core decodes speculatively) are taken one at a time, so a stop string ends the sequence at the token that
        completes it, as it would without speculation."""
        tokens = out.new_token_ids
        for k, token in enumerate(tokens):
            seq.token_ids.append(token)
            if out.new_logprobs is not None and seq.logprobs is not None:
                position = out.new_logprobs[k]
                seq.logprobs.append(self._name_tokens(position))
                seq.cumulative_logprob += position[token].logprob
            # An EOS or stop token ends the text before itself.
            ended_by_token = k == len(tokens) - 1 and out.finish_reason == "stop"
            update = seq.detokenizer.update([token], stop_terminated=ended_by_token)
            if update.stop_string is not None:
                seq.finish_reason, seq.stop_reason = "stop", update.stop_string
                return out.finish_reason is None
        if out.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
            seq.detokenizer.flush()
        return False

    def _name_tokens(self, position: PositionLogprobs | None) -> PositionLogprobs | None:
        for token_id, entry in (position or {}).items():
            entry.decoded_token = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return position

    def _output(self, group: _Group) -> RequestOutput:
        if self.delta:
            return self._delta(group)
        completions = [CompletionOutput(
            index=seq.index, text=seq.detokenizer.output_text, token_ids=list(seq.token_ids),
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None)
            for seq in group.sequences.values()]
        request = group.request
        return RequestOutput(
            request_id=request.request_id, prompt=request.prompt, prompt_token_ids=request.prompt_token_ids,
            outputs=completions, finished=group.finished, prompt_logprobs=group.prompt_logprobs,
            metrics=self._metrics(group), num_cached_tokens=group.num_cached_tokens,
            num_saved_tokens=group.num_saved_tokens,
        )

    def _delta(self, group: _Group) -> RequestOutput:
        """What is new since the last delta: sequences with no new tokens, text or finish are left out,
        so each sequence's finish_reason is sent exactly once."""
        completions = []
        for seq in group.sequences.values():
            text = seq.detokenizer.output_text
            finishing = seq.finish_reason is not None and not seq.sent_finish
            if len(seq.token_ids) == seq.sent_tokens and len(text) == seq.sent_chars and not finishing:
                continue
            completions.append(CompletionOutput(
                index=seq.index, text=text[seq.sent_chars:], token_ids=seq.token_ids[seq.sent_tokens:],
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                logprobs=seq.logprobs[seq.sent_logprobs:] if seq.logprobs is not None else None,
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None))
            seq.sent_chars, seq.sent_tokens = len(text), len(seq.token_ids)
            seq.sent_logprobs, seq.sent_finish = len(seq.logprobs or []), seq.finish_reason is not None
        prompt_logprobs = None
        if group.prompt_logprobs is not None and not group.sent_prompt_logprobs:
            prompt_logprobs, group.sent_prompt_logprobs = group.prompt_logprobs, True
        return RequestOutput(
            request_id=group.request.request_id, prompt=None, prompt_token_ids=[], outputs=completions,
            finished=group.finished, prompt_logprobs=prompt_logprobs, metrics=self._metrics(group),
            num_cached_tokens=group.num_cached_tokens, num_saved_tokens=group.num_saved_tokens,
        )

    @staticmethod
    def _metrics(group: _Group) -> dict[str, float]:
        if group.first_token_time is None:
            return {}
        return {"time_to_first_token": group.first_token_time - group.arrival_time}
