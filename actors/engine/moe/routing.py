"""The routing rule, defined once: router logits (+ a bias table row, + a budget mask) -> experts.

Mental model: selection and weighting are separate, as in auxiliary-loss-free balancing. The bias
and the mask decide *which* k experts a token goes to (top-k of logits + bias among the allowed
ones); the weights are always the unbiased softmax probabilities of the chosen experts,
renormalised over them (Mixtral). With no bias and no mask this is exactly Mixtral's top-k, bit
for bit, so a zero table changes nothing. The layer, the trial of candidate tables and the
benches all call `route`, so they agree on what a table does.
"""

from __future__ import annotations

from typing import Protocol

import torch


def route(logits: torch.Tensor, top_k: int, bias: torch.Tensor | None = None,
          allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] float32; bias [E] or None; allowed [T, E] bool or None (True: the token may use
    the expert; every row must allow >= top_k). Returns (weights [T, k] float32 summing to 1 per row,
    experts [T, k] int64)."""
    probs = torch.softmax(logits, dim=-1)  # [T, E]
    if bias is None and allowed is None:
        top_w, top_e = probs.topk(top_k, dim=-1)
    else:
        scores = logits if bias is None else logits + bias
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        top_e = scores.topk(top_k, dim=-1).indices
        top_w = probs.gather(1, top_e)
    return top_w / top_w.sum(-1, keepdim=True), top_e


def expert_counts(top_e: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert [E] (int64; a token counts once per chosen expert)."""
    return torch.bincount(top_e.flatten(), minlength=num_experts)


def imbalance(counts: torch.Tensor | list[float]) -> float:
    """max/mean of per-expert loads: 1.0 is perfectly even, E means one expert takes everything;
    1.0 when nothing was routed."""
    c = torch.as_tensor(counts, dtype=torch.float64)
    mean = float(c.mean()) if c.numel() else 0.0
    return float(c.max()) / mean if mean > 0 else 1.0


def dense_weights(top_w: torch.Tensor, top_e: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The sparse mixture as a dense [T, E] matrix (0 for experts not chosen)."""
    return torch.zeros(top_w.shape[0], num_experts, dtype=top_w.dtype, device=top_w.device).scatter_(1, top_e, top_w)


class ExpertRouter(Protocol):
    """What a `SparseMoE` layer asks for its experts once a `MoEControl` is bound to it."""

    def route(self, layer: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
