"""vLLM-style metric math on hand-made timelines (no servers)."""

from __future__ import annotations

import math

import pytest

from bench.loadgen.metrics import ClientRecord, Slo, is_good, summarize


def _rec(send: float, chunks: list[float], n: int | None = None, tenant: str = "a", ok: bool = True) -> ClientRecord:
    return ClientRecord(send_s=send, chunk_s=chunks, output_tokens=n, success=ok, tenant=tenant)


def test_ttft_tpot_itl_e2e_of_one_timeline() -> None:
    r = _rec(10.0, [10.2, 10.25, 10.35, 10.40], n=4)
    assert r.ttft_s == pytest.approx(0.2)
    assert r.e2el_s == pytest.approx(0.4)
    assert r.itl_s == pytest.approx([0.05, 0.10, 0.05])
    assert r.tpot_s == pytest.approx((0.4 - 0.2) / 3)


def test_tpot_uses_usage_tokens_not_chunks() -> None:
    # 2 chunks carrying 5 tokens: TPOT divides by tokens - 1, ITL stays per chunk.
    r = _rec(0.0, [0.1, 0.5], n=5)
    assert r.tpot_s == pytest.approx(0.4 / 4)
    assert r.itl_s == pytest.approx([0.4])


def test_one_token_output_is_out_of_tpot_but_good_on_tpot() -> None:
    one = _rec(0.0, [0.3], n=1)
    many = _rec(0.0, [0.1, 0.2, 0.3], n=3)
    assert one.tpot_s == 0.0
    s = summarize([one, many], duration_s=2.0, slos={"default": Slo(ttft_ms=400, tpot_ms=10)})
    assert s.tpot_ms["p50"] == pytest.approx(100.0)  # only `many`: (0.3 - 0.1) / 2
    assert s.ttft_ms["p50"] == pytest.approx(200.0)
    assert s.goodput == pytest.approx(0.5)  # `one` is good (TPOT 0), `many` misses TPOT


def test_percentiles_are_linear_interpolation() -> None:
    recs = [_rec(0.0, [t / 1000.0], n=1) for t in (10, 20, 30, 40, 50)]
    s = summarize(recs, duration_s=1.0, slos={})
    assert s.ttft_ms["p50"] == pytest.approx(30.0)
    assert s.ttft_ms["p90"] == pytest.approx(46.0)
    assert s.ttft_ms["p99"] == pytest.approx(49.6)
    assert s.ttft_ms["mean"] == pytest.approx(30.0)


def test_slo_boundary_is_inclusive_and_failures_are_never_good() -> None:
    assert is_good(_rec(0.0, [0.5], n=1), Slo(ttft_ms=500))
    assert not is_good(_rec(0.0, [0.5001], n=1), Slo(ttft_ms=500))
    assert not is_good(_rec(0.0, [], ok=False), Slo())
    assert is_good(_rec(0.0, [0.1, 2.0], n=2), Slo(ttft_ms=200))  # E2E not promised
    assert not is_good(_rec(0.0, [0.1, 2.0], n=2), Slo(e2el_ms=1000))


def test_throughput_goodput_and_tenant_attainment() -> None:
    recs = [
        _rec(0.0, [0.1, 0.2], n=2, tenant="a"),  # good
        _rec(0.0, [0.9, 1.0], n=2, tenant="a"),  # TTFT miss
        _rec(0.0, [0.1, 0.15], n=2, tenant="b"),  # good
        _rec(0.0, [], tenant="b", ok=False),  # failed
        _rec(0.0, [0.6, 0.9], n=2, tenant="b"),  # TTFT and TPOT miss
    ]
    s = summarize(recs[:4], duration_s=4.0, slos={"default": Slo(ttft_ms=500, tpot_ms=200)})
    assert (s.num_sent, s.completed, s.failed) == (4, 3, 1)
    assert s.request_throughput == pytest.approx(3 / 4)
    assert s.output_throughput == pytest.approx(6 / 4)
    assert s.goodput == pytest.approx(2 / 4)
    assert s.attainment == pytest.approx(0.5)
    a, b = s.tenants["a"], s.tenants["b"]
    assert {k: a[k] for k in ("sent", "ok", "good", "attainment")} == {"sent": 2, "ok": 2, "good": 1, "attainment": 0.5}
    assert {k: b[k] for k in ("sent", "ok", "good", "attainment")} == {"sent": 2, "ok": 1, "good": 1, "attainment": 0.5}
    assert a["ttft_p99_ms"] == pytest.approx(100 + 0.99 * 800)  # each tenant's own latencies: 100 and 900 ms
    assert b["ttft_p99_ms"] == pytest.approx(100) and b["tpot_p99_ms"] == pytest.approx(50)
    assert s.missed == {"ttft": 1, "tpot": 0, "e2el": 0}
    both = summarize(recs, duration_s=4.0, slos={"default": Slo(ttft_ms=500, tpot_ms=200)})
    assert both.missed == {"ttft": 2, "tpot": 1, "e2el": 0}  # which promise the misses break


def test_per_class_slos() -> None:
    fast = ClientRecord(send_s=0.0, chunk_s=[0.3], output_tokens=1, success=True, slo_class="batch")
    s = summarize([fast], 1.0, {"default": Slo(ttft_ms=100), "batch": Slo(ttft_ms=1000)})
    assert s.goodput == 1.0


def test_empty_metrics_are_nan_and_slo_parse() -> None:
    s = summarize([], 1.0, {})
    assert math.isnan(s.ttft_ms["p99"]) and s.goodput == 0.0
    assert Slo.parse("ttft:500,tpot:50") == Slo(ttft_ms=500.0, tpot_ms=50.0)
    assert Slo.parse("e2el:9") == Slo(e2el_ms=9.0)
    with pytest.raises(ValueError, match="bad SLO"):
        Slo.parse("itl:5")
