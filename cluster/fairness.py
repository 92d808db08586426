"""Fairness across tenants: weighted virtual token counters, kept in units of time.

Mental model (Virtual Clock, Zhang 1990; the token-counting form is VTC, Sheng et al., OSDI'24):
each tenant owns a counter `vc[t]` in seconds. Submitting a request of n tokens stamps it with the
start tag `max(now, vc[t])` and advances `vc[t]` by n / (the tenant's fair rate), where the fair
rate is the cluster's reference token rate times the tenant's share of the active weight. A tenant
sending within its share keeps `vc` near real time, so its tags are "now"; a tenant flooding the
cluster runs its counter into the future, and its requests' tags, used as priority, sort behind
everyone else's. Shares under contention therefore follow the weights, and nobody banks credit
by idling (the `max(now, ...)`).

The tag's lead over real time is combined with slack in `ordering.py`: a request's priority is
its urgency plus its tenant's lead, so within a fair share least-slack-first decides, and beyond
it the excess pushes the flooding tenant's requests back.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.descriptors import TenantId


@dataclass(slots=True)
class _Counter:
    weight: float
    vc_s: float
    num_active: int = 0
    served_tokens: float = 0.0


class FairShareClock:
    """Per-tenant virtual clocks. `reference_rate` is the cluster's token throughput (tokens/s);
    it only scales how fast a flooding tenant's tags run ahead, not the shares themselves."""

    def __init__(self, reference_rate_tokens_per_s: float) -> None:
        if not reference_rate_tokens_per_s > 0:
            raise ValueError("reference rate must be positive")
        self.reference_rate = reference_rate_tokens_per_s
        self._counters: dict[TenantId, _Counter] = {}
        self._active_weight = 0.0

    def set_reference_rate(self, tokens_per_s: float) -> None:
        if tokens_per_s > 0:
            self.reference_rate = tokens_per_s

    def _counter(self, tenant: TenantId, weight: float, now: float) -> _Counter:
        c = self._counters.get(tenant)
        if c is None:
            c = self._counters[tenant] = _Counter(weight=weight, vc_s=now)
        return c

    def activate(self, tenant: TenantId, weight: float, now: float) -> None:
        """A request of this tenant entered the system (counts its weight as active)."""
        c = self._counter(tenant, weight, now)
        if c.num_active == 0:
            self._active_weight += c.weight
        c.num_active += 1

    def deactivate(self, tenant: TenantId) -> None:
        c = self._counters.get(tenant)
        if c is None or c.num_active == 0:
            return
        c.num_active -= 1
        if c.num_active == 0:
            self._active_weight = max(0.0, self._active_weight - c.weight)

    def fair_rate(self, tenant: TenantId) -> float:
        """Tokens/s this tenant is entitled to now (its weight over the active weight)."""
        c = self._counters.get(tenant)
        if c is None:
            return self.reference_rate
        total = max(self._active_weight, c.weight)
        return self.reference_rate * c.weight / total

    def tag(self, tenant: TenantId, weight: float, num_tokens: float, now: float) -> float:
        """Stamp a request of `num_tokens` and charge it: returns its start tag (seconds)."""
        c = self._counter(tenant, weight, now)
        start = max(now, c.vc_s)
        c.vc_s = start + num_tokens / self.fair_rate(tenant)
        c.served_tokens += num_tokens
        return start

    def lead_s(self, tenant: TenantId, now: float) -> float:
        """How far the tenant's counter runs ahead of real time: 0 within its share."""
        c = self._counters.get(tenant)
        return 0.0 if c is None else max(0.0, c.vc_s - now)

    def served_tokens(self, tenant: TenantId) -> float:
        c = self._counters.get(tenant)
        return 0.0 if c is None else c.served_tokens

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {t: {"weight": c.weight, "vc_s": c.vc_s, "served_tokens": c.served_tokens}
                for t, c in self._counters.items()}

    def restore(self, snap: dict[str, dict[str, float]]) -> None:
        for t, d in snap.items():
            self._counters[TenantId(t)] = _Counter(weight=d["weight"], vc_s=d["vc_s"],
                                                   served_tokens=d["served_tokens"])
