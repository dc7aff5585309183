"""The tokens a step gives each sequence, with or without proposed (draft) tokens: speculative decoding's
verification, and plain sampling as its case of no drafts.

A sequence with drafts d_1..d_k computed k+1 rows: row j predicts what follows d_j (row 0: what follows its
last token). Rows are taken in order, each sampled exactly as the sequence would sample it without speculation
(by the sampling state as it stands after the tokens taken before it: penalties, the grammar, min_tokens, one
uniform number of its generator), and d_{j+1} is kept while it is the token sampled. For a proposal of one token
(q = 1 at d) this is rejection sampling: d is kept with probability p(d) = min(1, p(d)/q(d)), and a rejected row's
token is distributed as p with d taken out, renormalised, max(p - q, 0)'s residue. Drawn this way, a seeded
request's tokens are the same whatever was proposed, however many proposals, or none. The first rejection ends
the sequence's tokens of the step; one whose drafts are all kept takes its last row's token too (the bonus).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from slotserve.layers.sampler import Sampled, Sampler, SamplingState, stack_rows

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
        taken = {i: Sampled(picks[i][j]) for i in going if picks[i] is not None}
        sampled = [i for i in going if i not in taken]
        if sampled:
            out = sampler(stack_rows([rows[i][j:j + 1] for i in sampled]), [states[i] for i in sampled])
            taken.update((i, Sampled(t, lp)) for i, t, lp in zip(sampled, out.token_ids, out.logprobs, strict=True))
        going = [i for i in going
                 if append(i, taken[i]) and j < len(drafts[i]) and taken[i].token == drafts[i][j]]
        j += 1
