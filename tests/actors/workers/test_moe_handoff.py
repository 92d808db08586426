"""Request-level expert budgets through the whole disaggregated path in one process (tiny random
Mixtral): the router, a prefill worker that takes a budgeted request's expert choice from its prompt
and sends it ahead of the KV, and a decode worker that gives it to its engine before the commit. A
budgeted request's tokens in P/D equal a colocated worker's with the same budget (same experts
chosen and applied), a request without a budget runs unrestricted, and a handoff that fails
leaves no budget behind."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from actors.colocated import ColocatedWorker
from actors.decode import DecodeWorker
from actors.engine.async_engine import AsyncEngine
from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.moe.control import MoEControl, install_moe_control
from actors.engine.sampling import SamplingParams
from actors.engine.tiny_model import write_tiny_model
from actors.handoff import kv_layout
from actors.kv_receiver import KVReceiver
from actors.messages import GenerationRequest
from actors.moe_handoff import choice_tag, decode_choice, encode_choice
from actors.prefill import PrefillWorker
from actors.worker_config import WorkerConfig
from cluster.router.client import Router
from cluster.router.config import RouterConfig
from cluster.router.handles import LocalWorkerHandle
from transfer.config import TransferConfig, make_transport

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-moe-pd"), moe=True, seed=1)


def prompt(seed: int, n: int = 21) -> list[int]:
    return torch.randint(4, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def routes_of(control: MoEControl) -> list[tuple[int, set[int]]]:
    """Wraps the control's routing: per MoE layer call, the experts its rows took (the step's rows)."""
    seen: list[tuple[int, set[int]]] = []
    inner = control.route

    def route(layer: int, logits: torch.Tensor):  # type: ignore[no-untyped-def]
        w, e = inner(layer, logits)
        seen.append((layer, set(e.flatten().tolist())))
        return w, e

    control.route = route  # type: ignore[method-assign]
    return seen


class Cluster:
    def __init__(self, model: Path) -> None:
        self.cfg = WorkerConfig(model=str(model), engine=EngineConfig(num_blocks=64, device="cpu", dtype="float32"),
                                transfer=TransferConfig(kind="local"), compression="none")
        tag = uuid.uuid4().hex[:6]
        engines = [Engine.from_pretrained(model, self.cfg.engine) for _ in range(3)]
        self.controls = [install_moe_control(e) for e in engines]
        self.decode = DecodeWorker(self.cfg, AsyncEngine(engines[0]), make_transport(f"md-{tag}", self.cfg.transfer),
                                   kv_layout(engines[0]))
        self.prefill = PrefillWorker(self.cfg, AsyncEngine(engines[1]),
                                     make_transport(f"mp-{tag}", self.cfg.transfer), kv_layout(engines[1]))
        self.colocated = ColocatedWorker(AsyncEngine(engines[2]), f"mc-{tag}")
        self.router = Router({self.prefill.name: LocalWorkerHandle(self.prefill.name, self.prefill)},
                             {self.decode.name: LocalWorkerHandle(self.decode.name, self.decode)},
                             RouterConfig(load_ttl_s=0.0))

    @property
    def decode_budget(self):  # type: ignore[no-untyped-def]
        return self.controls[0].budget

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()
        self.colocated.close()


@pytest.fixture
def cluster(tiny_moe: Path):  # type: ignore[no-untyped-def]
    # One per test: the router's handles and the engines' streams belong to the test's event loop.
    c = Cluster(tiny_moe)
    yield c
    c.close()


async def linked(c: Cluster) -> None:
    await c.prefill.add_peer(c.decode.transport_metadata())


async def via_router(c: Cluster, req: GenerationRequest) -> list[int]:
    return [t async for e in c.router.generate(req) for t in e.output.new_token_ids]


async def colocated(c: Cluster, req: GenerationRequest) -> list[int]:
    return [t async for e in c.colocated.generate(req) for t in e.output.new_token_ids]


def test_a_budgeted_request_decodes_in_pd_as_colocated_with_the_experts_of_its_prompt(cluster: Cluster) -> None:
    c = cluster
    decode_routes = routes_of(c.controls[0])

    async def main() -> None:
        await linked(c)
        for i in range(3):
            rid = f"budget-{i}-{uuid.uuid4().hex[:6]}"
            req = GenerationRequest(rid, prompt(i), GREEDY, expert_budget=2)
            decode_routes.clear()
            pd = await via_router(c, req)
            result = c.router.prefill_result(rid)
            assert result is not None  # handed off, not prefilled by the decode worker
            given = c.decode_budget.experts_of(rid)
            assert given is not None and result.expert_choice == tuple(map(tuple, given))
            alone = await colocated(c, GenerationRequest(rid, prompt(i), GREEDY, expert_budget=2))
            assert given is not None and all(len(e) == 2 for e in given)
            assert given == c.controls[2].budget.experts_of(rid)  # the prompt's experts, as colocated chose them
            assert pd == alone and len(pd) == GREEDY.max_tokens
            # Every decode step past the first (the recomputed last prompt token) stayed in the choice.
            num_layers = len(given)
            steps = [decode_routes[j:j + num_layers] for j in range(0, len(decode_routes), num_layers)]
            assert len(steps) == GREEDY.max_tokens
            for step in steps[1:]:
                for layer, (_, experts) in enumerate(step):
                    assert experts <= set(given[layer])

    asyncio.run(main())


def test_a_request_without_a_budget_runs_unrestricted(cluster: Cluster) -> None:
    c = cluster

    async def main() -> None:
        await linked(c)
        rid = f"free-{uuid.uuid4().hex[:6]}"
        pd = await via_router(c, GenerationRequest(rid, prompt(7), GREEDY))
        assert c.decode_budget.experts_of(rid) is None and c.controls[1].budget.experts_of(rid) is None
        assert c.router.prefill_result(rid).expert_choice is None  # type: ignore[union-attr]
        assert pd == await colocated(c, GenerationRequest(rid, prompt(7), GREEDY))
        assert c.controls[2].budget.experts_of(rid) is None
        # The budget is the request's: a resume (the router's recovery copy) keeps it.
        budgeted = GenerationRequest(rid, prompt(7), GREEDY, expert_budget=3)
        assert replace(budgeted, output_token_ids=(1, 2)).expert_budget == 3

    asyncio.run(main())


def test_the_budget_bites_on_the_decode_worker(cluster: Cluster) -> None:
    """Over its decode steps an unrestricted request's tokens use more than 2 of the 4 experts of
    some layer; with a budget (1, raised to top-k = 2) each layer's tokens use 2 at most."""
    c = cluster
    routes = routes_of(c.controls[0])

    def used(num_layers: int) -> list[set[int]]:
        per_layer: list[set[int]] = [set() for _ in range(num_layers)]
        for layer, experts in routes[num_layers:]:  # past the recomputed last prompt token
            per_layer[layer] |= experts
        return per_layer

    async def main() -> tuple[list[int], list[int]]:
        await linked(c)
        num_layers = c.decode_budget.num_layers
        free, budgeted = [], []
        for i in range(3):
            routes.clear()
            await via_router(c, GenerationRequest(f"f{i}-{uuid.uuid4().hex[:4]}", prompt(20 + i), GREEDY))
            free.extend(len(e) for e in used(num_layers))
            routes.clear()
            await via_router(c, GenerationRequest(f"b{i}-{uuid.uuid4().hex[:4]}", prompt(20 + i), GREEDY,
                                                  expert_budget=1))
            budgeted.extend(len(e) for e in used(num_layers))
        return free, budgeted

    free, budgeted = asyncio.run(main())
    assert max(budgeted) == 2 < max(free)


def test_choice_wire_format_and_expert_budget_validation() -> None:
    experts = [[0, 3], [1, 2]]
    assert decode_choice(encode_choice(experts)) == experts
    assert decode_choice(memoryview(encode_choice(experts))) == experts
    assert decode_choice(torch.frombuffer(bytearray(encode_choice(experts)), dtype=torch.uint8)) == experts
    with pytest.raises(ValueError):
        decode_choice(b"not a choice")
    assert choice_tag("r") != choice_tag("s") and 0 <= choice_tag("r") < 2**63
    with pytest.raises(ValueError):
        GenerationRequest("r", (1, 2), GREEDY, expert_budget=0)


def test_a_failed_handoff_leaves_no_budget_or_choice_behind(cluster: Cluster) -> None:
    c = cluster
    rid = f"expired-{uuid.uuid4().hex[:6]}"
    req = GenerationRequest(rid, prompt(3), GREEDY, expert_budget=2)

    async def main() -> None:
        await linked(c)
        assert await c.decode.announce(req)
        assert c.decode_budget.budget_of(rid, req.tenant) == 2
        receiver: KVReceiver = c.decode.receiver
        with receiver._lock:  # what `_land` does with a choice delivery
            res = receiver._pending[receiver._choices[choice_tag(rid)]]
        assert res.experts is None
        assert await c.decode.abort(rid)
        assert c.decode_budget.budget_of(rid, req.tenant) is None and choice_tag(rid) not in receiver._choices
        # A prefill the engine refuses (a token past the vocabulary) forgets its budget too.
        bad = GenerationRequest(f"bad-{rid}", [*prompt(4), 10_000], GREEDY, expert_budget=2)
        with pytest.raises(Exception):
            await c.prefill.prefill(bad, c.decode.name)
        assert c.controls[1].budget.budget_of(bad.request_id, bad.tenant) is None

    asyncio.run(main())


def test_the_callers_header_reaches_the_workers_through_the_cluster_backend(cluster: Cluster) -> None:
    from deploy.cluster_backend import ClusterBackend
    from actors.messages import RequestPolicy

    c = cluster
    backend = ClusterBackend(c.router, c.decode.engine.engine.tokenizer, "tiny", 1024, num_experts=4)
    assert backend.num_experts == 4

    async def main() -> None:
        await linked(c)
        policy = RequestPolicy(tenant="t", expert_budget=2)  # what the Gate resolves from x-ferry-expert-budget
        rid = f"hdr-{uuid.uuid4().hex[:6]}"
        out = [t async for o in backend.generate(rid, prompt(11), GREEDY, policy=policy) for t in o.new_token_ids]
        assert len(out) == GREEDY.max_tokens
        assert c.decode_budget.experts_of(rid) == c.controls[1].budget.experts_of(rid) is not None

    asyncio.run(main())


def test_a_recovery_resume_keeps_the_budget_and_goes_on_as_the_first_run(cluster: Cluster) -> None:
    """The router's resume copy (prompt + the tokens streamed so far, recomputed) on a worker that
    never saw the request: its recomputed tokens take the prompt's experts in the same forward, so
    the rest equals the uninterrupted budgeted run's."""
    c = cluster

    async def main() -> None:
        await linked(c)
        rid = f"rec-{uuid.uuid4().hex[:6]}"
        first = await via_router(c, GenerationRequest(rid, prompt(5), GREEDY, expert_budget=2))
        for k in (1, 4, 7):
            # Its own cache salt: a prompt block cached by the previous resume would add no mass.
            resumed = replace(GenerationRequest(f"{rid}~r{k}", prompt(5), GREEDY, expert_budget=2,
                                                cache_salt=(f"resume-{k}",)), output_token_ids=tuple(first[:k]))
            assert resumed.expert_budget == 2
            assert await colocated(c, resumed) == first[k:]
            assert c.controls[2].budget.experts_of(resumed.request_id) == c.decode_budget.experts_of(rid)

    asyncio.run(main())
