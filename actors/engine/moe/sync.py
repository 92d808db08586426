"""`RoutingSync`: a worker's link to the routing controller, one exchange every `period_s`.

Mental model: the worker pushes, the controller answers. Each exchange hands the controller this
worker's expert loads (and, every `sample_every` exchanges, its logit sample of router logits) and
takes back a `RoutingUpdate`: the model's published table and its tenants' expert budgets. A newer
table is applied at once (`MoEControl.apply_table` validates it; it takes effect at the next engine
step). Every worker of a model syncs with the same controller, so all converge on the same version
within one period; a worker holding a newer table than the controller answers with (the controller
restarted) hands it over to be adopted. A controller that does not answer, or a table this worker
refuses, is logged; serving goes on with the table in force. The hub is anything with the
controller's `sync` signature: the controller itself in one process, a Ray actor behind
actors/moe_link.py.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Protocol

import torch

from actors.engine.moe.control import MoEControl
from actors.engine.moe.routing_table import RoutingTable, RoutingUpdate, TableRejected
from actors.engine.moe.telemetry import ExpertLoadReport

logger = logging.getLogger(__name__)


class RoutingHub(Protocol):
    def sync(self, model: str, worker: str, report: ExpertLoadReport, top_k: int,
             sample: Sequence[torch.Tensor] | None = None, active: RoutingTable | None = None) -> RoutingUpdate: ...


class RoutingSync:
    def __init__(self, control: MoEControl, hub: RoutingHub, model: str, worker: str, *, period_s: float = 1.0,
                 sample_every: int = 5) -> None:
        self.control, self.hub, self.model, self.worker = control, hub, model, worker
        self.period_s, self.sample_every = period_s, sample_every
        self.num_syncs = self.num_failures = 0
        self._answered = 0  # the version the controller last answered with
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sync_once(self) -> RoutingTable:
        """One exchange; returns the published table (applied here when newer)."""
        sample = self.control.sample.read() if self.num_syncs % self.sample_every == 0 else None
        self.num_syncs += 1
        active = self.control.state.active
        update = self.hub.sync(self.model, self.worker, self.control.report(), self.control.top_k, sample,
                               active if active.version > self._answered else None)
        table = update.table
        self._answered = table.version
        if table.version > active.version:
            self.control.apply_table(table)
        if update.budgets != self.control.budget.budgets:
            logger.info("%s: expert budgets now %s", self.worker, update.budgets.to_json())
            self.control.budget.budgets = update.budgets  # read by the next step's plan
        return table

    def start(self) -> "RoutingSync":
        self._thread = threading.Thread(target=self._loop, name=f"moe-sync-{self.worker}", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.sync_once()
            except TableRejected as e:
                logger.error("%s: the controller's routing table was refused here: %s", self.worker, e)
            except Exception as e:  # noqa: BLE001 - the controller may be restarting; serving goes on
                self.num_failures += 1
                if self.num_failures in (1, 10) or self.num_failures % 100 == 0:
                    logger.warning("%s: routing sync failed (%d so far): %r", self.worker, self.num_failures, e)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
