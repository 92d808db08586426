"""A worker whose load call misses one poll on a loaded box keeps its last load for that poll; a
second miss in a row reads it down, and an answer clears the count."""

from __future__ import annotations

import asyncio

from actors.messages import WorkerLoad
from cluster.router.config import RouterConfig
from cluster.router.loads import LoadBoard


class SlowWorker:
    def __init__(self) -> None:
        self.late = False

    async def load(self) -> WorkerLoad:
        if self.late:
            await asyncio.sleep(10)
        return WorkerLoad("p0", "prefill", 1, 0, 0, 8, 8, 0.0, healthy=True)


def test_one_late_poll_keeps_the_last_load_two_read_down() -> None:
    async def main() -> list[bool]:
        worker = SlowWorker()
        board = LoadBoard({"p0": worker}, {}, RouterConfig(call_timeout_s=0.05, load_ttl_s=0))  # type: ignore[dict-item]
        seen = []
        for late in (False, True, True, False, True):
            worker.late = late
            seen.append((await board.loads())["p0"].healthy)
        return seen

    assert asyncio.run(main()) == [True, True, False, True, True]
