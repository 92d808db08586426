"""Verification of drafted tokens against the target model's logits.

Mental model: a speculating row's verify forward yields k+1 logits rows, row i being the target's
distribution for the position after the i-th accepted draft. Two ways to turn them into tokens:

- Drafts that are single proposals (n-gram, greedy drafts): row i is sampled exactly as a plain
  decode step would sample that position (the same `Sampler`, the same per-position uniform), as if
  drafts 1..i were accepted; draft i+1 is accepted iff it equals that token, and the first token
  that differs (or, every draft accepted, the last row's) is the step's last token. This is
  rejection sampling with a point-mass proposal (accepted with probability p(draft), replaced by a
  draw from p without it), and since each token is drawn as plain decoding draws it, a seeded
  request emits the very same tokens with and without speculation; greedy ones too.
- Drafts sampled from a draft distribution q: standard speculative sampling. Draft d at row i is
  accepted with probability min(1, p(d)/q(d)); on rejection the token is drawn from the residual
  max(0, p - q), renormalised; with every draft accepted one more token is drawn from the last row.
  The output is distributed as plain sampling; its uniforms come from (seed, position) streams, so
  a seeded request is reproducible.
"""

from __future__ import annotations

import torch

from actors.engine.sampling import SamplingState, draw, filter_probs, process_logits, uniform_for

ACCEPT_STREAM = 0x6A09E667F3BCC909  # seeds the acceptance uniforms apart from the draws'
DRAFT_STREAM = 0xBB67AE8584CAA73B  # and a draft model's own draws apart from both


def draft_states(state: SamplingState, drafts: list[int]) -> list[SamplingState]:
    """The request as the sampler sees it at each of the k+1 verified positions: after 0..k drafts."""
    out = []
    for i in range(len(drafts) + 1):
        s = SamplingState(state.params, state.seed, state.prompt_token_ids, state.output_token_ids + drafts[:i])
        s._prompt_ids = state._prompt_ids  # the prompt's ids tensor is shared, not rebuilt per row
        out.append(s)
    return out


def num_matching(drafts: list[int], sampled: list[int]) -> int:
    """Drafts accepted: the leading ones equal to what plain sampling draws at their positions."""
    j = 0
    while j < len(drafts) and drafts[j] == sampled[j]:
        j += 1
    return j


def target_probs(logits: torch.Tensor, states: list[SamplingState], eos_token_ids: frozenset[int]) -> torch.Tensor:
    """The normalised distribution plain sampling draws from at each row [k+1, V] (temperature > 0)."""
    rows = [filter_probs(process_logits(row, s, eos_token_ids), s.params) for row, s in zip(logits, states)]
    probs = torch.stack(rows).double()
    return probs / probs.sum(dim=-1, keepdim=True)


def speculative_sample(p: torch.Tensor, q: torch.Tensor, drafts: list[int], seed: int, first_pos: int) -> list[int]:
    """Tokens of one row from target probs `p` [k+1, V] and draft probs `q` [k, V] (both normalised)
    for the `drafts` sampled from q; `first_pos` is the output position of the first draft."""
    out: list[int] = []
    for i, d in enumerate(drafts):
        pd, qd = float(p[i, d]), float(q[i, d])
        if qd > 0.0 and uniform_for(seed ^ ACCEPT_STREAM, first_pos + i) * qd < pd:
            out.append(d)
            continue
        residual = (p[i] - q[i].to(p.dtype)).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p <= q everywhere only when p == q: nothing to correct
            residual = p[i]
        out.append(draw(residual, uniform_for(seed, first_pos + i)))
        return out
    k = len(drafts)
    out.append(draw(p[k], uniform_for(seed, first_pos + k)))
    return out
