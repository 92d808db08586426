"""ReplicaScaler: the scheduler's replica-count advice, applied to the worker deployments.

Mental model: with `workers_as: deployments` and `scheduler.scaling` set, the ingress asks the
scheduler every `interval_s` how many prefill and decode replicas the measured slack asks for
(`cluster/scaling.py`: bounds and hysteresis live there) and, when that differs from what it last
set, sets the deployment's target through Serve's external-scaler API (the app runs with
`external_scaler_enabled`). Serve starts or stops the replicas: a new one joins the router when the
ingress finds it (`ServeWorkers.discover`, asked at once here); one that Serve stops finishes its
streams first (graceful shutdown), and a stream it could not finish resumes elsewhere (recovery).
Every change is logged with the pressures behind it, and the last ones are kept in `history`; `/health`
shows them under `scaling`, with the last advice (the counts and pressures the scheduler gave) and
what was applied.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

from cluster.scaling import ScaleAdvice

logger = logging.getLogger(__name__)

HISTORY = 20  # changes kept (and shown in /health): an app scaling for weeks must not grow a list


@dataclass(frozen=True)
class ScaleChange:
    at: float  # time.time()
    deployment: str
    replicas: int
    pressure: float


class ReplicaScaler:
    def __init__(self, advise: Callable[[], Awaitable[ScaleAdvice | None]],
                 set_replicas: Callable[[str, int], Awaitable[None]], deployments: dict[str, tuple[str, int]],
                 on_change: Callable[[], Awaitable[object]] | None = None, interval_s: float = 1.0) -> None:
        """`deployments`: role ("prefill", "decode") -> (deployment name, replicas it started with)."""
        self.advise, self.set_replicas = advise, set_replicas
        self.deployments = {role: name for role, (name, _) in deployments.items()}
        self.on_change = on_change
        self.interval_s = interval_s
        self.applied: dict[str, int] = {role: n for role, (_, n) in deployments.items()}
        self.history: collections.deque[ScaleChange] = collections.deque(maxlen=HISTORY)
        self.last: ScaleAdvice | None = None  # the last advice the scheduler gave
        self.last_at = 0.0  # time.time() of it
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await self.step()
            except Exception:  # noqa: BLE001 - the next round tries again
                logger.exception("applying the scaling advice failed")
            await asyncio.sleep(self.interval_s)

    async def step(self) -> None:
        advice = await self.advise()
        if advice is not None:
            self.last, self.last_at = advice, time.time()
        if advice is None or not (advice.num_prefill or advice.num_decode):
            return  # no advice, or given before any worker reported
        changed = False
        for role, name in self.deployments.items():
            want, pressure, seen = advice.of(role)
            if self.applied.get(role) == want:
                continue
            await self.set_replicas(name, want)
            logger.warning("scaling %s from %d to %d replicas (pressure %.2f over %d healthy)", name,
                           self.applied[role], want, pressure, seen)
            self.history.append(ScaleChange(time.time(), name, want, pressure))
            self.applied[role] = want
            changed = True
        if changed and self.on_change is not None:
            await self.on_change()

    def health(self) -> dict[str, Any]:
        """For `/health`: what was applied, the last advice with its pressures, the last changes."""
        advice = None if self.last is None else {**asdict(self.last), "age_s": round(time.time() - self.last_at, 1)}
        return {"applied": dict(self.applied), "advice": advice, "changes": [asdict(c) for c in self.history]}

    def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.get_loop().call_soon_threadsafe(self._task.cancel)
