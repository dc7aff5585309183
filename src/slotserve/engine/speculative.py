"""Speculative decoding's proposals: tokens guessed for a decoding sequence, which the target model's next step
verifies all at once (layers/rejection_sampler.py keeps those it would have sampled). A CPU's decode step is
bound by reading the weights; it reads them once for every token it keeps.

- `NgramProposer` (prompt lookup): the tokens that followed the latest earlier occurrence of the sequence's last
  n tokens, the longest n first. Costs nothing where the output repeats its context (code edits, quotes).
- `DraftProposer`: a smaller model of the same tokenizer decodes greedily ahead. Its KV cache has as many blocks
  as the target's and uses the same block tables: a block the scheduler gives a sequence holds both models' keys
  of its positions, so one block pool accounts for both.
"""

from __future__ import annotations

import array
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from slotserve.config import EngineConfig, ModelConfig, SpeculativeConfig, SpeculativeMethod
from slotserve.engine.model_runner import ModelRunner, ScheduledSeq, Want
from slotserve.engine.sequence import Sequence
from slotserve.model_store import resolve_model
from slotserve.models.fused_decode import MAX_TOKENS
from slotserve.models.loader import load_model

logger = logging.getLogger("slotserve")


@dataclass(frozen=True)
class DraftSlots:
    """How many proposed tokens the scheduler leaves room for per decoding sequence and step."""

    num_tokens: int  # the most per sequence
    disable_by_batch_size: int | None  # none from this many running sequences on; None: by `max_rows`
    max_rows: int = MAX_TOKENS  # the most rows a step verifies: where the native decode step runs them all

    def per_sequence(self, decoding: int, running: int) -> int:
        if not decoding or (self.disable_by_batch_size is not None and running >= self.disable_by_batch_size):
            return 0
        return max(0, min(self.num_tokens, self.max_rows // decoding - 1))


class NgramProposer:
    def __init__(self, spec: SpeculativeConfig) -> None:
        self.min_n, self.max_n = spec.prompt_lookup_min, spec.prompt_lookup_max

    def propose(self, seqs: list[Sequence], slots: list[int]) -> list[list[int]]:
        return [ngram_lookup(seq.prompt_token_ids + seq.output_token_ids, k, self.min_n, self.max_n)
                for seq, k in zip(seqs, slots, strict=True)]


def ngram_lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens, for the largest n in
    [min_n, max_n] that occurs; [] where none does. The search runs on the tokens' bytes (bytes.rfind), a C loop."""
    data = array.array("i", tokens).tobytes()
    size = array.array("i").itemsize
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        pattern = data[-n * size:]
        end = (len(tokens) - 1) * size  # an occurrence is followed by a token at least: it ends before the last
        while (at := data.rfind(pattern, 0, end)) >= 0:
            if at % size == 0:
                start = at // size + n
                return tokens[start:start + k]
            end = at + len(pattern) - 1  # a match across token boundaries: look further back
    return []


class DraftProposer:
    """The draft model's runner. A sequence's draft cache is valid for its first `num_draft_computed` tokens:
    each proposal first computes the tokens since (the whole prompt, the first time), then one token a step."""

    def __init__(self, runner: ModelRunner, chunk: int) -> None:
        self.runner, self.chunk = runner, chunk

    def propose(self, seqs: list[Sequence], slots: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        todo = list(range(len(seqs)))
        while todo:  # catch up, in steps of at most `chunk` tokens
            batch, later, room = [], [], self.chunk
            for i in todo:
                seq = seqs[i]
                start, end = seq.num_draft_computed, seq.num_tokens
                take = min(end - start, room)
                if take <= 0:
                    later.append(i)
                    continue
                done = start + take == end
                batch.append((i, ScheduledSeq(seq.token_ids(start, start + take), start, seq.block_table,
                                              want=Want.GREEDY if done else Want.NONE)))
                seq.num_draft_computed += take
                room -= take
                if not done:
                    later.append(i)
            self._run(batch, drafts)
            todo = later
        for j in range(1, max(slots, default=0)):  # then greedy decode steps
            self._run([(i, ScheduledSeq(drafts[i][-1:], seq.num_tokens - 1 + j, seq.block_table, want=Want.GREEDY))
                       for i, seq in enumerate(seqs) if slots[i] > j], drafts)
            for i, seq in enumerate(seqs):
                seq.num_draft_computed += slots[i] > j
        return drafts

    def _run(self, batch: list[tuple[int, ScheduledSeq]], drafts: list[list[int]]) -> None:
        for (i, sched), result in zip(batch, self.runner.execute([s for _, s in batch]), strict=True):
            if sched.want is Want.GREEDY:
                drafts[i].append(result.tokens[0])


def load_draft(config: EngineConfig, target: ModelConfig, dtype: torch.dtype,
               device: torch.device) -> tuple[torch.nn.Module, ModelConfig]:
    """The draft model of `config.speculative_config`; ValueError where it cannot draft for `target`."""
    path = Path(resolve_model(config.speculative_config.model))
    model, cfg = load_model(path, dtype, device, config.max_model_len)
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model: {config.speculative_config.model} has a vocabulary of "
                         f"{cfg.vocab_size} tokens, the target model {target.vocab_size}: they must share a tokenizer")
    if cfg.vision is not None:
        raise ValueError("speculative_config.model: a vision-language model cannot draft")
    return model, cfg


def check_speculation(config: EngineConfig, target: ModelConfig) -> None:
    """ValueError where speculative decoding cannot run with this engine."""
    if target.vision is not None:
        raise ValueError("speculative_config: a vision-language model does not decode speculatively")
    if config.speculative_config.method is SpeculativeMethod.DRAFT_MODEL and config.tensor_parallel_size > 1:
        raise ValueError("speculative_config: a draft model runs with tensor_parallel_size 1 only")
