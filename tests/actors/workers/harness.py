"""Plain-class wiring for the worker tests: prefill and decode workers over the in-process transport,
each with its own engine on the same tiny model, and the single-engine reference they must match."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from actors.decode import DecodeWorker
from actors.engine.async_engine import AsyncEngine
from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.sampling import SamplingParams
from actors.handoff import kv_layout
from actors.messages import GenerationRequest, PrefillResult, TokenEvent
from actors.prefill import PrefillWorker
from actors.prefix_cache.pool import PrefixCachePool
from actors.worker_config import TenantKVPolicy, WorkerConfig
from transfer.config import TransferConfig, make_transport

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
NUM_BLOCKS = 64


LOSSY = TenantKVPolicy(fidelity="lossy")  # a tenant that opted into lossy KV codecs


def worker_config(model: Path, **kw: object) -> WorkerConfig:
    kw.setdefault("engine", EngineConfig(num_blocks=NUM_BLOCKS))
    kw.setdefault("transfer", TransferConfig(kind="local"))
    kw.setdefault("compression", "none")  # bit-exact KV: these tests compare tokens with one engine's
    return WorkerConfig(model=str(model), **kw)  # type: ignore[arg-type]


def random_tokens(n: int, seed: int, vocab: int = 500) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (n,), generator=g).tolist()


def reference(model: Path, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Token ids one single-process engine generates for each prompt."""
    engine = Engine.from_pretrained(model, EngineConfig(num_blocks=256))
    return [list(o.token_ids) for o in engine.generate(prompts, params)]


def streamed_ids(events: list[TokenEvent]) -> list[int]:
    """Every token id a stream delivered, in order."""
    return [t for e in events for t in e.output.new_token_ids]


def streamed_text(events: list[TokenEvent]) -> str:
    return "".join(e.output.new_text for e in events)


@dataclass
class Run:
    result: PrefillResult | None
    events: list[TokenEvent]

    @property
    def token_ids(self) -> list[int]:
        return streamed_ids(self.events)

    @property
    def text(self) -> str:
        return streamed_text(self.events)


@dataclass
class LocalCluster:
    """N prefill workers and one decode worker in this process (names are unique per cluster, since
    the in-process transport's directory is process-wide)."""

    cfg: WorkerConfig
    prefills: list[PrefillWorker] = field(default_factory=list)
    decode: DecodeWorker | None = None
    peer: str = ""

    @classmethod
    async def start(cls, cfg: WorkerConfig, num_prefill: int = 1,
                    pool: PrefixCachePool | None = None, decode_pool: bool = False) -> "LocalCluster":
        """`decode_pool`: the decode worker fetches from `pool` too, for prompts it prefills itself."""
        tag = uuid.uuid4().hex[:6]
        cluster = cls(cfg)
        engine = Engine.from_pretrained(cfg.model, cfg.engine)
        cluster.decode = DecodeWorker(cfg, AsyncEngine(engine), make_transport(f"d-{tag}", cfg.transfer),
                                      kv_layout(engine), prefix_pool=pool if decode_pool else None)
        for i in range(num_prefill):
            engine = Engine.from_pretrained(cfg.model, cfg.engine)
            transport = make_transport(f"p{i}-{tag}", cfg.transfer)
            cluster.prefills.append(PrefillWorker(cfg, AsyncEngine(engine), transport, kv_layout(engine), pool))
        for p in cluster.prefills:
            cluster.peer = await p.add_peer(cluster.decode.transport_metadata())
        return cluster

    async def run(self, req: GenerationRequest, prefill: int = 0) -> Run:
        assert self.decode is not None
        if not req.needs_handoff:
            return Run(None, [e async for e in self.decode.generate(req)])
        assert await self.decode.announce(req)
        result = await self.prefills[prefill].prefill(req, self.peer)
        return Run(result, [e async for e in self.decode.generate_after_kv(req.request_id)])

    def engines(self) -> list[Engine]:
        assert self.decode is not None
        return [self.decode.engine.engine, *(p.engine.engine for p in self.prefills)]

    def close(self) -> None:
        for p in self.prefills:
            p.close()
        if self.decode is not None:
            self.decode.close()
