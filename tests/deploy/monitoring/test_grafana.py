"""deploy/grafana/ferry.json: valid dashboard JSON whose every query names a series deploy/metrics.py
exports, and which shows every metric deploy/metrics.py declares."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from deploy.metrics import CLUSTER_METRICS, REQUEST_METRICS, SEMANTIC_METRICS, exported_names

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "ferry.json"
SERIES = re.compile(r"\bray_ferry_[a-z0-9_]+")


def load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def queries(dash: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dash["templating"]["list"] if "definition" in v]
    return exprs


def test_every_query_names_an_exported_series() -> None:
    exprs = queries(load())
    assert len(exprs) > 20
    used = {name for e in exprs for name in SERIES.findall(e)}
    assert used - exported_names() == set()  # e.g. a counter without _total would show up here


def test_every_declared_metric_has_a_panel() -> None:
    used = {name for e in queries(load()) for name in SERIES.findall(e)}
    declared = {**REQUEST_METRICS, **CLUSTER_METRICS, **SEMANTIC_METRICS}
    shown = {name for name in declared if any(u.removeprefix("ray_").startswith(name) for u in used)}
    assert set(declared) == shown


def test_queries_are_well_formed() -> None:
    for e in queries(load()):
        for open_, close in ("()", "{}", "[]"):
            depth = 0
            for ch in e:
                depth += (ch == open_) - (ch == close)
                assert depth >= 0, e
            assert depth == 0, e
        if "histogram_quantile" in e:
            assert "_bucket" in e and re.search(r"by \(le\b", e), e
        assert e.count('"') % 2 == 0, e


def test_panels_have_unique_ids_a_datasource_and_a_place() -> None:
    dash = load()
    assert dash["uid"] == "ferry-serving" and dash["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert all(t["datasource"] == p["datasource"] for t in p["targets"]), p["title"]
