"""Batched token sampling with per-request state (penalty counts, a private random generator).

Order per row, as in vLLM V1: the grammar's mask (structured outputs), min_tokens masking (EOS and stop
tokens), logit_bias, repetition penalty, frequency and presence penalties; then greedy rows take the argmax, and
random rows apply temperature, min_p, top_k, top_p and draw with their own generator (one uniform per row per
step).

Returned logprobs are those of the model's raw distribution (log_softmax of the unprocessed
logits), vLLM V1's default: they describe what the model predicted, independent of how it was sampled.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field

import torch

from slotserve.kernels import norm_rotary_swiglu_argmax as kernels
from slotserve.outputs import Logprob, PositionLogprobs
from slotserve.sampling_params import SamplingParams
from slotserve.structured_outputs import Grammar
from slotserve.structured_outputs import mask_ as grammar_mask_

# top_k / top_p first look at this many of the highest logits (more only if a nucleus needs them).
_MIN_CANDIDATES = 64
# Logprob ranks are read off this many top logits when the chosen token is among them.
_RANK_CANDIDATES = 16
# Rows of prompt logits scored at once: a full log_softmax over a long prompt would not fit in memory.
_PROMPT_LOGPROBS_CHUNK = 256


@dataclass
class SamplingState:
    """One request's ("slot's") sampler state. The engine calls `append` after each sampled token."""

    params: SamplingParams
    generator: torch.Generator
    prompt_token_ids: list[int]
    eos_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    # Penalty bookkeeping, kept only when a penalty is set: the distinct tokens seen so far (the
    # prompt's too when repetition_penalty applies) and how often each occurs in the output, in
    # growable tensors, so a step touches those tokens rather than the whole vocabulary.
    seen_index: dict[int, int] | None = None  # token id -> index into the two tensors below
    seen_ids: torch.Tensor | None = None  # [capacity] int64
    seen_output_counts: torch.Tensor | None = None  # [capacity] float32
    grammar: Grammar | None = None  # structured outputs: what may come next

    @classmethod
    def new(
        cls,
        params: SamplingParams,
        prompt_token_ids: list[int],
        eos_token_ids: list[int],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> SamplingState:
        """`vocab_size` is the width of the logits rows (the model's padded vocabulary); `device` holds
        the penalty bookkeeping, next to the logits."""
        for name, ids in (("logit_bias", list(params.logit_bias or ())),
                          ("stop_token_ids", params.stop_token_ids), ("eos_token_ids", eos_token_ids)):
            bad = [i for i in ids if not 0 <= i < vocab_size]
            if bad:
                raise ValueError(f"{name}: token ids must be in [0, {vocab_size}), got {bad}")
        # On the CPU whatever the device: a step draws one number, and a seed gives the same stream
        # everywhere. Unseeded requests get a private generator too, so no request's draws depend
        # on who else is in the batch.
        generator = torch.Generator()
        generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
        state = cls(params, generator, list(prompt_token_ids), list(eos_token_ids))
        if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0 or params.repetition_penalty != 1.0:
            seen = list(dict.fromkeys(prompt_token_ids)) if params.repetition_penalty != 1.0 else []
            capacity = max(64, 2 * len(seen))
            state.seen_index = {t: i for i, t in enumerate(seen)}
            state.seen_ids = torch.zeros(capacity, dtype=torch.long, device=device)
            state.seen_ids[:len(seen)] = torch.tensor(seen, dtype=torch.long)
            state.seen_output_counts = torch.zeros(capacity, dtype=torch.float32, device=device)
        return state

    def append(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)
        if self.seen_index is None:
            return
        at = self.seen_index.get(token_id)
        if at is None:
            at = self.seen_index[token_id] = len(self.seen_index)
            if at == len(self.seen_ids):  # full: double, so appends stay O(1) amortised
                self.seen_ids = self.seen_ids.repeat(2)
                self.seen_output_counts = torch.cat([self.seen_output_counts, self.seen_output_counts * 0])
            self.seen_ids[at] = token_id
        self.seen_output_counts[at] += 1

    def takes_argmax(self) -> bool:
        """Whether the next token is the raw logits' argmax, with no logprobs asked: a greedy request
        that nothing processes (no penalty, bias or ban) at this step; the runner can pick it alone."""
        params = self.params
        return (params.greedy and params.logprobs is None and not params.logit_bias and self.seen_index is None
                and self.grammar is None and not self.banned_token_ids())

    def banned_token_ids(self) -> list[int]:
        """Tokens that may not be sampled at the next step: EOS and stop tokens until min_tokens.

        ignore_eos bans nothing (as in vLLM): EOS may be sampled, the engine just does not stop on it,
        so the tokens follow the model's own distribution."""
        if len(self.output_token_ids) < self.params.min_tokens:
            return self.eos_token_ids + self.params.stop_token_ids
        return []


@dataclass(frozen=True)
class Sampled:
    """A sequence's next token, and its logprobs where it asked for them."""

    token: int
    logprobs: PositionLogprobs | None = None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]  # per row; None where the request did not ask for logprobs


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of [B, V] logits (the first index among ties)."""
    # max(dim).indices is several times faster than torch's argmax on a CPU, and the native kernel ~5x
    # faster again.
    if logits.shape[1] and kernels.applies(logits):
        return kernels.argmax(logits)
    return logits.max(dim=-1).indices


class Sampler:
    """Picks one token per row of a [B, V] float32 logits batch; does not modify the logits."""

    def __call__(self, logits: torch.Tensor, states: list[SamplingState]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits: expected [{len(states)}, V], got {list(logits.shape)}")
        raw = logits
        logits = process_logits(logits.float(), states)
        random_rows = [i for i, s in enumerate(states) if not s.params.greedy]
        if len(random_rows) == len(states):
            token_ids = _sample(logits, states)
        else:
            token_ids = greedy(logits)
            if random_rows:
                rows = torch.tensor(random_rows, device=logits.device)
                token_ids[rows] = _sample(logits.index_select(0, rows), [states[i] for i in random_rows])
        tokens = token_ids.tolist()
        return SamplerOutput(tokens, sampled_logprobs(raw, tokens, states))


def stack_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """The rows [1, V] stacked: a view where they are consecutive rows of one tensor (the step's logits, when
    every sequence samples), else a copy. 32 rows of 152k logits took 6 ms to copy, 3 % of a step."""
    first = rows[0]
    step = first.stride(0) * first.element_size()
    if all(r.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() and r.stride() == first.stride()
           and r.data_ptr() == first.data_ptr() + i * step for i, r in enumerate(rows)):
        return first.as_strided((len(rows), first.shape[1]), first.stride(), first.storage_offset())
    return torch.cat(rows)


def prompt_logprobs(logits: torch.Tensor, prompt_token_ids: list[int], k: int) -> list[PositionLogprobs | None]:
    """Score each prompt token given the logits of the position before it.

    `logits` holds one row per prompt position (the last row, which predicts the first output token,
    may be left out). Position 0 has no predecessor and gets None.
    """
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("prompt_token_ids: must not be empty")
    if logits.dim() != 2 or logits.shape[0] not in (n, n - 1):
        raise ValueError(f"logits: expected [{n} or {n - 1}, V] for {n} prompt tokens, got {list(logits.shape)}")
    result: list[PositionLogprobs | None] = [None]
    for start in range(0, n - 1, _PROMPT_LOGPROBS_CHUNK):
        end = min(start + _PROMPT_LOGPROBS_CHUNK, n - 1)
        result += _position_logprobs(logits[start:end].float(), prompt_token_ids[start + 1:end + 1],
                                     [k] * (end - start))
    return result


# ---- logits processing --------------------------------------------------------------------------


def process_logits(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """The processing that can change even a greedy pick: the grammar's mask (structured outputs), the
    min_tokens mask, logit_bias, then repetition, frequency and presence penalties. Returns a new tensor when
    anything applies."""
    constrained = [i for i, s in enumerate(states) if s.grammar is not None]
    if constrained:
        logits = logits.clone()
        grammar_mask_(logits, constrained, [states[i].grammar for i in constrained])
    rows, cols, values = [], [], []
    for i, s in enumerate(states):
        banned = s.banned_token_ids()
        rows += [i] * len(banned)
        cols += banned
        values += [float("-inf")] * len(banned)
        if s.params.logit_bias:
            rows += [i] * len(s.params.logit_bias)
            cols += s.params.logit_bias.keys()
            values += s.params.logit_bias.values()
    penalised = [i for i, s in enumerate(states) if s.seen_index]
    if not rows and not penalised:
        return logits
    if not constrained:
        logits = logits.clone()
    device = logits.device
    if rows:
        # Accumulate, so a bias on a banned token stays -inf.
        logits.index_put_(
            (torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
            torch.tensor(values, dtype=logits.dtype, device=device),
            accumulate=True,
        )
    if penalised:
        _penalise_(logits, [states[i] for i in penalised], penalised)
    return logits


def _penalise_(logits: torch.Tensor, states: list[SamplingState], rows: list[int]) -> None:
    """Repetition (prompt and output tokens), then frequency and presence (output tokens) penalties,
    in place on `logits[rows]`, over just the tokens each state has seen."""
    sizes = [len(s.seen_index) for s in states]
    total = sum(sizes)
    repeats = torch.tensor(sizes, device=logits.device)

    def per_token(values: list[float] | list[int], dtype: torch.dtype = logits.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=logits.device).repeat_interleave(repeats, output_size=total)

    index = (per_token(rows, torch.long), torch.cat([s.seen_ids[:n] for s, n in zip(states, sizes, strict=True)]))
    counts = torch.cat([s.seen_output_counts[:n] for s, n in zip(states, sizes, strict=True)])
    values = logits[index]
    rep = per_token([s.params.repetition_penalty for s in states])
    # Dividing positive and multiplying negative logits both make a seen token less likely.
    values = torch.where(values > 0, values / rep, values * rep)
    values -= per_token([s.params.frequency_penalty for s in states]) * counts
    values -= per_token([s.params.presence_penalty for s in states]) * (counts > 0)
    logits[index] = values


# ---- random sampling ----------------------------------------------------------------------------


def _sample(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Temperature, min_p, top_k, top_p, then one draw per row from the row's own generator."""
    params = [s.params for s in states]
    x = _scaled(logits, params)
    uniform = draw_uniform(states, logits.device)
    truncated = _truncated(params, x.shape[-1])
    if len(truncated) == len(states):
        return _sample_top_k_top_p(x, params, uniform)
    if truncated:
        idx = torch.tensor(truncated, device=logits.device)
        picked = _sample_top_k_top_p(x.index_select(0, idx), [params[i] for i in truncated], uniform[idx])
    # softmax rather than exp_: a standalone exp is many times slower on far-negative or -inf inputs.
    token_ids = draw(x.softmax(dim=-1).cumsum_(dim=-1), uniform)
    if truncated:
        token_ids[idx] = picked
    return token_ids


def draw_uniform(states: list[SamplingState], device: torch.device) -> torch.Tensor:
    """One uniform number per row from the row's own generator."""
    return torch.tensor([torch.rand((), generator=s.generator).item() for s in states], device=device)


def _scaled(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Logits over temperature, with min_p's cut at -inf: a copy of the caller's rows, so later steps may work in
    place."""
    device = logits.device
    x = logits / torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    if any(p.min_p > 0 for p in params):
        # p_i < min_p * p_max  <=>  logit_i < max logit + log(min_p): no softmax over the vocabulary.
        log_min_p = torch.tensor([math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], device=device)
        x.masked_fill_(x < x.amax(dim=-1, keepdim=True) + log_min_p.unsqueeze(1), float("-inf"))
    return x


def _truncated(params: list[SamplingParams], vocab: int) -> list[int]:
    """The rows that top_k or top_p cut."""
    return [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]


def draw(cdf: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: per row, the first index whose (unnormalised) cumulative mass exceeds
    uniform * total. One number per row, where the exponential trick needs a row of noise, which on a
    CPU costs more than the rest of sampling."""
    total = cdf[:, -1]
    # Strictly below the total, so the pick is a token whose probability is not zero.
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)


def _sample_top_k_top_p(x: torch.Tensor, params: list[SamplingParams], uniform: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k tokens, then the smallest set of them reaching top_p, and draw from those."""
    probs, ids = _nucleus(x, params)
    return ids.gather(1, draw(probs.cumsum_(dim=-1), uniform).unsqueeze(1)).squeeze(1)


def _nucleus(x: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's candidates (ids [B, C], highest first) and their probabilities, zero where top_k or top_p drops
    them (not renormalised).

    Works on the highest candidates, not on a sort of the whole vocabulary (several ms per row on a
    CPU); the candidate set grows until it holds every row's nucleus.
    """
    vocab = x.shape[-1]
    device = x.device
    k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device).unsqueeze(1)
    top_p = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
    # The top-p mass is over the top-k tokens when top_k is set, otherwise over the whole row.
    full_probs = x.softmax(dim=-1) if any(p.top_k == 0 for p in params) else None
    candidates = min(vocab, max([_MIN_CANDIDATES] + [p.top_k for p in params]))
    while True:
        values, ids = _ranked_candidates(x, candidates)
        probs = values.masked_fill_(torch.arange(candidates, device=device) >= k, float("-inf")).softmax(dim=-1)
        if full_probs is not None:
            probs = torch.where(k < vocab, probs, full_probs.gather(1, ids))
        mass = probs.cumsum(dim=-1)
        covered = (k < vocab) | (top_p == 1.0) | (mass[:, -1:] >= top_p)
        if candidates == vocab or bool(covered.all()):
            break
        candidates = min(vocab, candidates * 8)
    # Keep a token while the mass ranked strictly above it is below top_p (so the first always stays).
    probs.masked_fill_((mass - probs >= top_p) & (top_p < 1.0), 0.0)
    return probs, ids


def _ranked_candidates(logits: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `n` highest logits per row, descending; equal logits in id order, as argmax breaks ties."""
    values, ids = logits.topk(n, dim=-1)
    ids, by_id = ids.sort(dim=-1)
    values, by_value = values.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(-1, by_value)


# ---- logprobs -----------------------------------------------------------------------------------


def sampled_logprobs(
    raw_logits: torch.Tensor, tokens: list[int], states: list[SamplingState]
) -> list[PositionLogprobs | None]:
    wanted = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    result: list[PositionLogprobs | None] = [None] * len(states)
    if not wanted:
        return result
    rows = raw_logits.index_select(0, torch.tensor(wanted, device=raw_logits.device)).float()
    ks = [states[i].params.logprobs for i in wanted]
    for i, entry in zip(wanted, _position_logprobs(rows, [tokens[i] for i in wanted], ks), strict=True):
        result[i] = entry
    return result


def _position_logprobs(logits: torch.Tensor, chosen: list[int], ks: list[int]) -> list[PositionLogprobs]:
    """For each row of raw logits: the chosen token plus the row's top-k alternatives, with their
    log_softmax values and ranks. Rank = 1 + number of tokens with a strictly greater logprob, so tied
    tokens share a rank."""
    logprobs = torch.log_softmax(logits, dim=-1)
    top_lp, top_ids = logprobs.topk(min(logits.shape[-1], max(*ks, _RANK_CANDIDATES)), dim=-1)
    # Sorted descending, so only earlier entries of the top list can be strictly greater.
    top_rank = (top_lp.unsqueeze(1) > top_lp.unsqueeze(2)).sum(dim=2) + 1
    chosen_t = torch.tensor(chosen, device=logits.device).unsqueeze(1)
    chosen_lp = logprobs.gather(1, chosen_t)
    # Everything above the chosen token is in the top list when the chosen token is; only other
    # rows need a count over the whole vocabulary.
    chosen_rank = (top_lp > chosen_lp).sum(dim=1) + 1
    outside = (top_ids != chosen_t).all(dim=1).nonzero().squeeze(1)
    if len(outside):
        chosen_rank[outside] = (logprobs[outside] > chosen_lp[outside]).sum(dim=1) + 1
    rows = zip(chosen, chosen_lp.squeeze(1).tolist(), chosen_rank.tolist(), top_ids.tolist(),
               top_lp.tolist(), top_rank.tolist(), ks, strict=True)
    result = []
    for token, lp, rank, ids, lps, ranks, k in rows:
        entry = {token: Logprob(lp, rank)}
        for t, t_lp, t_rank in zip(ids[:k], lps[:k], ranks[:k], strict=True):
            entry.setdefault(t, Logprob(t_lp, t_rank))
        result.append(entry)
    return result
