"""`SparseMoE`: Mixtral's top-k routed SwiGLU experts.

Mental model: softmax over all experts, the top k chosen, their weights renormalised over the k;
experts run one by one on the tokens routed to them. Unbound, the layer is exactly that. Once a
`MoEControl` (control.py) binds itself (`routing`, `layer_index`), the choice goes through it: the
step's bias table, a request's expert budget, load counters and the logit sample (routing.py
has the rule). The weights are the same either way (weights.py names them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from actors.engine.config import ModelConfig
from actors.engine.moe.routing import ExpertRouter, route


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        self.num_experts = e
        self.top_k = cfg.num_experts_per_tok
        self.gate = nn.Linear(h, e, bias=False)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h))  # [E, gate|up, H]
        self.w2 = nn.Parameter(torch.empty(e, h, i))  # [E, H, I]
        self.layer_index = 0  # among the model's MoE layers; set with `routing`
        self.routing: ExpertRouter | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x).float()  # [T, E]
        if self.routing is None:
            top_w, top_e = route(logits, self.top_k)
        else:
            top_w, top_e = self.routing.route(self.layer_index, logits)  # [T, k] each
        top_w = top_w.to(x.dtype)
        out = torch.zeros_like(x)
        for expert in top_e.unique().tolist():
            rows, slot = (top_e == expert).nonzero(as_tuple=True)
            gate, up = F.linear(x[rows], self.w13[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[expert])
            out.index_add_(0, rows, y * top_w[rows, slot, None])
        return out
