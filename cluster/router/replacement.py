"""Replacing dead workers: a fresh worker under the dead one's name, started in the background.

Mental model: with a `Replacer` (the deployment: `PDDeployment.replace` behind a
`RayReplacer`), every worker the `LoadBoard` declares dead is replaced by a fresh one of the same
name, retried with backoff up to `RecoveryConfig.replace_attempts` times; the new handle takes
the old one's place in the router's handle map and the name leaves `dead` (a replacement with a
name of its own, a new Serve replica, joins beside the dead name, which stays dead). A recovery that finds
no healthy worker while a replacement is under way waits for it (`wait`) instead of failing: a
lone decode worker that dies costs its streams a stall, not an error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from cluster.router.config import RecoveryConfig
from cluster.router.handles import WorkerHandle
from cluster.router.loads import LoadBoard

logger = logging.getLogger(__name__)


class Replacer(Protocol):
    async def replace(self, name: str) -> WorkerHandle | None:
        """A fresh, wired, answering worker for the dead worker `name` (raises if it cannot start);
        None: it is not to be replaced (its deployment was scaled down)."""
        ...


class Replacements:
    def __init__(self, replacer: Replacer, board: LoadBoard, handles: dict[str, dict[str, WorkerHandle]],
                 cfg: RecoveryConfig) -> None:
        """`handles`: the router's maps by kind ("prefill", "decode"); a replacement takes its
        predecessor's place in the map that holds the name."""
        self.replacer, self.board, self.handles, self.cfg = replacer, board, handles, cfg
        self.replacing: dict[str, asyncio.Task[None]] = {}
        self.num_replaced = 0
        self.replaced_at = float("-inf")  # time.monotonic() of the last replacement

    def start(self, name: str) -> None:
        if name not in self.replacing:
            logger.warning("starting a replacement for %s", name)
            self.replacing[name] = asyncio.ensure_future(self._replace(name))

    async def wait(self, timeout_s: float) -> None:
        """Until the replacements under way end (started or given up), at most `timeout_s`."""
        if self.replacing:
            await asyncio.wait(list(self.replacing.values()), timeout=timeout_s)

    async def _replace(self, name: str) -> None:
        cfg = self.cfg
        try:
            for attempt in range(1, cfg.replace_attempts + 1):
                started = time.monotonic()
                try:
                    handle = await self.replacer.replace(name)
                except Exception as e:  # noqa: BLE001 - logged; tried again or given up below
                    logger.warning("replacement %d/%d of %s failed: %r", attempt, cfg.replace_attempts, name, e)
                    if attempt < cfg.replace_attempts:
                        await asyncio.sleep(cfg.replace_backoff_s * 2 ** (attempt - 1))
                    continue
                if handle is None:
                    logger.warning("worker %s is gone and not replaced: its deployment was scaled down", name)
                    return
                for by_name in self.handles.values():
                    if name in by_name:  # under Serve the replacement has a name of its own
                        by_name[handle.name] = handle
                self.board.revive(handle.name)
                self.num_replaced += 1
                self.replaced_at = time.monotonic()
                logger.warning("worker %s replaced in %.1f s; placeable again", name, time.monotonic() - started)
                return
            logger.error("gave up replacing %s after %d tries; it stays out of placement", name, cfg.replace_attempts)
        finally:
            self.replacing.pop(name, None)
