"""Discovery of new workers (Serve replicas) runs every `discover_interval_s` however busy the
router is: a request that finds workers already known does not restart the interval (under steady
traffic that once kept a scaled-up decode replica out of the router for the whole burst)."""

from __future__ import annotations

import asyncio

from actors.messages import WorkerLoad
from cluster.router.config import RouterConfig
from cluster.router.loads import LoadBoard


class Worker:
    async def load(self) -> WorkerLoad:
        return WorkerLoad("d0", "decode", 1, 0, 0, 8, 8, 0.0, healthy=True)


def test_discovery_runs_on_its_interval_under_steady_requests() -> None:
    async def main() -> tuple[int, int]:
        board = LoadBoard({}, {}, RouterConfig(load_ttl_s=0))
        found = 0

        async def discover() -> None:
            nonlocal found
            found += 1
            board.decodes = {"d0": Worker()}  # type: ignore[dict-item]

        board.discover, board.discover_interval_s = discover, 0.2
        await board.wait_for_workers(5.0)  # the first request: none known, it discovers them
        assert found == 1
        for _ in range(12):  # a request every 0.05 s for 0.6 s, each as the router places it
            await board.wait_for_workers(5.0)
            await board.loads()
            await asyncio.sleep(0.05)
        await asyncio.sleep(0)  # let the last discovery run
        return found, len(board.decodes)

    found, known = asyncio.run(main())
    assert found >= 3, found  # at 0.2 s, 0.4 s (and about 0.6 s) besides the first
    assert known == 1


def test_a_known_worker_does_not_make_a_request_wait_for_discovery() -> None:
    async def main() -> int:
        calls = 0

        async def discover() -> None:
            nonlocal calls
            calls += 1

        board = LoadBoard({}, {"d0": Worker()}, RouterConfig(load_ttl_s=0))  # type: ignore[dict-item]
        board.discover = discover
        await board.wait_for_workers(5.0)
        return calls

    assert asyncio.run(main()) == 0
