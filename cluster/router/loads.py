"""The router's view of its workers: their loads, which are dead, and their telemetry.

Mental model: `LoadBoard` polls every worker's load at most every `load_ttl_s` (one poll at a
time; callers share it) and adds the router's own in-flight counts, so a burst is placed before
any worker reports it. A worker is declared dead when a call finds its process gone (`WorkerGone`)
or its engine loop reports itself dead; dead workers are not called again, read unhealthy, and
are excluded from placement until `revive` (a replacement took the name). Whoever needs to know
(the replacement of dead workers) hears it through `on_dead`. Where workers come and go on their
own (Serve replicas), `discover` finds the new ones before the first poll and every
`discover_interval_s` after.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import TypeVar

from actors.errors import WorkerTimeout
from actors.messages import Telemetry, TelemetryCursor, WorkerLoad
from cluster.router.config import RouterConfig
from cluster.router.handles import WorkerGone, WorkerHandle, WorkerUnreachable

logger = logging.getLogger(__name__)
T = TypeVar("T")


async def bounded(call: Awaitable[T], timeout_s: float, what: str) -> T:
    """`call`'s answer, or `WorkerTimeout` after `timeout_s`."""
    try:
        return await asyncio.wait_for(call, timeout_s)
    except asyncio.TimeoutError:
        raise WorkerTimeout(f"{what} did not answer within {timeout_s:g}s") from None


class LoadBoard:
    def __init__(self, prefills: Mapping[str, WorkerHandle], decodes: Mapping[str, WorkerHandle], cfg: RouterConfig,
                 on_dead: Callable[[str], None] | None = None) -> None:
        self.prefills, self.decodes, self.cfg = prefills, decodes, cfg
        self.on_dead = on_dead
        # Finds workers that joined (Serve replicas) and adds them to the maps; run before the first
        # poll and every `discover_interval_s` after.
        self.discover: Callable[[], Awaitable[object]] | None = None
        self.discover_interval_s = 10.0
        self._discovered_at = float("-inf")
        self._discovering: asyncio.Task[None] | None = None
        self.dead: set[str] = set()  # workers seen dead and not replaced since
        self.in_flight: collections.Counter[str] = collections.Counter()  # this router's requests per decode worker
        self._loads: dict[str, WorkerLoad] = {}
        self._late: set[str] = set()  # workers whose last load call timed out
        self._loads_at = float("-inf")
        self._refresh: asyncio.Task[None] | None = None

    def handle(self, name: str) -> WorkerHandle:
        return self.prefills.get(name) or self.decodes[name]

    async def loads(self) -> dict[str, WorkerLoad]:
        """Every worker's load, at most `load_ttl_s` old, with this router's in-flight requests
        counted in; dead workers unhealthy."""
        if time.monotonic() - self._loads_at > self.cfg.load_ttl_s:
            if self._refresh is None or self._refresh.done():
                self._refresh = asyncio.ensure_future(self._poll())
            await asyncio.shield(self._refresh)
        return self.cached()

    def cached(self) -> dict[str, WorkerLoad]:
        """`loads()` as of the last poll, without polling."""
        out = {}
        for name, load in self._loads.items():
            if name in self.dead and load.healthy:
                load = replace(load, healthy=False)
            extra = self.in_flight[name] - load.num_active
            out[name] = replace(load, num_waiting=load.num_waiting + extra) if extra > 0 else load
        return out

    def decode_rows_stepped(self) -> int:
        """The decode rows the decode workers stepped since they started, summed, as of the last
        poll (`WorkerLoad.num_decode_rows`): it grows while any caller's rows decode there."""
        return sum(self._loads[n].num_decode_rows for n in self.decodes if n in self._loads)

    def split(self, loads: Mapping[str, WorkerLoad]) -> tuple[list[WorkerLoad], list[WorkerLoad]]:
        """(prefill loads, decode loads), as placement takes them."""
        return [loads[n] for n in self.prefills if n in loads], [loads[n] for n in self.decodes if n in loads]

    async def wait_for_workers(self, timeout_s: float) -> None:
        """Until `discover` has found a worker (Serve replicas still starting when the ingress took its
        first request), at most `timeout_s`; at once when some are known or nothing discovers them."""
        deadline = time.monotonic() + timeout_s
        discovered = False
        while self.discover is not None and not (self.prefills or self.decodes) and time.monotonic() < deadline:
            await self._discover()
            discovered = True
            if not (self.prefills or self.decodes):
                await asyncio.sleep(0.5)
        # Only a discovery run here restarts the interval: a request that found workers known must not
        # (under steady traffic that postponed every periodic discovery, so a scaled-up replica never joined).
        if discovered and (self.prefills or self.decodes):
            self._discovered_at = time.monotonic()

    async def _discover(self) -> None:
        assert self.discover is not None
        try:
            await self.discover()
        except Exception as e:  # noqa: BLE001 - the known workers still serve
            logger.warning("finding new workers failed: %r", e)

    async def _poll(self) -> None:
        if self.discover is not None and time.monotonic() - self._discovered_at > self.discover_interval_s:
            self._discovered_at = time.monotonic()
            if not (self.prefills or self.decodes):
                await self._discover()  # nothing to serve with until it answers
                if not (self.prefills or self.decodes):
                    self._discovered_at = float("-inf")  # ask again at the next poll
            elif self._discovering is None or self._discovering.done():
                self._discovering = asyncio.ensure_future(self._discover())  # beside the known workers' polls
        async def one(name: str, handle: WorkerHandle) -> WorkerLoad:
            kind = "prefill" if name in self.prefills else "decode"
            down = WorkerLoad(name, kind, 0, 0, 0, 0, 0, 0.0, healthy=False)  # type: ignore[arg-type]
            if name in self.dead:  # dead workers stay dead: no call, no warning every poll
                return down
            try:
                load = await bounded(handle.load(), self.cfg.call_timeout_s, f"load of {name}")
            except WorkerGone:
                self.mark_dead(name)
                return down
            except (WorkerTimeout, WorkerUnreachable) as e:
                last = self._loads.get(name)
                if isinstance(e, WorkerTimeout) and name not in self._late and last is not None and last.healthy:
                    self._late.add(name)  # slow once is not lost: a loaded box can miss one poll
                    logger.warning("worker %s is late (%s); keeping its last load for one poll", name, e)
                    return last
                logger.warning("worker %s is unhealthy: %s", name, e)
                return down
            self._late.discard(name)
            if not load.healthy:  # its engine loop died: it never steps again
                self.mark_dead(name)
            return replace(load, name=name)  # our key is the name placement answers with

        workers = {**self.prefills, **self.decodes}
        loads = await asyncio.gather(*(one(n, h) for n, h in workers.items()))
        self._loads = {w.name: w for w in loads}
        self._loads_at = time.monotonic()

    async def is_dead(self, name: str, timeout_s: float) -> bool:
        """Probes a suspect: dead if its process is gone or its engine reports itself dead;
        restarting or slow is not known dead."""
        if name in self.dead:
            return True
        try:
            load = await bounded(self.handle(name).load(), timeout_s, f"probe of {name}")
        except WorkerGone:
            return self.mark_dead(name)
        except (WorkerUnreachable, WorkerTimeout) as e:
            logger.warning("probe of %s failed: %s", name, e)
            return False
        return False if load.healthy else self.mark_dead(name)

    def mark_dead(self, name: str) -> bool:
        self._late.discard(name)
        if name not in self.dead:
            logger.warning("worker %s is dead; excluded from placement", name)
            self.dead.add(name)
            if self.on_dead is not None:
                self.on_dead(name)
        load = self._loads.get(name)
        if load is not None:
            self._loads[name] = replace(load, healthy=False)
        return True

    def revive(self, name: str) -> None:
        """`name` has a fresh worker behind it: placeable again from the next poll on."""
        self.dead.discard(name)
        self._loads_at = float("-inf")

    async def telemetry(self, cursors: Mapping[str, TelemetryCursor | None]) -> dict[str, Telemetry]:
        """Each live worker's engine telemetry after its cursor (see `actors/telemetry.py`), for the
        scheduler's cost models and prefix index; a worker that does not answer in time is left out."""
        workers = {**self.prefills, **self.decodes}

        async def one(name: str) -> Telemetry | None:
            try:
                return await bounded(workers[name].telemetry(cursors.get(name)), self.cfg.call_timeout_s,
                                     f"telemetry of {name}")
            except (WorkerTimeout, WorkerUnreachable) as e:
                logger.debug("no telemetry from %s: %s", name, e)
                return None

        names = [n for n in workers if n not in self.dead]
        got = await asyncio.gather(*(one(n) for n in names))
        return {n: t for n, t in zip(names, got) if t is not None}
