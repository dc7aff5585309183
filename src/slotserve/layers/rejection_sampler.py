"""The tokens a step gives each sequence, with or without proposed (draft) tokens: speculative decoding's
verification, and plain sampling as its case of no drafts.

A sequence with drafts d_1..d_k computed k+1 rows: row j predicts what follows d_j (row 0: what follows its
last token). Rows are taken in order, each by the sampling state as it stands after the tokens taken before it
(penalties, the grammar, min_tokens), so every token comes from the distribution the sequence would sample it
from without speculation:
- a greedy row takes its processed argmax; d_{j+1} is kept while it equals it;
- a random row keeps d_{j+1} with probability p(d_{j+1}), p the row's distribution after temperature, min_p,
  top_k and top_p (the proposals are one token each, q = 1 at d: min(1, p/q) = p(d)); on rejection it draws
  from p with d_{j+1} taken out, renormalised: max(p - q, 0)'s normalised residue;
- the first rejection ends the sequence's tokens of the step; a sequence whose drafts are all kept samples one
  more token from its last row (the bonus), as plain sampling does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from slotserve.layers.sampler import (
    Sampled,
    Sampler,
    SamplingState,
    draw,
    draw_uniform,
    greedy,
    probabilities,
    process_logits,
    sampled_logprobs,
    stack_rows,
)

# append(i, sampled) takes sequence i's next token and says whether it goes on (a stop ends it).
Append = Callable[[int, Sampled], bool]


def sample_and_verify(sampler: Sampler, rows: list[torch.Tensor | None], picks: list[list[int] | None],
                      drafts: list[list[int]], states: list[SamplingState | None], append: Append) -> None:
    """Gives each sequence with a state its tokens through `append`, in order: the drafts it keeps, then one token
    of its own. rows[i]: its rows of logits [len(drafts[i]) + 1, V]; or picks[i]: the argmax of each row, where
    the step took it (a greedy sequence that nothing processes)."""
    going = [i for i, state in enumerate(states) if state is not None]
    j = 0
    while going:
        taken: dict[int, Sampled] = {}
        for i in going:
            if picks[i] is not None:
                taken[i] = Sampled(picks[i][j])
        bonus = [i for i in going if i not in taken and j == len(drafts[i])]
        if bonus:
            out = sampler(stack_rows([rows[i][j:j + 1] for i in bonus]), [states[i] for i in bonus])
            taken.update((i, Sampled(t, lp)) for i, t, lp in zip(bonus, out.token_ids, out.logprobs, strict=True))
        drafted = [i for i in going if i not in taken]
        if drafted:
            raw = stack_rows([rows[i][j:j + 1] for i in drafted])
            tokens = _verify_row(raw, [drafts[i][j] for i in drafted], [states[i] for i in drafted])
            logprobs = sampled_logprobs(raw, tokens, [states[i] for i in drafted])
            taken.update((i, Sampled(t, lp)) for i, t, lp in zip(drafted, tokens, logprobs, strict=True))
        going_on = []
        for i in going:
            sampled = taken[i]
            if append(i, sampled) and j < len(drafts[i]) and sampled.token == drafts[i][j]:
                going_on.append(i)
        going, j = going_on, j + 1


def _verify_row(raw: torch.Tensor, proposed: list[int], states: list[SamplingState]) -> list[int]:
    """Per row: its proposed token where kept, else the token drawn in its place."""
    logits = process_logits(raw.float(), states)
    tokens = greedy(logits).tolist()
    random_rows = [r for r, s in enumerate(states) if not s.params.greedy]
    if not random_rows:
        return tokens
    idx = torch.tensor(random_rows, device=logits.device)
    probs = probabilities(logits.index_select(0, idx), [states[r] for r in random_rows])
    kept = draw_uniform([states[r] for r in random_rows], logits.device).tolist()
    for n, r in enumerate(random_rows):
        d = proposed[r]
        if kept[n] < float(probs[n, d]):
            tokens[r] = d
            continue
        residue = probs[n:n + 1].clone()
        residue[0, d] = 0.0
        tokens[r] = int(draw(residue.cumsum_(dim=-1), draw_uniform([states[r]], logits.device))[0])
    return tokens
