"""Request-level expert budgets: a request's decode tokens routed only among its prompt's top experts.

Mental model: a request with a budget of B experts gathers, while its prompt is computed, the
routing mass of its prompt tokens (the sum of their router probabilities, per layer and expert).
Once the prompt is done, its B experts of most mass per layer are fixed, and every later token of
the request (positions past the prompt) chooses its top-k among those B only; the prompt's own
tokens are never restricted. Fewer distinct experts per step means fewer expert weights read and
fewer expert calls when many requests of a batch favour the same few. A resume that recomputes its
prompt and its tokens so far (a recovery) has those tokens, which share the prompt's last chunk,
choose per layer from the mass that layer has just gathered: the same experts, so it goes on as
the first run would. A request resumed from KV computed elsewhere (no prompt seen here) runs
unrestricted.

Per step, `plan` gets the step's rows as `Segment`s in the order the runner lays tokens out; the
layers then call `observe` (prompt rows add mass) and `allowed` (a [T, E] mask or None). Across a
prefill -> decode handoff the choice travels with the request: `take_choice` on the prefill worker,
`give_choice` on the decode worker (the decode worker never sees the prompt's routing).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertBudgets:
    """Experts per layer a request's generated tokens may use: per request (set on the tracker),
    else per tenant, else `default`; None: unrestricted."""

    default: int | None = None
    by_tenant: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        for n in [self.default, *(n for _, n in self.by_tenant)]:
            if n is not None and n < 1:
                raise ValueError(f"an expert budget must be >= 1, got {n}")

    def of_tenant(self, tenant: str) -> int | None:
        return dict(self.by_tenant).get(tenant, self.default)

    def to_json(self) -> dict[str, object]:
        return {"default": self.default, "tenants": dict(self.by_tenant)}

    @classmethod
    def of(cls, default: int | None, tenants: dict[str, int]) -> "ExpertBudgets":
        return cls(default, tuple(sorted(tenants.items())))


@dataclass(frozen=True)
class Segment:
    """One request's rows of a step, in the runner's layout: `num_rows` rows from `first_row`, of
    which the first `num_prompt_rows` are prompt tokens."""

    request_id: str
    tenant: str
    first_row: int
    num_rows: int
    num_prompt_rows: int


class BudgetTracker:
    def __init__(self, num_layers: int, num_experts: int, top_k: int, budgets: ExpertBudgets | None = None) -> None:
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.budgets = budgets or ExpertBudgets()
        self._by_request: dict[str, int] = {}
        self._mass: dict[str, torch.Tensor] = {}  # request -> [L, E] float32 prompt routing mass
        self._chosen: dict[str, torch.Tensor] = {}  # request -> [L, E] bool, its experts per layer
        self._seen: set[str] = set()  # requests a step has carried (their per-request budget may go)
        self._gather: list[tuple[str, int, int]] = []  # this step: (request, first row, end row) adding mass
        # this step: (request, first row, end row, budget) of generated rows that follow the prompt's
        # last rows in the same chunk (a resume recomputing its tokens): each layer chooses for them
        # from the mass that layer has just gathered, as the next step would from the whole of it
        self._late: list[tuple[str, int, int, int]] = []
        self._rows: torch.Tensor | None = None  # this step's restricted rows [R]
        self._masks: torch.Tensor | None = None  # [L, R, E] their allowed experts

    def set_request_budget(self, request_id: str, num_experts: int | None) -> None:
        if num_experts is None:
            self._by_request.pop(request_id, None)
        else:
            self._by_request[request_id] = self._checked(num_experts)

    def _checked(self, n: int) -> int:
        if n < 1:
            raise ValueError(f"an expert budget must be >= 1, got {n}")
        return min(max(n, self.top_k), self.num_experts)  # top-k needs k allowed experts

    def budget_of(self, request_id: str, tenant: str) -> int | None:
        n = self._by_request.get(request_id, self.budgets.of_tenant(tenant))
        return None if n is None else self._checked(n)

    def plan(self, segments: Iterable[Segment], device: torch.device) -> None:
        """Lays out the next forward: which rows add prompt mass, which are restricted, to what."""
        self._gather, self._late, rows, masks = [], [], [], []
        for s in segments:
            self._seen.add(s.request_id)
            budget = self.budget_of(s.request_id, s.tenant)
            budgeted = budget is not None and budget < self.num_experts
            chosen = self._chosen.get(s.request_id)  # also one given by the prefill worker (`give_choice`)
            if budgeted and s.num_prompt_rows and chosen is None:
                if s.request_id not in self._mass:
                    self._mass[s.request_id] = torch.zeros(self.num_layers, self.num_experts, device=device)
                self._gather.append((s.request_id, s.first_row, s.first_row + s.num_prompt_rows))
            generated = s.num_rows - s.num_prompt_rows
            if budgeted and generated and chosen is None and s.num_prompt_rows:
                self._late.append((s.request_id, s.first_row + s.num_prompt_rows, s.first_row + s.num_rows,
                                   budget))  # type: ignore[arg-type]
            if budgeted and generated and chosen is None and s.request_id in self._mass and not s.num_prompt_rows:
                chosen = self._choose(s.request_id, budget)  # type: ignore[arg-type]
            if chosen is not None and generated:
                rows.extend(range(s.first_row + s.num_prompt_rows, s.first_row + s.num_rows))
                masks.extend([chosen] * generated)
        if rows:
            self._rows = torch.tensor(rows, dtype=torch.int64, device=device)
            self._masks = torch.stack(masks, dim=1).to(device)  # [L, R, E]
        else:
            self._rows = self._masks = None

    def _choose(self, request_id: str, budget: int) -> torch.Tensor:
        mass = self._mass.pop(request_id)
        top = mass.topk(budget, dim=-1).indices  # [L, B]
        chosen = torch.zeros_like(mass, dtype=torch.bool).scatter_(1, top, True)
        self._chosen[request_id] = chosen
        return chosen

    def observe(self, layer: int, probs: torch.Tensor) -> None:
        """probs [T, E]: this layer's router probabilities of the step's rows."""
        for request_id, start, end in self._gather:
            self._mass[request_id][layer] += probs[start:end].sum(0)

    def allowed(self, layer: int, num_rows: int) -> torch.Tensor | None:
        """[T, E] the experts each row may take at `layer`, or None: all. Call after this layer's
        `observe` (the rows of a resume's recomputed tokens choose from the mass it added)."""
        if (self._rows is None or self._masks is None) and not self._late:
            return None
        device = self._rows.device if self._rows is not None else self._mass[self._late[0][0]].device
        mask = torch.ones(num_rows, self.num_experts, dtype=torch.bool, device=device)
        if self._rows is not None and self._masks is not None:
            mask[self._rows] = self._masks[layer]
        for request_id, start, end, budget in self._late:
            mask[start:end] = False
            mask[start:end, self._mass[request_id][layer].topk(budget).indices] = True
        return mask

    @property
    def wants_probs(self) -> bool:
        return bool(self._gather)

    def take_choice(self, request_id: str, tenant: str = "") -> list[list[int]] | None:
        """A prefill worker's half of a handoff: the request's experts per layer, chosen now from the
        prompt mass gathered here (None: no budget, or no prompt computed here). Ship them with
        the KV; the decode worker calls `give_choice`."""
        budget = self.budget_of(request_id, tenant)
        if budget is None or budget >= self.num_experts or request_id not in self._mass:
            return None
        self._choose(request_id, budget)
        return self.experts_of(request_id)

    def give_choice(self, request_id: str, experts: list[list[int]]) -> None:
        """The decode worker's half: the request's generated tokens route only among `experts`."""
        assert len(experts) == self.num_layers and all(len(e) >= self.top_k for e in experts), experts
        chosen = torch.zeros(self.num_layers, self.num_experts, dtype=torch.bool)
        for layer, ids in enumerate(experts):
            chosen[layer, ids] = True
        self._chosen[request_id] = chosen

    def fits(self, experts: list[list[int]]) -> bool:
        """Whether `experts` is a choice this tracker can take: per layer, at least top-k distinct
        experts in range."""
        return len(experts) == self.num_layers and all(
            len(set(e)) >= self.top_k and all(0 <= i < self.num_experts for i in e) for e in experts)

    def forget(self, request_id: str) -> None:
        """Drops a request's budget, mass and choice now (one no step will carry: its handoff failed)."""
        self._seen.discard(request_id)
        for d in (self._mass, self._chosen, self._by_request):
            d.pop(request_id, None)

    def experts_of(self, request_id: str) -> list[list[int]] | None:
        """The request's experts per layer, once chosen."""
        chosen = self._chosen.get(request_id)
        return None if chosen is None else [row.nonzero().flatten().tolist() for row in chosen.cpu()]

    def retain(self, live: set[str]) -> None:
        """Forgets the requests a step carried that are no longer in `live` (the engine's). A budget or
        a choice given for a request no step has carried yet (a handoff still on its way) stays."""
        for request_id in [r for r in self._seen if r not in live]:
            self._seen.discard(request_id)
            for d in (self._mass, self._chosen, self._by_request):
                d.pop(request_id, None)

    @property
    def num_budgeted(self) -> int:
        return len(self._chosen)
