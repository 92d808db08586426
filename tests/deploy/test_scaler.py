"""ReplicaScaler: the advice is applied only when it changes, each change is kept with its pressure,
and `/health`'s `scaling` part shows what was applied and the last advice (Serve's side is in
test_serve_scaling)."""

from __future__ import annotations

import asyncio

from cluster.scaling import ScaleAdvice
from deploy.scaler import ReplicaScaler


def test_changes_are_applied_once_and_shown_in_health() -> None:
    advice: list[ScaleAdvice | None] = [
        None,  # the scheduler is away: nothing to do
        ScaleAdvice(1, 1, 0.1, 0.0, 0, 0),  # no worker has reported yet
        ScaleAdvice(1, 1, 0.1, 0.3, 1, 1),
        ScaleAdvice(1, 2, 0.1, 0.9, 1, 1),
        ScaleAdvice(1, 2, 0.1, 0.9, 1, 2),
        ScaleAdvice(1, 1, 0.0, 0.0, 1, 2),
    ]
    calls: list[tuple[str, int]] = []
    changed: list[int] = []

    async def advise() -> ScaleAdvice | None:
        return advice.pop(0)

    async def set_replicas(name: str, n: int) -> None:
        calls.append((name, n))

    async def on_change() -> None:
        changed.append(len(calls))

    scaler = ReplicaScaler(advise, set_replicas, {"prefill": ("prefill", 1), "decode": ("decode", 1)},
                           on_change=on_change)
    assert scaler.health() == {"applied": {"prefill": 1, "decode": 1}, "advice": None, "changes": []}

    async def run() -> None:
        for _ in range(6):
            await scaler.step()

    asyncio.run(run())
    assert calls == [("decode", 2), ("decode", 1)]
    assert changed == [1, 2]
    health = scaler.health()
    assert health["applied"] == {"prefill": 1, "decode": 1}
    assert health["advice"] is not None
    assert health["advice"]["decode"] == 1 and health["advice"]["decode_pressure"] == 0.0
    assert health["advice"]["num_decode"] == 2
    assert [(c["deployment"], c["replicas"], c["pressure"]) for c in health["changes"]] == [
        ("decode", 2, 0.9), ("decode", 1, 0.0)]


def test_only_the_last_changes_are_kept() -> None:
    from deploy.scaler import HISTORY

    flips = iter([ScaleAdvice(1, 1 + i % 2, 0.1, 0.5, 1, 1) for i in range(1, 2 * HISTORY + 2)])

    async def advise() -> ScaleAdvice | None:
        return next(flips)

    async def set_replicas(name: str, n: int) -> None:
        pass

    scaler = ReplicaScaler(advise, set_replicas, {"decode": ("decode", 1)})

    async def run() -> None:
        for _ in range(2 * HISTORY + 1):
            await scaler.step()

    asyncio.run(run())
    changes = scaler.health()["changes"]
    assert len(changes) == HISTORY
    assert changes[-1]["replicas"] == 2  # the newest kept, the oldest dropped
