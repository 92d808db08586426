"""The streaming client against a tiny in-process SSE server on 127.0.0.1 (no model, no Ray)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench.loadgen.client import ClientConfig, replay
from bench.loadgen.metrics import Slo, summarize
from bench.loadgen.probe import PROBE_PROMPT, ProbeAnswer, judge, probe
from bench.loadgen.stages import _union_s, fetch_timelines, summarize_stages
from bench.loadgen.workload import BenchRequest

SEEN: list[dict[str, object]] = []
HEALTH = {"calls": 0, "on": False, "pool": False}
TIMELINES: dict[str, dict[str, object]] = {}
PROBE_ANSWER = {"text": " Paris. It is the largest city"}  # request id -> what GET /v1/requests/{id}/timeline answers  # /health answers like a ferry cluster only when "on"


# max_tokens -> how the fake fails that request: "shed" (429 with an OpenAI error body naming its code),
# "bare" (429 with a body that is not JSON), "crash" (500), "hang" (headers, then nothing for 3 s)
FAILING = {91: "shed", 92: "bare", 93: "crash", 94: "hang"}


def _fail(h: BaseHTTPRequestHandler, how: str) -> None:
    if how == "hang":
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.end_headers()
        h.wfile.flush()
        time.sleep(3.0)
        return
    body = {"shed": json.dumps({"error": {"message": "Request refused: slo_unattainable: predicted TTFT 6628 ms",
                                          "type": "rate_limit_error", "code": "slo_unattainable"}}),
            "bare": "too busy", "crash": "oops"}[how].encode()
    h.send_response(500 if how == "crash" else 429)
    h.send_header("Content-Length", str(len(body)))
    h.end_headers()
    h.wfile.write(body)


class _Fake(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        SEEN.append({**body, "slo_class": self.headers.get("x-ferry-slo-class")})
        if not body.get("stream"):  # the greedy probe
            answer = json.dumps({"choices": [{"text": PROBE_ANSWER["text"]}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)
            return
        if (how := FAILING.get(int(body["max_tokens"]))) is not None:
            _fail(self, how)
            return
        self.send_response(200)
        self.send_header("x-request-id", "serve-proxy-id")  # Ray Serve's proxy adds its own id too
        self.send_header("x-request-id", f"cmpl-{len(SEEN)}")
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = int(body["max_tokens"])
        # Two tokens per chunk, as servers that coalesce do: usage must win over the chunk count.
        for i in range(0, n, 2):
            self.wfile.write(f"data: {json.dumps({'choices': [{'text': 'ab'}]})}\n\n".encode())
            self.wfile.flush()
        usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/health" and HEALTH["on"]:
            HEALTH["calls"] += 1  # a worker that grows 10 MiB per look, and one that does not say
            n = HEALTH["calls"]  # an ingress that preempts 3 batch rows and resumes 1 between looks
            report = {"healthy": True, "workers": {
                "d0": {"kind": "decode", "healthy": True, "rss_mib": 1000 + 10 * n},
                "p0": {"kind": "prefill", "healthy": True, "kv_plan": {"block_size": 32}}},
                "scheduler": {"available": True, "num_preempted": 3 * n, "num_resumed": n}}
            if HEALTH["pool"]:  # a pool whose stores answer 5 lookups from DRAM and 2 from disk between looks
                report["prefix_pool"] = {"hit_rate": 0.5, "hit_blocks": {"dram": 5 * n, "disk": 2 * n},
                                         "miss_blocks": n, "stores_answered": 2}
            body = json.dumps(report).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        timeline = TIMELINES.get(self.path.removeprefix("/v1/requests/").removesuffix("/timeline"))
        if timeline is not None:
            body = json.dumps(timeline).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        body = json.dumps({"object": "list", "data": [{"id": "served-name", "object": "model"}]}).encode()
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def server() -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_replay_records_tokens_from_usage_and_sends_stream_options(server: str) -> None:
    SEEN.clear()
    reqs = [BenchRequest(0.0, 5, 4, slo_class="batch"), BenchRequest(0.05, 7, 1), BenchRequest(10.0, 5, 4)]
    cfg = ClientConfig(url=server, model="m", duration_s=1.0, grace_s=5.0)
    records, dur = asyncio.run(replay(cfg, reqs))
    assert len(records) == 2  # the third arrives after the 1 s bound: never sent
    assert [r.num_output for r in records] == [4, 1] and [len(r.chunk_s) for r in records] == [2, 1]
    assert all(r.success for r in records) and dur > 0
    assert SEEN[0]["stream_options"] == {"include_usage": True} and SEEN[0]["ignore_eos"] is True
    assert SEEN[0]["slo_class"] == "batch" and len(str(SEEN[1]["prompt"]).split()) == 7
    s = summarize(records, dur, {"default": Slo(ttft_ms=60_000)})
    assert s.completed == 2 and s.goodput > 0


def test_failed_requests_are_told_apart_refused_with_reason_lost_or_other(server: str, tmp_path) -> None:
    # At 2x the knee a server may refuse, but each refusal must carry its reason, and nothing may be
    # lost: the harness must tell those apart, or "12 failed" hides a hang behind a shed.
    from bench.loadgen.report import RatePoint, SystemResult, write_results_md

    reqs = [BenchRequest(0.0, 5, n) for n in (4, 91, 91, 92, 93, 94)]
    records, dur = asyncio.run(replay(ClientConfig(url=server, model="m", duration_s=0.5, grace_s=1.0), reqs))
    s = summarize(records, dur, {"default": Slo(ttft_ms=60_000)})
    assert s.completed == 1 and s.failed == 5
    assert s.failures == {"refused": 2, "refused_no_reason": 1, "lost": 1, "error": 1}
    assert s.refusal_codes == {"slo_unattainable": 2}
    assert [r.status for r in records] == [200, 429, 429, 429, 500, 200]
    text = s.failures_text()
    assert text.startswith("5 failed: 2 refused with a reason (slo_unattainable 2), 1 refused without one, 1 lost")
    result = SystemResult("fake")
    result.points.append(RatePoint.of(1.0, s, records, {}, None, None, None))
    md = tmp_path / "RESULTS.md"
    write_results_md([result], {"machine": "m", "command": "c", "workload": "w", "slo": {}, "when": "now"}, 0.9, md, [])
    assert f"- fake at 1 rps: {text} of 6 sent" in md.read_text()


def test_replay_counts_refused_connections_as_failed() -> None:
    cfg = ClientConfig(url="http://127.0.0.1:9", model="m", duration_s=1.0, grace_s=1.0)
    records, _ = asyncio.run(replay(cfg, [BenchRequest(0.0, 3, 2)]))
    assert len(records) == 1 and not records[0].success and records[0].error


def test_warm_up_goes_first_with_other_prompts_and_is_not_recorded(server: str, tmp_path) -> None:
    import argparse

    from bench.loadgen.cli import _run_rates, add_arguments
    from bench.loadgen.report import SystemResult

    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args(["--trace", "none", "--input-len", "6", "--output-len", "2", "--duration", "1",
                      "--grace", "5", "--warmup", "3", "--num-requests", "4", "--out", str(tmp_path)])
    SEEN.clear()
    result = SystemResult("fake")
    _run_rates(a, server, "m", [2.0], {"default": Slo(ttft_ms=60_000)}, result)
    warm, measured = SEEN[:3], SEEN[3:]
    assert len(warm) == 3 and 1 <= len(measured) <= 4
    assert not {str(w["prompt"]) for w in warm} & {str(m["prompt"]) for m in measured}
    assert len(result.points) == 1 and result.points[0].summary.num_sent == len(measured)


def _args(tmp_path, *extra: str):  # type: ignore[no-untyped-def]
    import argparse

    from bench.loadgen.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--trace", "none", "--input-len", "6", "--output-len", "2", "--duration", "1",
                         "--grace", "5", "--warmup", "0", "--num-requests", "3", "--out", str(tmp_path),
                         "--no-prefill-bound", *extra])  # the bound's own tests: test_loadgen_report.py


def test_each_rate_of_a_sweep_sends_prompts_no_earlier_rate_sent(server: str, tmp_path) -> None:
    # Same prompts at every rate would let a prefix cache skip the prefill of everything the
    # earlier rates sent, flattering the later (higher) rates of a server that has one.
    from bench.loadgen.cli import _run_rates
    from bench.loadgen.report import SystemResult

    SEEN.clear()
    result = SystemResult("fake")
    _run_rates(_args(tmp_path), server, "m", [2.0, 3.0], {"default": Slo(ttft_ms=60_000)}, result)
    first, second = result.points[0].summary.num_sent, result.points[1].summary.num_sent
    assert first >= 2 and second >= 2 and len(SEEN) == first + second
    prompts = [str(s["prompt"]) for s in SEEN]
    assert not set(prompts[:first]) & set(prompts[first:])


def test_url_mode_sends_the_model_the_server_lists(server: str, tmp_path) -> None:
    from bench.loadgen.cli import run_bench

    SEEN.clear()
    assert run_bench(_args(tmp_path, "--url", server, "--rate", "3")) == 0
    assert SEEN and {s["model"] for s in SEEN} == {"served-name"}


def test_json_prints_the_figures_of_results_json_on_stdout(server: str, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import json

    from bench.loadgen.cli import run_bench

    assert run_bench(_args(tmp_path, "--url", server, "--rate", "3", "--json")) == 0
    captured = capsys.readouterr()
    figures = json.loads(captured.out)  # nothing else on stdout
    (point,) = figures["systems"][0]["points"]
    assert point["rate_rps"] == 3.0 and point["completed"] >= 1 and "goodput" in point
    written = next(tmp_path.glob("*/results.json"))
    assert json.loads(written.read_text()) == figures and f"results: {written}" in captured.err


def test_worker_memory_before_and_after_each_rate_from_health(server: str, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import json

    from bench.loadgen.cli import run_bench

    HEALTH.update(calls=0, on=True)
    try:
        assert run_bench(_args(tmp_path, "--url", server, "--sweep", "2,3")) == 0
    finally:
        HEALTH["on"] = False
    out = capsys.readouterr().out
    lines = out[out.index("worker memory"):].splitlines()
    rows = [line.split() for line in lines[3:5]]
    assert [(r[1], r[3], r[4], r[5], r[6]) for r in rows] == [("2.00", "d0", "1010", "1020", "10"),
                                                              ("3.00", "d0", "1030", "1040", "10")]
    points = json.loads(next(tmp_path.glob("*/results.json")).read_text())["systems"][0]["points"]
    assert [p["memory_mib"] for p in points] == [{"d0": {"before": 1010, "after": 1020}},
                                                 {"d0": {"before": 1030, "after": 1040}}]


def test_online_and_batch_tenants_get_their_own_attainment_with_the_preemptions_between(  # type: ignore[no-untyped-def]
        server: str, tmp_path, capsys) -> None:
    import json

    from bench.loadgen.cli import run_bench

    HEALTH.update(calls=0, on=True)
    try:
        assert run_bench(_args(tmp_path, "--url", server, "--rate", "3", "--tenants", "online,batch",
                               "--batch-slo", "e2el:60000")) == 0
    finally:
        HEALTH["on"] = False
    out = capsys.readouterr().out
    lines = out[out.index("per tenant"):].splitlines()
    rows = {r[2]: r for r in (line.split() for line in lines[3:5])}
    assert set(rows) == {"online", "batch"}
    assert all(r[-2:] == ["3", "1"] for r in rows.values())  # (6, 2) after the rate - (3, 1) before it
    (point,) = json.loads(next(tmp_path.glob("*/results.json")).read_text())["systems"][0]["points"]
    assert point["preemptions"] == {"preempted": 3, "resumed": 1}
    assert set(point["tenants"]) == {"online", "batch"}
    assert {s["slo_class"] for s in SEEN} >= {"default", "batch"}  # batch requests say so


def test_prefix_reuse_by_tier_from_the_timelines_and_the_pool_counters_around_each_rate(  # type: ignore[no-untyped-def]
        server: str, tmp_path, capsys) -> None:
    import json

    from bench.loadgen.cli import run_bench

    TIMELINES.clear()
    for i in range(1, 12):  # every request handed off: 2 blocks from the prefill's own cache, 1 from the pool
        TIMELINES[f"cmpl-{i}"] = {"num_prompt_tokens": 100, "num_cached_tokens": 0, "ttft_ms": 50.0,
                                  "prefill": {"queued_s": 0.0, "lookup_s": 0.0, "compute_s": 0.01, "transfer_s": 0.0,
                                              "computed_tokens": 4, "finished_at": 1.0, "local_hit_blocks": 2,
                                              "pool_hit_blocks": 1}}
    try:
        for pool in (True, False):
            HEALTH.update(calls=0, on=True, pool=pool)
            SEEN.clear()  # request ids are cmpl-<requests seen>: the probe's and both rates' fit in the timelines
            assert run_bench(_args(tmp_path / str(pool), "--url", server, "--sweep", "2,3")) == 0
            out = capsys.readouterr().out
            points = json.loads(next((tmp_path / str(pool)).glob("*/results.json")).read_text())["systems"][0]["points"]
            for p in points:
                n, st = p["completed"], p["stages"]
                assert n >= 1 and st["num_requests"] == n and st["block_size"] == 32  # the engines' (kv_plan)
                assert (st["prefix_hit_tokens"], st["local_hit_tokens"], st["pool_hit_tokens"]) == (96 * n, 64 * n, 32 * n)
                if pool:  # one /health look before and one after each rate: 5 and 2 blocks of 32 tokens
                    assert (st["pool_dram_tokens"], st["pool_disk_tokens"]) == (160, 64)
                    assert st["pool_lookups"] == {"dram": 5, "disk": 2, "miss": 1}
                else:
                    assert st["pool_dram_tokens"] is None and st["pool_disk_tokens"] is None
            rows = out[out.index("where the time went"):].splitlines()[3:5]
            assert [r.split()[-2:] for r in rows] == ([["160", "64"]] * 2 if pool else [["-", "-"]] * 2)
    finally:
        HEALTH.update(on=False, pool=False)
        TIMELINES.clear()


def test_a_server_without_ferry_health_reports_no_memory(server: str, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from bench.loadgen.cli import run_bench
    from bench.loadgen.peers import HealthFigures, health_figures

    assert health_figures(server) == HealthFigures()  # 404
    assert health_figures("http://127.0.0.1:9") == HealthFigures()  # nothing listening
    assert run_bench(_args(tmp_path, "--url", server, "--rate", "3")) == 0
    assert "worker memory" not in capsys.readouterr().out


def test_stages_come_from_the_servers_timelines_by_request_id(server: str) -> None:
    SEEN.clear()
    TIMELINES.clear()
    # cmpl-1 was handed off (its prefill reused 6 blocks and computed the other 904 tokens in 2 s,
    # from t=10 to t=12; its decode engine, which received that KV, reused none itself), cmpl-2 was
    # prefilled by its decode worker (no prefill stages); cmpl-3 has no timeline (a peer).
    TIMELINES["cmpl-1"] = {"num_prompt_tokens": 1000, "num_cached_tokens": 0, "ttft_ms": 2600.0, "tpot_ms": 50.0,
                           "prefill": {"queued_s": 0.4, "lookup_s": 0.01, "compute_s": 2.0, "transfer_s": 0.1,
                                       "computed_tokens": 904, "finished_at": 12.1, "local_hit_blocks": 2,
                                       "pool_hit_blocks": 4}}
    TIMELINES["cmpl-2"] = {"num_prompt_tokens": 200, "num_cached_tokens": 32, "ttft_ms": 900.0, "tpot_ms": 70.0}
    reqs = [BenchRequest(0.0, 5, 8), BenchRequest(0.0, 5, 8), BenchRequest(0.0, 5, 8)]
    records, dur = asyncio.run(replay(ClientConfig(url=server, model="m", duration_s=1.0, grace_s=5.0), reqs))
    assert sorted(r.request_id for r in records) == ["cmpl-1", "cmpl-2", "cmpl-3"]
    timelines = fetch_timelines(server, records)
    assert sorted(timelines) == ["cmpl-1", "cmpl-2"]
    st = summarize_stages(records, timelines, duration_s=4.0)
    assert st is not None and (st["num_requests"], st["num_handed_off"], st["mean_prompt_tokens"]) == (2, 1, 600)
    assert st["queued_p50_ms"] == pytest.approx(400) and st["compute_p50_ms"] == pytest.approx(2000)
    assert st["prefill_busy"] == pytest.approx(0.5) and st["prefill_tok_s_busy"] == pytest.approx(452)
    assert st["engine_tpot_mean_ms"] == pytest.approx(60)
    # prefix reuse of every request (the handed-off one's by its prefill: 1000 - 904), own-cache vs
    # pool blocks of the handed-off one
    assert (st["prefix_hit_tokens"], st["local_hit_blocks"], st["pool_hit_blocks"]) == (96 + 32, 2, 4)
    assert st["client_tpot_mean_ms"] is not None and st["tpot_path_ratio"] == pytest.approx(
        st["client_tpot_mean_ms"] / 60)
    assert summarize_stages(records, {}, 4.0) is None  # a server without timelines: no row


def test_busy_time_is_the_union_of_overlapping_compute() -> None:
    assert _union_s([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.8)]) == pytest.approx(4.0)


def test_the_greedy_probe_keeps_the_answer_and_judges_it(server: str) -> None:
    SEEN.clear()
    got = probe(server, "m")
    assert got == ProbeAnswer(" Paris. It is the largest city", True)
    assert SEEN[-1]["temperature"] == 0.0 and SEEN[-1]["prompt"] == PROBE_PROMPT and not SEEN[-1].get("stream")
    PROBE_ANSWER["text"] = "\u00ff\u00fe 12 12 ###"
    try:
        bad = probe(server, "m")
    finally:
        PROBE_ANSWER["text"] = " Paris. It is the largest city"
    assert not bad.sensible and bad.why == "1 words in the answer"  # "ÿþ" is letters
    assert not probe("http://127.0.0.1:9", "m", timeout_s=2.0).sensible  # nothing listens: no answer


@pytest.mark.parametrize(("text", "sensible"), [
    (" Paris.", False),  # one word
    (" Paris, and it is", True),
    (" Lyon Lyon Lyon Lyon", True),  # words, even if wrong: the probe is about garbage, not facts
    ("ab !!!!!!!!!!!!!!!!!!!! cd", False),  # mostly symbols
    (" 巴黎 是 首都", True),  # words of any script
])
def test_probe_judgement(text: str, sensible: bool) -> None:
    assert judge(text).sensible is sensible
