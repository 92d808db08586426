"""Stand-ins for `ray.util.metrics` Counter/Gauge/Histogram that remember every call.

Swapped in at the class boundary (the module attributes deploy/metrics.py looks up when a recorder
is built). Stricter than Ray about tags: every record must carry exactly the declared tag keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from ray.util import metrics as ray_metrics


@dataclass
class Recorded:
    kinds: dict[str, str] = field(default_factory=dict)  # metric name -> counter | gauge | histogram
    calls: list[tuple[str, float, dict[str, str]]] = field(default_factory=list)

    def _match(self, name: str, tags: dict[str, str]) -> list[float]:
        return [v for n, v, t in self.calls if n == name and all(t.get(k) == x for k, x in tags.items())]

    def total(self, name: str, **tags: str) -> float:
        assert self.kinds[name] == "counter", name
        return sum(self._match(name, tags))

    def increments(self, name: str, **tags: str) -> list[float]:
        return self._match(name, tags)

    def observed(self, name: str, **tags: str) -> list[float]:
        assert self.kinds[name] == "histogram", name
        return self._match(name, tags)

    def gauge(self, name: str, **tags: str) -> float | None:
        assert self.kinds[name] == "gauge", name
        values = self._match(name, tags)
        return values[-1] if values else None


def install(monkeypatch: pytest.MonkeyPatch) -> Recorded:
    rec = Recorded()

    class Fake:
        kind = ""

        def __init__(self, name: str, description: str = "", boundaries: list[float] | None = None,
                     tag_keys: tuple[str, ...] | None = None) -> None:
            assert description, f"{name} has no description"
            assert (boundaries is not None) == (self.kind == "histogram"), name
            if boundaries is not None:
                assert list(boundaries) == sorted(boundaries) and boundaries[0] > 0, name
            self.name, self.tag_keys = name, tuple(tag_keys or ())
            rec.kinds[name] = self.kind

        def _record(self, value: float, tags: dict[str, str] | None) -> None:
            tags = tags or {}
            assert set(tags) == set(self.tag_keys), (self.name, tags, self.tag_keys)
            assert all(isinstance(v, str) for v in tags.values()), (self.name, tags)
            assert isinstance(value, (int, float)), (self.name, value)
            rec.calls.append((self.name, value, dict(tags)))

    class Counter(Fake):
        kind = "counter"

        def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
            assert value > 0, f"Ray refuses a counter increment of {value} ({self.name})"
            self._record(value, tags)

    class Gauge(Fake):
        kind = "gauge"

        def set(self, value: float, tags: dict[str, str] | None = None) -> None:
            self._record(value, tags)

    class Histogram(Fake):
        kind = "histogram"

        def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
            self._record(value, tags)

    fakes: dict[str, Any] = {"Counter": Counter, "Gauge": Gauge, "Histogram": Histogram}
    for name, cls in fakes.items():
        monkeypatch.setattr(ray_metrics, name, cls)
    return rec
