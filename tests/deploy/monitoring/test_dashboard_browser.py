"""The dashboard page rendered by headless Chromium after real requests: the DOM shows the same
numbers `/dashboard/data` reports, formatted as the page formats them; a screenshot is saved."""

from __future__ import annotations

import os
import shutil
import subprocess
from decimal import ROUND_HALF_UP, Decimal
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx2
import pytest

from tests.deploy.monitoring.conftest import Served, chromium_path

pytestmark = pytest.mark.slow

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1280,1600", "--virtual-time-budget=5000"]


@pytest.fixture(scope="session")
def chromium() -> Path:
    found = chromium_path()
    if found is None and shutil.which("apt-get") and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], env=env, capture_output=True, timeout=900)
        found = chromium_path()
    if found is None:
        pytest.skip("Debian's chromium is not installed and `apt-get install -y chromium` could not install it")
    return found


def run_chromium(chromium: Path, profile: Path, url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([str(chromium), *FLAGS, f"--user-data-dir={profile}", *extra, url],
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


class Node:
    def __init__(self, tag: str, attrs: dict[str, str]) -> None:
        self.tag, self.attrs, self.children, self.parts = tag, attrs, [], []  # type: ignore[var-annotated]

    def text(self) -> str:
        return "".join(self.parts[:1] + [c.text() for c in self.children] + self.parts[1:]).strip()

    def find_all(self, tag: str, **attrs: str) -> list["Node"]:
        found = [self] if self.tag == tag and all(self.attrs.get(k.replace("_", "-")) == v
                                                    for k, v in attrs.items()) else []
        return found + [n for c in self.children for n in c.find_all(tag, **attrs)]

    def one(self, tag: str, **attrs: str) -> "Node":
        found = self.find_all(tag, **attrs)
        assert len(found) == 1, (tag, attrs, len(found))
        return found[0]


class Dom(HTMLParser):
    """A small tree of the dumped DOM (enough for tables and SVG: every element is closed)."""

    VOID = {"meta", "br", "img", "input", "link", "hr"}

    def __init__(self, html: str) -> None:
        super().__init__()
        self.root = Node("#root", {})
        self._stack = [self.root]
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self._stack[-1].children.append(node)
        if tag not in self.VOID:
            self._stack.append(node)

    def handle_endtag(self, tag: str) -> None:
        while len(self._stack) > 1 and self._stack.pop().tag != tag:
            pass

    def handle_data(self, data: str) -> None:
        self._stack[-1].parts.append(data)


def fixed(v: float, digits: int) -> str:
    """JavaScript's `toFixed` (rounds the exact binary value half up)."""
    return str(Decimal(v).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))


def fmt_ms(v: float | None) -> str:
    return "-" if v is None else fixed(v, 1) + " ms"


def fmt_pct(v: float | None) -> str:
    return "-" if v is None else fixed(100 * v, 1) + "%"


def test_the_rendered_page_shows_the_reported_numbers(traffic: Served, chromium: Path, tmp_path: Path) -> None:
    url = traffic.base_url + "/dashboard"
    data: dict[str, Any] = httpx2.get(url + "/data", timeout=10).json()
    dom = Dom(run_chromium(chromium, tmp_path / "profile-dom", url, "--dump-dom").stdout).root
    shot = tmp_path / "dashboard.png"
    run_chromium(chromium, tmp_path / "profile-shot", url, f"--screenshot={shot}")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    print(f"dashboard screenshot: {shot}")

    assert dom.one("span", id="status").text() == "live"
    assert [tr.attrs["data-tenant"] for tr in dom.one("table", id="tenants").find_all("tr")[1:]] == [
        "tenant-a", "tenant-b"]
    for t in data["tenants"]:
        row = dom.one("tr", data_tenant=t["tenant"])

        def cell(field: str) -> str:
            return row.one("td", data_field=field).text()

        assert cell("num_completed") == str(t["num_completed"])
        for field in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"):
            assert cell(field) == fmt_ms(t[field]), field
        slo = t["slo"]
        assert cell("ttft_slo_ms") == (fmt_ms(slo["ttft_ms"]) if slo else "no SLO")
        assert cell("slo_attainment") == (fmt_pct(t["slo_attainment"]) if slo else "no SLO")
    assert dom.one("tr", data_tenant="tenant-a").one("td", data_field="ttft_slo_ms").text() == "2000.0 ms"
    assert dom.one("tr", data_tenant="tenant-b").one("td", data_field="tpot_slo_ms").text() == "no SLO"

    assert dom.one("div", id="tp-completed").text() == "5" == str(data["throughput"]["num_completed"])
    assert dom.one("div", id="tp-refused").text() == "1"
    assert dom.one("tr", data_reason="tenant_over_budget").one("td", data_field="count").text() == "1"
    worker = data["workers"][0]
    assert dom.one("tr", data_worker="engine-0").one("td", data_field="kv_blocks").text() == (
        f"{worker['kv_blocks_used']} / {worker['kv_blocks_total']}")
    hbm = next(t for t in data["tiers"] if t["tier"] == "hbm")
    assert dom.one("tr", data_tier="hbm").one("td", data_field="hit_rate").text() == fmt_pct(hbm["hit_rate"])

    chart = dom.one("svg", id="timeline")
    bars = chart.find_all("g")
    assert [g.attrs["data-request"] for g in bars] == [r["request_id"] for r in data["recent"]]
    for g, r in zip(bars, data["recent"]):
        assert [rect.attrs["data-stage"] for rect in g.find_all("rect")] == [s["stage"] for s in r["stages"]]
        assert len(g.find_all("line")) == len(r["token_ms"])  # one tick per token
