"""Waiting for a decode row (`cluster/router/room.py`, `Router._announce_queued`), against hand-made
worker handles (no Ray): a request refused for lack of rows waits and gets the next free row
instead of a 429; interactive requests get rows before batch ones that waited longer; a new
request does not jump the queue unless it outranks it; a wait past `room_wait_s` is refused;
`room_wait_s=0` refuses at once, as before; a waiter's `Patience` renews while the queue moves (rows
freed or streaming, workers stepping rows of other callers) or capacity is coming, up to
`room_max_wait_s`; a busy worker's waiter is served after more than `room_wait_s`; an interactive request that finds no row stops its
client's batch row that is cheapest to recompute."""

from __future__ import annotations

import asyncio
import time

import pytest

from actors.engine.sampling import SamplingParams
from actors.errors import NoCapacity
from actors.messages import GenerationRequest, WorkerLoad
from cluster.router.choice import PlacementChoice
from cluster.router.client import Router
from cluster.router.config import RouterConfig
from cluster.router.flight import DECODING, PREEMPTED, InFlight
from cluster.router.room import Patience, RoomQueue


def test_only_the_most_urgent_waiter_is_woken_and_the_next_one_when_it_leaves() -> None:
    async def main() -> list[str]:
        q = RoomQueue(poll_s=10.0)  # nothing happens by polling here: only releases wake
        order: list[str] = []
        batch, late, early = q.join(1, 0.0), q.join(0, 5.0), q.join(0, 1.0)
        assert len(q) == 3 and q.interactive_waiting()
        assert not q.may_skip(0, 2.0) and q.may_skip(0, 0.5)  # only by outranking the head

        async def wait(name: str, ticket: int) -> None:
            assert await q.turn(ticket, 5.0)
            order.append(name)
            q.leave(ticket)

        tasks = [asyncio.ensure_future(wait(n, t)) for n, t in (("batch", batch), ("late", late), ("early", early))]
        q.release()
        await asyncio.wait_for(asyncio.gather(*tasks), 5.0)
        assert len(q) == 0 and not q.interactive_waiting() and q.may_skip(1, 9.0)
        return order

    assert asyncio.run(main()) == ["early", "late", "batch"]


def test_a_turn_times_out_and_polling_finds_rows_freed_elsewhere() -> None:
    async def main() -> None:
        q = RoomQueue(poll_s=0.05)
        first, second = q.join(0, 0.0), q.join(0, 1.0)
        t0 = time.monotonic()
        assert not await q.turn(second, 0.2)  # never the head
        assert 0.19 <= time.monotonic() - t0 < 1.0  # its deadline, not the next turn's (slack for a loaded box)
        assert await q.turn(first, 1.0)  # the head: woken by a poll without any release
        q.leave(first)
        assert await q.turn(second, 1.0)

    asyncio.run(main())
    with pytest.raises(ValueError):
        RoomQueue(poll_s=0)


class Decode:
    """A decode worker handle with `rows` rows: announce takes one or says no; `free` gives one
    back; abort frees the request's row."""

    name = "d0"

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.taken: list[str] = []
        self.granted: list[str] = []  # every row given, in order
        self.rows_stepped = 0  # what its load reports as decode rows stepped since it started

    async def announce(self, req: GenerationRequest) -> bool:
        if len(self.taken) >= self.rows:
            return False
        self.taken.append(req.request_id)
        self.granted.append(req.request_id)
        return True

    def abort(self, rid: str) -> asyncio.Future[bool]:
        if rid in self.taken:
            self.taken.remove(rid)
        done = asyncio.get_running_loop().create_future()
        done.set_result(True)
        return done

    def free(self) -> None:
        self.taken.pop(0)

    async def load(self) -> WorkerLoad:
        return WorkerLoad(self.name, "decode", len(self.taken), 0, 0, 8, 8, 0.01, True,
                          num_decode_rows=self.rows_stepped)


def test_patience_renews_while_the_queue_moves_or_capacity_comes_and_never_past_its_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    q, decodes, coming, steps = RoomQueue(poll_s=0.5), ["d0"], [False], [0]
    patience = Patience(q, lambda: decodes, lambda: coming[0], wait_s=10.0, max_wait_s=60.0,
                        worker_steps=lambda: steps[0])
    assert patience.left_s() == 10.0
    now[0] = 108.0
    q.leave(q.join(0, 0.0))  # a waiter got its row: the queue moved
    assert patience.left_s() == 10.0
    now[0] = 115.0
    decodes.append("d1")  # a decode worker joined
    assert patience.left_s() == 10.0
    now[0] = 122.0
    q.streamed()  # a row of this caller's streamed a token: busy, not stalled
    assert patience.left_s() == 10.0
    now[0] = 130.0
    steps[0] += 3  # the workers stepped rows (other callers' requests hold them)
    assert patience.left_s() == 10.0
    now[0] = 140.0  # nothing moved for wait_s
    assert patience.left_s() == 0.0 and "nothing moved for 10s" in patience.why_over()
    coming[0] = True  # a decode worker is being added: wait on, a poll at a time
    assert patience.left_s() == 0.5
    now[0] = 155.0
    q.streamed()
    assert patience.left_s() == 5.0  # renewed, but never past max_wait_s from its start
    now[0] = 160.0
    assert patience.left_s() == 0.0 and "room_max_wait_s" in patience.why_over()


def request(rid: str) -> GenerationRequest:
    return GenerationRequest(rid, list(range(4, 20)), SamplingParams(max_tokens=4))


def client(decode: Decode, room_wait_s: float = 5.0) -> Router:
    c = Router({}, {"d0": decode}, RouterConfig(room_wait_s=room_wait_s))  # type: ignore[dict-item]
    c.room.poll_s = 0.02
    return c


def test_refused_requests_wait_for_rows_interactive_first() -> None:
    decode = Decode(rows=1)

    async def main() -> Router:
        c = client(decode)

        async def ask(rid: str, priority: tuple[int, float]) -> str:
            return await c._announce_queued(request(rid), PlacementChoice("p0", ("d0",), priority=priority))

        assert await ask("first", (0, 0.0)) == "d0"  # the one row
        batch = asyncio.ensure_future(ask("batch", (1, 1.0)))
        await asyncio.sleep(0.05)
        online = asyncio.ensure_future(ask("online", (0, 2.0)))  # later, but interactive
        await asyncio.sleep(0.05)
        assert len(c.room) == 2 and decode.granted == ["first"]  # no 429: both wait
        decode.free()
        c.room.release()  # as the end of an attempt does
        assert await asyncio.wait_for(online, 5.0) == "d0"
        assert not batch.done()
        decode.free()  # nobody says so: the queue's poll finds the row
        assert await asyncio.wait_for(batch, 5.0) == "d0"
        return c

    c = asyncio.run(main())
    assert decode.granted == ["first", "online", "batch"] and c.room.num_queued == 2 and len(c.room) == 0


def test_a_wait_past_room_wait_s_is_refused_and_zero_refuses_at_once() -> None:
    async def main(wait_s: float) -> float:
        c = client(Decode(rows=0), room_wait_s=wait_s)
        t0 = time.monotonic()
        with pytest.raises(NoCapacity):
            await c._announce_queued(request("r"), PlacementChoice("p0", ("d0",)))
        assert len(c.room) == 0
        return time.monotonic() - t0

    assert 0.29 <= asyncio.run(main(0.3)) < 1.5
    assert asyncio.run(main(0.0)) < 0.25  # at once, well before the 0.3 s above


def test_a_waiter_on_a_busy_worker_is_served_past_room_wait_s_and_refused_at_room_max_wait_s() -> None:
    """The rows are held by other callers' requests that keep decoding (the worker's stepped rows
    grow): a stalled-queue refusal would come at room_wait_s; the waiter gets the row freed after
    several times that instead, and where no row ever frees, its refusal comes at room_max_wait_s."""
    async def main(free_after_s: float | None) -> tuple[str, float]:
        decode = Decode(rows=1)
        decode.taken.append("elsewhere")
        c = Router({}, {"d0": decode}, RouterConfig(room_wait_s=0.2, room_max_wait_s=1.5,  # type: ignore[dict-item]
                                                    load_ttl_s=0.0))
        c.room.poll_s = 0.02
        t0 = time.monotonic()

        async def busy() -> None:  # the other caller's row steps, then (maybe) ends
            while free_after_s is None or time.monotonic() - t0 < free_after_s:
                decode.rows_stepped += 1
                await asyncio.sleep(0.05)
            decode.free()

        stepping = asyncio.ensure_future(busy())
        try:
            got = await c._announce_queued(request("r"), PlacementChoice("p0", ("d0",)))
        except NoCapacity as e:
            got = str(e)
        stepping.cancel()
        return got, time.monotonic() - t0

    got, waited = asyncio.run(main(0.8))
    assert got == "d0" and 0.8 <= waited < 1.5  # served after 4x room_wait_s, never refused
    got, waited = asyncio.run(main(None))
    assert "room_max_wait_s" in got and 1.5 <= waited < 3.0


class Scheduled:
    """A `ControlPlane` that only records what the router tells it."""

    available = True

    def __init__(self, preempt_batch: bool = True) -> None:
        self.preempt_batch = preempt_batch
        self.preempted: list[str] = []

    def attach(self, source: object) -> None: ...
    async def admit(self, *a: object) -> None: ...
    def fallback_rank(self, *a: object) -> int: return 0
    async def recover(self, *a: object) -> None: ...
    def on_placed(self, flight: object) -> None: ...
    def on_stage(self, *a: object) -> None: ...
    def on_tokens(self, *a: object) -> None: ...
    def on_done(self, *a: object) -> None: ...

    def on_preempted(self, flight: InFlight) -> None:
        self.preempted.append(flight.request_id)


def test_an_interactive_request_without_a_row_stops_the_cheapest_batch_row_of_its_client() -> None:
    decode = Decode(rows=2)

    async def main(scheduled: Scheduled) -> tuple[str, Router]:
        c = Router({}, {"d0": decode}, RouterConfig(room_wait_s=5.0), control=scheduled)  # type: ignore[dict-item, arg-type]
        assert c.control is scheduled
        c.room.poll_s = 0.02
        for rid, streamed in (("long", 30), ("short", 3)):  # two batch rows decoding on d0
            f = c.flights[rid] = InFlight(request(rid))
            f.place(None, "d0", DECODING)
            f.priority_rank, f.streamed = 1, list(range(streamed))
            f.mark_issued()
            assert await decode.announce(f.req)
        if not scheduled.preempt_batch:
            c.cfg = RouterConfig(room_wait_s=0.2)
        got = await c._announce_queued(request("online"), PlacementChoice("p0", ("d0",), priority=(0, 0.0)))
        return got, c

    scheduled = Scheduled(preempt_batch=False)  # turned off: the interactive request waits, then 429
    with pytest.raises(NoCapacity):
        asyncio.run(main(scheduled))
    assert decode.taken == ["long", "short"] and not scheduled.preempted
    decode.taken.clear()
    scheduled = Scheduled()
    got, c = asyncio.run(main(scheduled))
    assert got == "d0" and decode.taken == ["long", "online"]
    assert scheduled.preempted == ["short"] and c.flights["short"].phase == PREEMPTED  # cheapest to recompute
    assert c.flights["long"].phase == DECODING and c.preemptions.num_preempted == 1
