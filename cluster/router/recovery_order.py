"""RecoveryOrder: the scheduler's recovery ordering, computed in the ingress when the scheduler is away.

Mental model: the victims of a dead worker resume most urgent first, by what is left of their SLO
budget (`Journal.recovery_plan`). The scheduler actor plans that normally; without it the link
builds a throw-away journal of the victims from the tenants' contracts and asks it the same
question. Victims of tenants the contracts do not know go last.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from cluster.descriptors import WorkerName
from cluster.flights import FlightState
from cluster.journal import Journal, JournalEntry
from cluster.tenants import TenantRegistry

_DEAD = WorkerName("~dead")  # where the throw-away journal files the victims


class RecoveryOrder:
    def __init__(self, tenants: TenantRegistry, batch_deadline_s: float) -> None:
        self.tenants, self.batch_deadline_s = tenants, batch_deadline_s

    def order(self, states: Sequence[FlightState]) -> list[int]:
        """Indices into `states`, most urgent first."""
        now = time.time()
        journal, unknown = Journal(), []
        index = {st.desc.request_id: i for i, st in enumerate(states)}
        for i, st in enumerate(states):
            tenant = self.tenants.get(st.desc.tenant, now)
            if tenant is None:
                unknown.append(i)
                continue
            entry = JournalEntry.for_request(st.desc, tenant.cfg.slo, self.batch_deadline_s, seed=st.seed)
            entry.num_output_tokens, entry.first_token_time = st.num_output_tokens, st.first_token_time
            entry.decode_worker = _DEAD
            journal.add(entry)
        return [index[e.request_id] for e in journal.recovery_plan(_DEAD, now)] + unknown
