"""Token-level latency breakdown and its bounded store."""

from __future__ import annotations

import pytest

from cluster.descriptors import RequestId, TenantId
from cluster.timeline import Stage, TimelineStore


def test_breakdown_durations_are_exact() -> None:
    store = TimelineStore(max_finished=2, max_tokens_kept=3)
    rid = RequestId("a")
    store.start(rid, TenantId("t"), 10.0)
    for stage, t in ((Stage.ADMITTED, 10.001), (Stage.PREFILL_START, 10.1), (Stage.PREFIX_LOOKUP_DONE, 10.102),
                     (Stage.PREFILL_DONE, 10.3), (Stage.KV_TRANSFER_DONE, 10.32), (Stage.DECODE_ADMITTED, 10.33)):
        store.stamp(rid, stage, t)
    for t in (10.3, 10.35, 10.40, 10.47, 10.50):
        store.token(rid, t)
    store.finish(rid, 10.5)
    b = store.get(rid)
    assert b is not None
    assert b["queue_s"] == pytest.approx(0.099)
    assert b["prefix_lookup_s"] == pytest.approx(0.002)
    assert b["prefill_compute_s"] == pytest.approx(0.198)
    assert b["kv_transfer_s"] == pytest.approx(0.02)
    assert b["decode_admission_s"] == pytest.approx(0.01)
    assert b["ttft_s"] == pytest.approx(0.3)
    assert b["tpot_s"] == pytest.approx(0.05)
    assert b["e2e_s"] == pytest.approx(0.5)
    assert b["num_tokens"] == 5 and b["token_times"] == [10.3, 10.35, 10.40]  # capped at 3 stamps
    assert b["max_itl_s"] == pytest.approx(0.05)


def test_store_keeps_only_the_most_recent_finished() -> None:
    store = TimelineStore(max_finished=2)
    for i in range(4):
        rid = RequestId(f"r{i}")
        store.start(rid, TenantId("t"), float(i))
        store.finish(rid, i + 0.5)
    assert [b["request_id"] for b in store.recent()] == ["r3", "r2"]
    assert store.get(RequestId("r0")) is None and store.num_finished == 2
