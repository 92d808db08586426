"""The router's replacement of dead workers (`cluster/router/replacement.py`), against hand-made worker handles (no Ray): a worker whose
engine loop died is declared dead by a load poll and replaced; a replacement that fails is tried
again with backoff and given up after `replace_attempts`; without a replacer nothing is started.
The Ray tests (tests/cluster/ray/test_replace.py) kill real actors with streams in flight."""

from __future__ import annotations

import asyncio

from actors.messages import WorkerLoad
from cluster.router.client import Router
from cluster.router.config import RecoveryConfig, RouterConfig


class Worker:
    """A worker handle answering `load`; `healthy=False` is an engine whose loop died."""

    def __init__(self, name: str, kind: str, healthy: bool = True) -> None:
        self.name, self.kind, self.healthy = name, kind, healthy

    async def load(self) -> WorkerLoad:
        return WorkerLoad(self.name, self.kind, 0, 0, 0, 10, 10, 0.0, self.healthy)  # type: ignore[arg-type]


class Replacer:
    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.calls: list[str] = []

    async def replace(self, name: str) -> Worker:
        self.calls.append(name)
        if len(self.calls) <= self.failures:
            raise RuntimeError(f"start {len(self.calls)} of {name} failed")
        return Worker(name, "decode")


def client(replacer: Replacer | None, attempts: int = 3) -> Router:
    return Router({"p0": Worker("p0", "prefill")}, {"d0": Worker("d0", "decode", healthy=False)},  # type: ignore[dict-item]
                  RouterConfig(load_ttl_s=0.0), recovery=RecoveryConfig(replace_attempts=attempts,
                                                                        replace_backoff_s=0.0),
                  replacer=replacer)  # type: ignore[arg-type]


async def poll_and_wait(c: Router) -> dict[str, WorkerLoad]:
    first = await c.loads()
    if c.replacements is not None:
        await asyncio.gather(*c.replacements.replacing.values())
    assert first["d0"].healthy is False
    return await c.loads()


def test_a_worker_whose_engine_died_is_replaced_from_a_load_poll() -> None:
    replacer = Replacer()
    c = client(replacer)
    old = c.decodes["d0"]
    loads = asyncio.run(poll_and_wait(c))
    reps = c.replacements
    assert reps is not None and replacer.calls == ["d0"] and c.decodes["d0"] is not old and reps.num_replaced == 1
    assert not c.board.dead and not reps.replacing and loads["d0"].healthy and loads["p0"].healthy


def test_a_failing_replacement_is_tried_again_then_given_up() -> None:
    replacer = Replacer(failures=2)
    c = client(replacer, attempts=3)
    assert asyncio.run(poll_and_wait(c))["d0"].healthy  # the third try started it
    assert replacer.calls == ["d0"] * 3 and c.replacements is not None and c.replacements.num_replaced == 1

    replacer = Replacer(failures=5)
    c = client(replacer, attempts=2)
    loads = asyncio.run(poll_and_wait(c))
    reps = c.replacements
    assert reps is not None and replacer.calls == ["d0"] * 2 and reps.num_replaced == 0
    assert c.board.dead == {"d0"} and not loads["d0"].healthy and not reps.replacing  # left out for good


def test_without_a_replacer_a_dead_worker_stays_dead() -> None:
    c = client(None)
    loads = asyncio.run(poll_and_wait(c))
    assert c.board.dead == {"d0"} and not loads["d0"].healthy and c.replacements is None
