"""Trying a candidate routing table on a sample of live router logits, before anyone routes with it.

Mental model: the worker keeps recent router-logit rows of each layer (telemetry.LogitSample). Since
a table only changes which experts are chosen (routing.route), what a candidate would do to real
traffic can be computed from those rows alone, with no forward pass: how many (layer, token) rows
keep the same expert set as under the current table (agreement), how far the mixture weights move
(total variation between the dense weight vectors, 0..1), and the expert-load imbalance the sample
would show under each table. Rows are the layer's real inputs under the current table; a change of
routing in one layer also changes later layers' inputs, which this per-layer check does not see
(bench/moe.py measures the end-to-end token change).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from actors.engine.moe.routing import dense_weights, expert_counts, imbalance, route


@dataclass(frozen=True)
class Trial:
    num_rows: int  # sample rows over all layers
    agreement: float  # rows whose expert set is unchanged, over all rows (1.0: no row moves)
    divergence: float  # mean total variation distance between the rows' expert mixtures
    imbalance_current: float  # worst layer's max/mean load on the sample under the current table
    imbalance_candidate: float


def check_candidate(sample: Sequence[torch.Tensor], current: torch.Tensor, candidate: torch.Tensor,
                    top_k: int) -> Trial:
    """`sample[l]` [n_l, E] float32 logits of layer l; `current`, `candidate` [L, E] biases."""
    same = moved = 0.0
    rows = 0
    imb_now, imb_new = [], []
    num_experts = current.shape[1]
    for s, b_now, b_new in zip(sample, current, candidate):
        if not len(s):
            continue
        w0, e0 = route(s, top_k, b_now if b_now.any() else None)
        w1, e1 = route(s, top_k, b_new if b_new.any() else None)
        same += float((e0.sort(-1).values == e1.sort(-1).values).all(-1).sum())
        d0, d1 = dense_weights(w0, e0, num_experts), dense_weights(w1, e1, num_experts)
        moved += float((d0 - d1).abs().sum(-1).mul(0.5).sum())
        rows += len(s)
        imb_now.append(imbalance(expert_counts(e0, num_experts)))
        imb_new.append(imbalance(expert_counts(e1, num_experts)))
    if rows == 0:
        return Trial(0, 1.0, 0.0, 1.0, 1.0)
    return Trial(rows, same / rows, moved / rows, max(imb_now), max(imb_new))
