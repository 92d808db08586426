"""Each KV transfer's codec choice, from the prefill worker's report through the request timeline
to the dashboard's record and the Prometheus families."""

from __future__ import annotations

import pytest

from actors.messages import PrefillResult, WorkerLoad
from deploy.cluster_backend import ClusterBackend
from deploy.dashboard.records import record_from_timeline
from deploy.metrics import RequestMetrics
from deploy.openai.timeline import TimelineRecorder
from tests.deploy.monitoring.fake_metrics import Recorded, install
from tests.deploy.monitoring.test_provider import PREFILL, timeline

CODEC = {"codec": "int8", "reason": "predicted", "predicted_s": 0.004, "actual_s": 0.005, "encode_s": 0.002,
         "send_s": 0.002, "kv_raw_bytes": 8192, "predictions_s": {"none": 0.006, "int8": 0.004, "fp8": 0.0045},
         "fidelity": "lossy", "lossless": False}


@pytest.fixture
def rec(monkeypatch: pytest.MonkeyPatch) -> Recorded:
    return install(monkeypatch)


def test_the_codec_choice_becomes_a_count_and_predicted_and_actual_times(rec: Recorded) -> None:
    RequestMetrics().on_finished(timeline("r", "acme", 0.0, [25.0], "length", prefill={**PREFILL, "kv_codec": CODEC}))
    assert rec.total("ferry_kv_transfers", codec="int8", fidelity="lossy", reason="predicted") == 1
    assert rec.total("ferry_kv_codec_bytes", codec="int8", fidelity="lossy", bytes="raw") == 8192
    assert rec.total("ferry_kv_codec_bytes", codec="int8", fidelity="lossy", bytes="wire") == PREFILL["kv_wire_bytes"]
    assert rec.observed("ferry_kv_codec_ms", codec="int8", estimate="predicted") == [pytest.approx(4.0)]
    assert rec.observed("ferry_kv_codec_ms", codec="int8", estimate="actual") == [pytest.approx(5.0)]


def test_a_report_without_a_codec_section_records_no_codec(rec: Recorded) -> None:
    RequestMetrics().on_finished(timeline("r", "acme", 0.0, [25.0], "length", prefill=PREFILL))
    assert rec.increments("ferry_kv_transfers") == [] and rec.observed("ferry_kv_codec_ms") == []
    assert record_from_timeline(timeline("r", "a", 0.0, [1.0], "stop", prefill=PREFILL)).prefill.kv_codec is None  # type: ignore[union-attr]


class _Board:
    def cached(self) -> dict[str, WorkerLoad]:
        return {}  # no loads yet: the transfer's nodes are unknown


class _Client:
    def __init__(self, result: PrefillResult) -> None:
        self.result = result
        self.board = _Board()

    def prefill_result(self, request_id: str) -> PrefillResult | None:
        return self.result if request_id == self.result.request_id else None


def test_the_request_timeline_carries_the_prefill_workers_codec_report() -> None:
    result = PrefillResult(
        request_id="r1", worker="p0", num_prompt_tokens=40, num_computed_tokens=40, num_local_hit_blocks=0,
        num_pool_hit_blocks=0, num_kv_blocks=3, kv_raw_bytes=8192, kv_wire_bytes=2300, num_shards=2, queued_s=0.0,
        lookup_s=0.001, compute_s=0.01, transfer_s=0.006, finished_at=1.0, kv_codec="fp8", kv_codec_reason="explore",
        kv_codec_predicted_s=0.0045, kv_codec_actual_s=0.005, kv_encode_s=0.002, kv_send_s=0.0025,
        kv_codec_predictions=(("none", 0.004), ("int8", 0.0042), ("fp8", 0.0045)), kv_fidelity="lossy")
    backend = ClusterBackend.__new__(ClusterBackend)  # only what `timeline` reads
    backend.timelines, backend.client = TimelineRecorder(), _Client(result)  # type: ignore[assignment]
    backend.timelines.open("r1", "acme")
    prefill = backend.timeline("r1")["prefill"]  # type: ignore[index]
    # No token streamed yet and no load polled: where the KV went is not known.
    assert (prefill["node"], prefill["kv_to"]) == (None, {"worker": None, "node": None, "cross_node": None})
    section = prefill["kv_codec"]
    assert section == {"codec": "fp8", "reason": "explore", "predicted_s": 0.0045, "actual_s": 0.005,
                       "encode_s": 0.002, "send_s": 0.0025, "kv_raw_bytes": 8192,
                       "predictions_s": {"none": 0.004, "int8": 0.0042, "fp8": 0.0045},
                       "fidelity": "lossy", "lossless": False}
    report = record_from_timeline(backend.timeline("r1")).prefill  # type: ignore[arg-type]
    assert report is not None and (report.kv_codec, report.kv_codec_reason) == ("fp8", "explore")
    assert (report.kv_codec_predicted_ms, report.kv_codec_actual_ms) == (pytest.approx(4.5), pytest.approx(5.0))
    assert (report.kv_fidelity, report.kv_raw_bytes) == ("lossy", 8192)
