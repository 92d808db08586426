"""The router's prefetch hook (`start_prefetch` in `Router._announce_queued`): a request that must
wait for a decode row has its prefill worker prefetch its prefix, once, before the row comes; one
that gets a row at once does not; a failing prefetch changes nothing for the request."""

from __future__ import annotations

import asyncio

from actors.engine.sampling import SamplingParams
from actors.messages import GenerationRequest
from cluster.router.choice import PlacementChoice
from cluster.router.client import Router
from cluster.router.config import RouterConfig


class Decode:
    name = "d0"

    def __init__(self, rows: int) -> None:
        self.rows = rows

    async def announce(self, req: GenerationRequest) -> bool:
        if self.rows == 0:
            return False
        self.rows -= 1
        return True


class Prefill:
    name = "p0"

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.prefetched: list[str] = []

    async def prefetch(self, req: GenerationRequest) -> None:
        self.prefetched.append(req.request_id)
        if self.fail:
            raise RuntimeError("the pool is away")


def request(rid: str) -> GenerationRequest:
    return GenerationRequest(rid, list(range(4, 40)), SamplingParams(max_tokens=4))


def test_only_a_waiting_request_is_prefetched_and_a_failed_prefetch_is_harmless() -> None:
    for fail in (False, True):
        decode, prefill = Decode(rows=1), Prefill(fail)

        async def main() -> None:
            c = Router({"p0": prefill}, {"d0": decode}, RouterConfig(room_wait_s=5.0))  # type: ignore[dict-item]
            c.room.poll_s = 0.02
            choice = PlacementChoice("p0", ("d0",))
            assert await c._announce_queued(request("now"), choice) == "d0"
            await asyncio.sleep(0.01)
            assert prefill.prefetched == []  # it had a row at once: nothing to do while waiting
            waiting = asyncio.ensure_future(c._announce_queued(request("later"), choice))
            await asyncio.sleep(0.1)
            assert prefill.prefetched == ["later"] and not waiting.done()
            decode.rows = 1
            assert await asyncio.wait_for(waiting, 5.0) == "d0"
            assert prefill.prefetched == ["later"]

        asyncio.run(main())
