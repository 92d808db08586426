"""Speculation through the whole disaggregated path in one process: the HTTP backend (`ClusterBackend`)
over the router and real prefill and decode workers whose engines speculate. The caller's and the
tenant's opt-outs reach the decode engine, the request timeline records `decode.spec`, and the
decode worker's counters reach `/health`, the dashboard and the Prometheus counters."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from actors.decode import DecodeWorker
from actors.engine.async_engine import AsyncEngine
from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.sampling import SamplingParams
from actors.engine.spec import SpecConfig
from actors.engine.tiny_model import write_tiny_model
from actors.handoff import kv_layout
from actors.prefill import PrefillWorker
from actors.worker_config import WorkerConfig
from cluster.router.client import Router
from cluster.router.config import RouterConfig
from cluster.router.handles import LocalWorkerHandle
from deploy.cluster_backend import ClusterBackend
from deploy.dashboard.provider import dashboard_for
from deploy.metrics import ClusterMetricsExporter, ClusterSnapshot
from deploy.openai.policy import PolicyBook, TenantRules
from starlette.datastructures import Headers
from tests.deploy.monitoring.fake_metrics import Recorded, install
from transfer.config import TransferConfig, make_transport

PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19]


@pytest.fixture
def rec(monkeypatch: pytest.MonkeyPatch) -> Recorded:
    return install(monkeypatch)


POLICIES = PolicyBook({"quiet": TenantRules(speculation=False)})  # what scheduler.tenants.quiet.speculation: off gives


async def collect(backend: ClusterBackend, rid: str, tenant: str, allowed: bool = True) -> list[int]:
    headers = Headers({} if allowed else {"x-ferry-speculation": "off"})
    policy = POLICIES.resolve(tenant, headers)  # what the Gate resolves
    return [t async for out in backend.generate(rid, PROMPT, PARAMS, policy=policy) for t in out.new_token_ids]


def test_opt_outs_timeline_health_dashboard_and_metrics(tmp_path: Path, rec: Recorded) -> None:
    model = write_tiny_model(tmp_path / "tiny", seed=0)
    spec = SpecConfig(method="early_exit", max_draft_tokens=3, policy="always")
    cfg = WorkerConfig(model=str(model), engine=EngineConfig(num_blocks=64, speculation=spec),
                       transfer=TransferConfig(kind="local"), compression="none")
    tag = uuid.uuid4().hex[:6]
    engines = [Engine.from_pretrained(model, cfg.engine) for _ in range(2)]
    decode = DecodeWorker(cfg, AsyncEngine(engines[0]), make_transport(f"d-{tag}", cfg.transfer), kv_layout(engines[0]))
    prefill = PrefillWorker(cfg, AsyncEngine(engines[1]), make_transport(f"p-{tag}", cfg.transfer), kv_layout(engines[1]))
    router = Router({prefill.name: LocalWorkerHandle(prefill.name, prefill)},
                    {decode.name: LocalWorkerHandle(decode.name, decode)},
                    RouterConfig(load_ttl_s=0.0))
    backend = ClusterBackend(router, engines[0].tokenizer, "tiny", 1024)

    async def main() -> None:
        assert await prefill.add_peer(decode.transport_metadata()) == decode.name
        tokens = {rid: await collect(backend, rid, tenant, allowed) for rid, tenant, allowed in (
            ("auto", "chat", True), ("header-off", "chat", False), ("tenant-off", "quiet", True))}
        assert len({tuple(t) for t in tokens.values()}) == 1 and len(tokens["auto"]) == 10  # same greedy answer
        specs = {rid: backend.timeline(rid)["decode"]["spec"] for rid in tokens}  # type: ignore[index]
        assert specs["header-off"] == specs["tenant-off"] == {"draft_tokens": 0, "accepted_tokens": 0,
                                                              "acceptance_rate": None}
        drafted = specs["auto"]
        assert drafted["draft_tokens"] > 0
        assert backend.timeline("auto")["prefill"]["worker"] == prefill.name  # type: ignore[index]  # handed off
        assert drafted["acceptance_rate"] == round(drafted["accepted_tokens"] / drafted["draft_tokens"], 4)
        # The decode worker's engine counted exactly those drafts; the prefill engine none.
        health = await backend.health()
        shown = health["workers"][decode.name]["speculation"]
        assert (shown["method"], shown["draft_tokens"], shown["accepted_tokens"]) == (
            "early_exit", drafted["draft_tokens"], drafted["accepted_tokens"])
        assert shown["spec_rounds"] > 0 and health["workers"][prefill.name]["speculation"]["draft_tokens"] == 0
        rows = {w.name: w for w in (await dashboard_for(backend).dashboard_data()).workers}
        assert rows[decode.name].spec_method == "early_exit"
        assert rows[decode.name].spec_acceptance == pytest.approx(drafted["accepted_tokens"] / drafted["draft_tokens"])
        assert rows[prefill.name].spec_acceptance is None
        exporter = ClusterMetricsExporter()
        exporter.export(ClusterSnapshot(loads=tuple((await router.loads()).values())))
        assert rec.total("ferry_spec_draft_tokens", worker=decode.name) == drafted["draft_tokens"]
        assert rec.total("ferry_spec_accepted_tokens", worker=decode.name) == drafted["accepted_tokens"]
        assert rec.increments("ferry_spec_draft_tokens", worker=prefill.name) == []  # never a zero increment
        await collect(backend, "more", "chat")  # counters are totals: the next export adds the increase
        more = backend.timeline("more")["decode"]["spec"]  # type: ignore[index]
        exporter.export(ClusterSnapshot(loads=tuple((await router.loads()).values())))
        assert rec.increments("ferry_spec_draft_tokens", worker=decode.name) == [drafted["draft_tokens"],
                                                                              more["draft_tokens"]]

    try:
        asyncio.run(main())
    finally:
        prefill.close()
        decode.close()
