"""Speculative decoding's proposals: tokens guessed for a decoding sequence, which the target model's next step
verifies all at once (layers/verification.py keeps those it would have sampled). A CPU's decode step is
bound by reading the weights; it reads them once for every token it keeps.

- `NgramProposer` (prompt lookup): the tokens that followed the latest earlier occurrence of the sequence's last
  n tokens, the longest n first. Costs nothing where the output repeats its context (code edits, quotes).
- `DraftProposer`: a smaller model of the same tokenizer decodes greedily ahead. Its KV cache has as many blocks
  as the target's and uses the same block tables: a block the scheduler gives a sequence holds both models' keys
  of its positions, so one block pool accounts for both.
"""

from __future__ import annotations

import array
from collections.abc import Callable
from pathlib import Path

import torch

from slotserve.config import EngineConfig, ModelConfig, SpeculativeConfig, SpeculativeMethod
from slotserve.engine.model_runner import ModelRunner, ScheduledSeq, Want
from slotserve.engine.sequence import Sequence
from slotserve.layers.linear import Linear
from slotserve.model_store import resolve_model
from slotserve.models.fused_decode import MAX_TOKENS
from slotserve.models.loader import load_model
from slotserve.quantization.packed_linear import PAIR, PackedWeight

# A draft's catch-up of at most this many tokens (those a step kept, and its own) runs as decode rows: on the
# 0.5B, 5 tokens take 26 ms as rows, not as a prefill chunk.
CATCH_UP_ROWS = 8
SMOOTHING = 0.3  # the weight of a new step in a running average (a step's time, a sequence's kept proposals)


class DraftSlots:
    """How many proposed tokens each decoding sequence gets room for in a step: the K of 0..num_tokens that gives
    the most tokens a second, by the measured time of steps of as many decoding sequences with K slots, and the
    expected tokens each sequence keeps at its own acceptance so far. Proposals pay only where verifying K more
    rows costs less than the tokens they give: a step that reads the weights once for several rows does, one
    whose rows are bound by arithmetic (a large batch, or a CPU whose exact products cost by the row) does not,
    and then this keeps K at 0.
    Trying a K costs its steps, so a K is timed only while the K below it would lead if every proposal were kept,
    and once per K: another count of sequences takes its time at the nearest count measured, as its own plain
    step plus what K added there for each sequence (as sequences finish, each count would otherwise try every K
    again)."""

    WARM_UP = 2  # timed steps of each (sequences, K) before its time is trusted
    PROBE_EVERY = 64  # decisions between tries of another K, so a change in load is seen
    # Decisions between plain steps where proposals lead: the plain step's time is what every K is weighed
    # against, and one measured in a slow moment and never refreshed kept the 1.5B verifying at 0.81x.
    PLAIN_EVERY = 16

    def __init__(self, num_tokens: int, disable_by_batch_size: int | None, max_rows: int = MAX_TOKENS,
                 current: Callable[[list[Sequence]], bool] = lambda seqs: True) -> None:
        self.num_tokens, self.disable_by_batch_size, self.max_rows = num_tokens, disable_by_batch_size, max_rows
        # Whether proposing for these sequences now costs no more than it will next time (the proposer's
        # `current`): a probe is tried only then, not where a draft model would first catch up on its steps.
        self.current = current
        self.seconds: dict[tuple[int, int], float] = {}  # (decoding sequences, K) -> a step's time
        self.samples: dict[tuple[int, int], int] = {}
        self.decisions: dict[int, int] = {}

    def most(self, decoding: int, running: int) -> int:
        """The largest K allowed: all verify rows within `max_rows` (where the native decode step runs them), none
        from `disable_by_batch_size` running sequences on."""
        if not decoding or (self.disable_by_batch_size is not None and running >= self.disable_by_batch_size):
            return 0
        return max(0, min(self.num_tokens, self.max_rows // decoding - 1))

    def choose(self, decoding: list[Sequence], running: int) -> int:
        n, most = len(decoding), self.most(len(decoding), running)
        if most == 0:
            return 0
        rates: dict[int, float] = {}  # K -> expected tokens a second
        best: dict[int, float] = {}  # K -> tokens a second if every proposal were kept
        for k in range(most + 1):
            seconds = self.estimate(n, k)
            if seconds is None:
                if k == 0 or max(best, key=best.__getitem__) == k - 1:
                    return k
                break
            rates[k] = sum(expected_tokens(self.acceptance(s), k) for s in decoding) / seconds
            best[k] = n * (k + 1) / seconds
        made = self.decisions[n] = self.decisions.get(n, 0) + 1
        if made % self.PROBE_EVERY == 0 and self.current(decoding):
            return made // self.PROBE_EVERY % (most + 1)
        return 0 if made % self.PLAIN_EVERY == 0 else max(rates, key=rates.__getitem__)

    def estimate(self, n: int, k: int) -> float | None:
        """A step's time for n decoding sequences with k slots each: measured, else from the nearest count of
        sequences measured with k; None where neither is."""
        def measured(m: int, j: int) -> float | None:
            return self.seconds[(m, j)] if self.samples.get((m, j), 0) >= self.WARM_UP else None

        if (own := measured(n, k)) is not None or k == 0 or (plain := measured(n, 0)) is None:
            return own
        others = [m for m, j in self.seconds if j == k and measured(m, k) is not None and measured(m, 0)]
        if not others:
            return None
        m = min(others, key=lambda m: abs(m - n))
        # What k slots add to a step, by the sequence: verify rows and draft steps cost more by the row as rows
        # grow (the 1.5B's 16 rows cost 4x its one), so scaling the whole step by the plain steps' ratio would
        # promise a large batch a K that one sequence's cheap rows paid for.
        return plain + (self.seconds[(m, k)] - self.seconds[(m, 0)]) * n / m

    def record(self, decoding: int, k: int, seconds: float) -> None:
        """The time of a step of `decoding` sequences, all decoding, with room for k proposed tokens each."""
        key = (decoding, k)
        known, samples = self.seconds.get(key), self.samples.get(key, 0)
        # Until its time is trusted a step's time replaces the last: a K's first steps pay one-off costs.
        self.seconds[key] = seconds if samples < self.WARM_UP else known + SMOOTHING * (seconds - known)
        self.samples[key] = samples + 1

    def note(self, seq: Sequence, kept: int) -> None:
        """After a step kept `kept` of the sequence's proposals: the proposals checked are those kept and the one
        rejected, and a sequence given room but no proposal (no n-gram matched) counts as one proposal rejected,
        so that room is weighed by what it yields."""
        proposed = len(seq.draft_token_ids)
        tried = kept + (kept < proposed) if proposed else 1
        seq.draft_kept += SMOOTHING * (kept - seq.draft_kept)
        seq.draft_tried += SMOOTHING * (tried - seq.draft_tried)

    @staticmethod
    def acceptance(seq: Sequence) -> float:
        """How often a proposal of this sequence is kept, by its running sums. A sequence not yet given proposals
        counts as keeping them all, so that each is tried before it is judged: acceptance differs more between
        prompts (code edits 0.9, chat 0.6 with the 0.5B drafting) than any prior would say, and a draft model
        that is not proposing falls behind, so is not probed."""
        return seq.draft_kept / seq.draft_tried if seq.draft_tried else 1.0


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a verifying step gives a sequence with k proposals, each kept with probability `acceptance` while
    those before it were: 1 + a + a^2 + ... + a^k."""
    return sum(acceptance ** i for i in range(k + 1))


class NgramProposer:
    steady = True  # every proposal costs what the next one does (DraftProposer's may not)

    @staticmethod
    def current(seqs: list[Sequence]) -> bool:
        return True

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
        # Whether the last proposal computed only what a verify step leaves (not a prompt, nor the tokens of
        # steps decoded without proposals): a step's time says what its K costs only then.
        self.steady = True

    def propose(self, seqs: list[Sequence], slots: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        todo = list(range(len(seqs)))
        self.steady = self.current(seqs)
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
                # the few tokens a verify step kept go as decode rows of their own (the fused step), not as a chunk
                rows = take - 1 if done and take <= CATCH_UP_ROWS else 0
                batch.append((i, ScheduledSeq(seq.token_ids(start, start + take), start, seq.block_table,
                                              want=Want.GREEDY if done else Want.NONE, num_draft=rows)))
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

    @staticmethod
    def current(seqs: list[Sequence]) -> bool:
        """Whether the draft's cache is behind these sequences by no more than a verify step leaves."""
        return all(seq.num_tokens - seq.num_draft_computed <= CATCH_UP_ROWS for seq in seqs)

    def _run(self, batch: list[tuple[int, ScheduledSeq]], drafts: list[list[int]]) -> None:
        for (i, sched), result in zip(batch, self.runner.execute([s for _, s in batch]), strict=True):
            if sched.want is Want.GREEDY:
                drafts[i].append(result.tokens[-1])


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
    if config.speculative_config.draft_vocab_size is not None:
        cut_head(model, config.speculative_config.draft_vocab_size)
    return model, cfg


def cut_head(model: torch.nn.Module, vocab: int) -> None:
    """The model's output head cut to its first `vocab` token ids (down to whole pairs of rows where it is
    packed): a view of its weight or packing, the input embedding kept whole."""
    head = model.lm_head
    packed = head.weight is None
    rows = min(vocab - vocab % PAIR if packed else vocab, head.out_features)
    if rows == head.out_features:
        return
    if rows < 1:
        raise ValueError(f"speculative_config.draft_vocab_size: {vocab} leaves the draft no whole pair of "
                         f"{PAIR} head rows")
    cut = Linear(head.in_features, rows, bias=False, device="meta")
    if packed:
        cut.hold_packed(PackedWeight.of(head.packed.tensor().pairs(0, rows)))
    else:
        cut.weight = torch.nn.Parameter(head.weight[:rows], requires_grad=False)
    if head.bias is not None:
        cut.bias = torch.nn.Parameter(head.bias[:rows], requires_grad=False)
    model.lm_head = cut


def check_speculation(config: EngineConfig, target: ModelConfig) -> None:
    """ValueError where speculative decoding cannot run with this engine."""
    if target.vision is not None:
        raise ValueError("speculative_config: a vision-language model does not decode speculatively")
    if config.speculative_config.method is SpeculativeMethod.DRAFT_MODEL and config.tensor_parallel_size > 1:
        raise ValueError("speculative_config: a draft model runs with tensor_parallel_size 1 only")
