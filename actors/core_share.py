"""CoreShare: the CPU engines of one node lend each other their cores by SLO slack.

Mental model: with `engine.cpu_cores: shared`, a prefill and a decode engine on one node each run on
all its cores, so while both compute each gets about half, and a long prompt prefills at half speed:
on two cores a 1,000-token prompt then misses a 3 s TTFT that it meets alone. A decode row's TPOT
target, though, usually has room: its steps take a fraction of the target, and the difference
accumulates. So the prefill engine *claims* the cores while it computes (a lease in a small file in
/dev/shm that every engine of the node maps: a monotonic deadline, renewed by each prefill step),
and a decode engine *yields* while the claim stands and every row it runs has banked enough time
ahead of its target: it waits in short slices (`YIELD_SLICE_S`) between steps, never while it is
itself prefilling, never longer than its rows' tightest bank. A row's bank, from the time it came
to this engine: `tpot_share` x its target x tokens made here - seconds since; a fresh row has none,
so a pause is always paid from time the rows already earned, and the average TPOT each client sees
stays within the target. A row without a target (batch work, or placed without the scheduler)
never pays for a pause: it blocks yielding.

The file holds one float64 (CLOCK_MONOTONIC is one clock for every process of a machine). A torn or
stale read costs one wrong slice, nothing else; no lock is taken.
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from actors.engine.async_engine import AsyncEngine
    from actors.engine.engine import Engine

CORE_SHARE_ENV = "FERRY_CORE_SHARE"  # the file's path, set in every CPU worker's runtime env
YIELD_SLICE_S = 0.02  # a yielding decode engine looks at the claim and its banks this often
_FMT = struct.Struct("d")


def default_core_share_path() -> str:
    """One claim file per user and machine, in memory where the system has /dev/shm: every CPU
    engine of this user on the node shares it (they share the cores, whichever app runs them)."""
    folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return str(folder / f"ferry-cores-{os.getuid()}")


class CoreShare:
    """One node's claim on its cores: `claim` by prefill engines, `claimed_for` by decode engines."""

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self._clock = clock
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < _FMT.size:
                os.ftruncate(fd, _FMT.size)
            self._map = mmap.mmap(fd, _FMT.size)
        finally:
            os.close(fd)

    @classmethod
    def from_env(cls) -> CoreShare | None:
        path = os.environ.get(CORE_SHARE_ENV)
        return cls(path) if path else None

    def claim(self, hold_s: float) -> None:
        """The cores are wanted for prefill for `hold_s` more seconds (a later claim extends it)."""
        until = self._clock() + hold_s
        if until > self.claimed_until():
            self._map[:_FMT.size] = _FMT.pack(until)

    def release(self) -> None:
        self._map[:_FMT.size] = _FMT.pack(0.0)

    def claimed_until(self) -> float:
        return _FMT.unpack(self._map[:_FMT.size])[0]

    def claimed_for(self) -> float:
        """Seconds the current claim still stands (0 when none)."""
        return max(0.0, self.claimed_until() - self._clock())

    def close(self) -> None:
        self._map.close()


@dataclass(frozen=True, slots=True)
class Row:
    """A decode row as the yield decision sees it."""

    request_id: str
    num_output_tokens: int
    tpot_target_s: float | None
    prefilling: bool  # still computing its prompt (or resuming): never paused


class DecodeYield:
    """A decode engine's side: how long to wait before its next step (`pause_s`), from the node's
    claim and its rows' banks. `tpot_share`: the part of a row's TPOT target it may bank (the rest
    absorbs the steps' own variation)."""

    def __init__(self, share: CoreShare, tpot_share: float = 0.8, clock: Callable[[], float] = time.monotonic,
                 slice_s: float = YIELD_SLICE_S) -> None:
        if not 0 < tpot_share <= 1:
            raise ValueError("tpot_share must be in (0, 1]")
        self.share = share
        self.tpot_share = tpot_share
        self.slice_s = slice_s
        self._clock = clock
        self._seen: dict[str, tuple[float, int]] = {}  # request -> (first seen, output tokens then)
        self.num_pauses = 0
        self.paused_s = 0.0

    def bank_s(self, row: Row, now: float) -> float | None:
        """Seconds `row` is ahead of its target here (None: it cannot pay for a pause)."""
        if row.tpot_target_s is None or row.prefilling:
            return None
        since, made_before = self._seen.setdefault(row.request_id, (now, row.num_output_tokens))
        return self.tpot_share * row.tpot_target_s * (row.num_output_tokens - made_before) - (now - since)

    def pause_s(self, rows: Iterable[Row]) -> float:
        """How long to wait now (0: step at once): one slice at most, while a prefill claims the
        cores and every row's bank covers the slice."""
        now = self._clock()
        banks = []
        live = set()
        for row in rows:
            live.add(row.request_id)
            banks.append(self.bank_s(row, now))
        for rid in [r for r in self._seen if r not in live]:  # finished, aborted or moved
            del self._seen[rid]
        claimed = self.share.claimed_for()
        if not banks or claimed <= 0 or any(b is None for b in banks):
            return 0.0
        wait = min(self.slice_s, claimed, min(banks))  # type: ignore[type-var]
        return wait if wait >= self.slice_s * 0.5 else 0.0  # slivers cost a wake-up and buy nothing

    def paused(self, seconds: float) -> None:
        self.num_pauses += 1
        self.paused_s += seconds


def engine_rows(engine: Engine) -> list[Row]:
    """The engine's requests as rows: running ones decode unless they still have prompt (or
    resumed) tokens to compute; waiting ones count as prefilling."""
    sched = engine.scheduler
    rows = [Row(r.request_id, r.num_output_tokens, r.tpot_target_s, r.num_computed_tokens < r.num_tokens - 1)
            for r in sched.running]
    rows += [Row(r.request_id, r.num_output_tokens, r.tpot_target_s, True) for r in sched.waiting]
    return rows


class PrefillClaim:
    """A prefill engine's side: each step claims the node's cores for about its own length (1.5x
    the smoothed step time, plus a margin), and an engine left with no work releases them at once."""

    def __init__(self, share: CoreShare, first_step_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.share = share
        self.step_s = first_step_s
        self._clock = clock
        self._started: float | None = None

    def hold_s(self) -> float:
        return 1.5 * self.step_s + 0.05

    def before_step(self, prepared: object) -> None:
        self._started = self._clock()
        self.share.claim(self.hold_s())

    def after_step(self, engine: Engine, outputs: object) -> None:
        if self._started is not None:
            self.step_s = 0.7 * self.step_s + 0.3 * (self._clock() - self._started)
            self._started = None
        if not engine.scheduler.has_unfinished():
            self.share.release()


def lend_cores(async_engine: AsyncEngine, role: str, share: CoreShare | None = None) -> DecodeYield | PrefillClaim | None:
    """Installs the node's core sharing on a worker's engine (`role` prefill or decode) when the
    workers share cores (`CORE_SHARE_ENV` set); returns what it installed, None otherwise."""
    share = share or CoreShare.from_env()
    if share is None:
        return None
    if role == "prefill":
        claim = PrefillClaim(share)
        async_engine.engine.step_hooks.append(claim.before_step)
        async_engine.after_step.append(claim.after_step)
        return claim
    if role == "decode":
        lender = DecodeYield(share)

        def pause(engine: Engine) -> float:
            wait = lender.pause_s(engine_rows(engine))
            if wait > 0:
                lender.paused(wait)
            return wait

        async_engine.pause_before_step = pause
        return lender
    raise ValueError(f"role must be prefill or decode, got {role!r}")
