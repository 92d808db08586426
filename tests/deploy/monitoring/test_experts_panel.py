"""The dashboard's MoE section: per worker, expert shares and imbalance over the tokens routed since
the previous poll, the table version, safe-mode layers; wired from an expert source (`dashboard_for(..., experts=)`)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI

from actors.engine.moe.telemetry import ExpertLoadReport
from deploy.openai.timeline import TimelineRecorder
from deploy.dashboard.experts import ExpertWindow
from deploy.dashboard.page import PAGE_HTML
from deploy.dashboard.provider import dashboard_for
from deploy.dashboard.routes import mount_dashboard
from tests.server_thread import ServerThread


def report(tokens, version: int = 0, safe=()) -> ExpertLoadReport:  # type: ignore[no-untyped-def]
    return ExpertLoadReport(version, tuple(map(tuple, tokens)), tuple(safe))


def test_figures_cover_the_tokens_since_the_previous_poll() -> None:
    window = ExpertWindow()
    first = window.figures({"d0": report([[30, 10, 10, 10]])})[0]
    assert (first.num_tokens, first.imbalance, first.shares) == (60, 2.0, [[0.5, 0.1667, 0.1667, 0.1667]])
    second = window.figures({"d0": report([[30, 30, 20, 10]], version=2, safe=[0])})[0]
    assert (second.num_tokens, second.imbalance, second.shares) == (30, 2.667, [[0.0, 0.6667, 0.3333, 0.0]])
    assert second.table_version == 2 and second.safe_mode_layers == [0]
    restarted = window.figures({"d0": report([[1, 1, 1, 1]])})[0]  # counts went backwards
    assert restarted.num_tokens == 4 and restarted.imbalance == 1.0
    idle = window.figures({"d0": report([[1, 1, 1, 1]], version=3)})[0]
    assert idle.num_tokens == 4 and idle.table_version == 3  # nothing new: the last load stays shown


class Backend:
    """An HTTP backend with no requests yet, whose workers report expert loads."""

    def __init__(self) -> None:
        self.timelines = TimelineRecorder()
        self.reports = {"decode-0": report([[8, 0, 0, 0], [2, 2, 2, 2]]), "prefill-0": report([[1, 1, 1, 1]] * 2)}

    def timeline(self, request_id: str) -> dict[str, Any] | None:
        return None

    async def expert_reports(self) -> dict[str, ExpertLoadReport]:
        return self.reports


def test_the_dashboard_data_carries_the_experts_section() -> None:
    backend = Backend()
    data = asyncio.run(dashboard_for(backend, experts=backend).dashboard_data()).to_json()
    experts = {x["worker"]: x for x in data["experts"]}
    assert experts["decode-0"]["imbalance"] == 4.0 and experts["decode-0"]["num_tokens"] == 16
    assert experts["prefill-0"]["shares"] == [[0.25] * 4] * 2
    dense = asyncio.run(dashboard_for(Backend()).dashboard_data()).to_json()  # a dense model: no expert source
    assert dense["experts"] == []
    assert 'id="experts"' in PAGE_HTML and "renderExperts(d.experts)" in PAGE_HTML


@pytest.mark.slow
def test_the_page_renders_the_experts_rows(tmp_path: Path) -> None:
    from tests.deploy.monitoring.test_dashboard_browser import Dom, run_chromium
    from tests.deploy.monitoring.conftest import chromium_path

    chromium = chromium_path()
    if chromium is None:
        pytest.skip("chromium is not installed")
    app = FastAPI()
    backend = Backend()
    backend.reports["decode-0"] = report([[8, 0, 0, 0], [2, 2, 2, 2]], version=3, safe=[1])
    mount_dashboard(app, dashboard_for(backend, experts=backend))
    with ServerThread(app) as server:
        dom = Dom(run_chromium(chromium, tmp_path / "profile", server.base_url + "/dashboard", "--dump-dom").stdout).root
    assert dom.one("section", id="experts-panel").attrs.get("hidden") is None
    row = dom.one("table", id="experts").one("tr", data_worker="decode-0")
    cells = {f: row.one("td", data_field=f).text() for f in ("table_version", "num_tokens", "imbalance", "safe_mode_layers")}
    assert cells == {"table_version": "v3", "num_tokens": "16", "imbalance": "4.00", "safe_mode_layers": "1"}
    assert len(row.one("td", data_field="shares").find_all("rect")) == 8  # 2 layers x 4 experts
