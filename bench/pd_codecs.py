"""bench/pd.py's codec part: transfer + codec time per request with each codec fixed, and auto.

For each link this machine can measure, one decode worker and four prefill workers in this process
(plain classes; the four share one engine, so each prompt is computed once and its prefix blocks
serve every policy, but each worker has its own endpoint and its own codec chooser): compression
none, zstd, int8, fp8 fixed; auto for an exact tenant (the default: it picks none or zstd) and
auto-lossy for a tenant that opted into lossy KV. Links: the in-process transport (`local`), the Ray object store on this
node, NIXL over loopback when it imports, and an EMULATED cross-node link: the in-process transport
throttled to `--emulated-gbps` (a NIC's rate; it stands in for a cross-node link, which this machine
does not have). Prompts are windows of this repository's own docs (real text) of the given lengths.
Each round sends every prompt once per policy, the policies in a rotating order. Warm-up passes
(every prompt once per policy) come first and are reported apart: they compute the prompts, and
they are auto's learning phase, until it has sent with every codec to the peer (at most 3 passes);
the rounds after them are the steady state a long-running worker is in.

Per request: encode (sender, measured), send (until the receiver holds every shard), decode (the
receiver's own `decode_shard` time, from its `ReceiverStats`): their sum is the transfer + codec
time the policies are compared on. Auto's rows also give its predicted vs actual seconds and the
codecs it chose (explorations included).
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from actors.decode import DecodeWorker
from actors.engine.async_engine import AsyncEngine
from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.fetch import resolve_model
from actors.engine.sampling import SamplingParams
from actors.engine.tokenizer import Tokenizer
from actors.handoff import kv_layout
from actors.messages import GenerationRequest, PrefillResult
from actors.prefill import PrefillWorker
from actors.worker_config import MIB, TenantKVPolicy, WorkerConfig
from bench.common import format_table, progress
from bench.shadow import doc_tokens, windows
from transfer.codec import Compression
from transfer.config import TransferConfig, make_transport
from transfer.nixl import nixl_available
from transfer.transport import Buffer, KVTransport, SendStats

# Fixed codecs, then auto for an exact tenant (the default: none or zstd) and for a lossy one (all four).
FIXED = ("none", "zstd", "int8", "fp8")
AUTOS = ("auto", "auto-lossy")
POLICIES = FIXED + AUTOS
LOSSY_KV = TenantKVPolicy(fidelity="lossy")


def policy_config(cfg: WorkerConfig, policy: str) -> WorkerConfig:
    """`cfg` for one policy's prefill worker: its codec, and lossy KV where the policy may pick a lossy codec."""
    lossy = policy == "auto-lossy" or not Compression.parse(policy if policy in FIXED else "none").lossless
    return replace(cfg, compression="auto" if policy in AUTOS else policy,
                   default_tenant_kv=LOSSY_KV if lossy else TenantKVPolicy())
PARAMS = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


class ThrottledTransport:
    """EMULATED slow link: another transport whose sends take at least wire bytes / `bytes_per_s`
    (it sleeps out the rest), so a one-machine bench can show what a NIC's rate does to the choice."""

    kind = "emulated"

    def __init__(self, inner: KVTransport, bytes_per_s: float) -> None:
        self.inner, self.bytes_per_s, self.name = inner, bytes_per_s, inner.name

    def send(self, peer: str, shards: Sequence[Buffer], *, tag: int = 0, timeout_s: float) -> SendStats:
        t0 = time.perf_counter()
        stats = self.inner.send(peer, shards, tag=tag, timeout_s=timeout_s)
        time.sleep(max(0.0, stats.wire_bytes / self.bytes_per_s - (time.perf_counter() - t0)))
        return replace(stats, latency_s=time.perf_counter() - t0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@dataclass(frozen=True)
class Link:
    key: str  # what --codec-links names it
    name: str
    kind: str  # the transports' kind
    throttle_bytes_per_s: float | None = None


LINK_KEYS = ("local", "object_store", "nixl", "emulated")


def links(emulated_gbps: float, wanted: Sequence[str] = LINK_KEYS) -> list[Link]:
    out = [Link("local", "local (in-process)", "local"),
           Link("object_store", "object store (this node)", "object_store")]
    if nixl_available():
        out.append(Link("nixl", "nixl (loopback)", "nixl"))
    out.append(Link("emulated", f"EMULATED {emulated_gbps:g} GB/s (throttled local)", "local", emulated_gbps * 1e9))
    return [link for link in out if link.key in wanted]


@dataclass(frozen=True)
class CodecSample:
    policy: str
    num_prompt_tokens: int
    result: PrefillResult
    decode_s: float  # the receiver's own decode_shard seconds for this transfer

    @property
    def total_s(self) -> float:
        return self.result.kv_encode_s + self.result.kv_send_s + self.decode_s


class LinkRun:
    """One link's decode worker and its four prefill workers (one engine between them)."""

    def __init__(self, link: Link, cfg: WorkerConfig, prefill_engine: Engine, decode_engine: Engine) -> None:
        tag = uuid.uuid4().hex[:6]
        tcfg = replace(cfg.transfer, kind=link.kind)  # type: ignore[arg-type]
        wcfg = replace(cfg, transfer=tcfg)
        layout = kv_layout(decode_engine)
        self.decode = DecodeWorker(wcfg, AsyncEngine(decode_engine), make_transport(f"cd-{tag}", tcfg), layout)
        shared = AsyncEngine(prefill_engine)
        self.prefills: dict[str, PrefillWorker] = {}
        for policy in POLICIES:
            transport: Any = make_transport(f"cp-{policy}-{tag}", tcfg)
            if link.throttle_bytes_per_s is not None:
                transport = ThrottledTransport(transport, link.throttle_bytes_per_s)
            self.prefills[policy] = PrefillWorker(policy_config(wcfg, policy), shared, transport, layout)
        self.peer = ""

    async def start(self) -> None:
        for p in self.prefills.values():
            self.peer = await p.add_peer(self.decode.transport_metadata())

    async def send(self, policy: str, req: GenerationRequest) -> CodecSample:
        before = sum(self.decode.receiver_stats().decode_s.values())
        assert await self.decode.announce(req)
        result = await self.prefills[policy].prefill(req, self.peer)
        async for _ in self.decode.generate_after_kv(req.request_id):
            pass
        decode_s = sum(self.decode.receiver_stats().decode_s.values()) - before
        return CodecSample(policy, req.num_prompt_tokens, result, decode_s)

    def close(self) -> None:
        for p in self.prefills.values():
            p.close()  # the shared engine's shutdown is idempotent
        self.decode.close()


async def run_link(link: Link, cfg: WorkerConfig, prompts: Sequence[list[int]], rounds: int,
                   load: Callable[[], Engine]) -> tuple[list[CodecSample], list[CodecSample]]:
    """(warm-up samples, measured samples)."""
    run = LinkRun(link, cfg, load(), load())
    try:
        await run.start()
        # Warm-up: passes over the prompts (their prefill, auto's first sends to the peer) until
        # auto has tried every codec there, at most 3: its learning phase, reported apart.
        warm: list[CodecSample] = []
        choosers = {p: run.prefills[p].codecs for p in AUTOS}
        for n in range(3):
            for i, prompt in enumerate(prompts):
                for policy in POLICIES:
                    warm.append(await run.send(policy, request(f"warm{n}-p{i}-{policy}", prompt)))
            if all(len(choosers[p].estimate(run.peer).tries) == len(run.prefills[p].cfg.codecs_for(""))
                   for p in AUTOS):
                break
        samples = []
        for r in range(rounds):
            for i, prompt in enumerate(prompts):
                k = (r + i) % len(POLICIES)
                order = POLICIES[k:] + POLICIES[:k]
                for policy in order:
                    samples.append(await run.send(policy, request(f"r{r}-p{i}-{policy}", prompt)))
            progress(f"codecs: {link.name}: round {r + 1}/{rounds}")
        return warm, samples
    finally:
        run.close()


def request(request_id: str, prompt: list[int]) -> GenerationRequest:
    # cache_salt () shares the prompt's blocks between the policies' requests: computed once.
    return GenerationRequest(f"{request_id}-{uuid.uuid4().hex[:4]}", prompt, PARAMS, cache_salt=())


def summarize(samples: Sequence[CodecSample]) -> dict[str, Any]:
    by_policy: dict[str, Any] = {}
    for policy in POLICIES:
        mine = [s for s in samples if s.policy == policy]
        row: dict[str, Any] = {
            "total_ms_mean": 1e3 * statistics.mean(s.total_s for s in mine),
            "encode_ms_mean": 1e3 * statistics.mean(s.result.kv_encode_s for s in mine),
            "send_ms_mean": 1e3 * statistics.mean(s.result.kv_send_s for s in mine),
            "decode_ms_mean": 1e3 * statistics.mean(s.decode_s for s in mine),
            "wire_mb_mean": statistics.mean(s.result.kv_wire_bytes for s in mine) / 1e6,
            "by_length_total_ms": {n: 1e3 * statistics.mean(s.total_s for s in mine if s.num_prompt_tokens == n)
                                   for n in sorted({s.num_prompt_tokens for s in mine})},
        }
        if policy in AUTOS:
            row["chosen"] = dict(Counter(s.result.kv_codec for s in mine))
            row["explored"] = sum(s.result.kv_codec_reason == "explore" for s in mine)
            row["predicted_ms_mean"] = 1e3 * statistics.mean(s.result.kv_codec_predicted_s for s in mine)
            # the sender's own actual: encode + send measured, decode as it predicted
            row["sender_actual_ms_mean"] = 1e3 * statistics.mean(s.result.kv_codec_actual_s for s in mine)
            row["requests"] = [{"prompt_tokens": s.num_prompt_tokens, "codec": s.result.kv_codec,
                                "reason": s.result.kv_codec_reason, "total_ms": 1e3 * s.total_s,
                                "predicted_ms": {c: 1e3 * t for c, t in s.result.kv_codec_predictions}}
                               for s in mine]
        by_policy[policy] = row
    best = min(FIXED, key=lambda p: by_policy[p]["total_ms_mean"])
    best_exact = min(("none", "zstd"), key=lambda p: by_policy[p]["total_ms_mean"])
    total = {p: by_policy[p]["total_ms_mean"] for p in POLICIES}
    return {"policies": by_policy, "best_fixed": best, "best_exact": best_exact,
            "num_requests_per_policy": len(samples) // len(POLICIES),
            "auto_vs_none": total["auto"] / total["none"],  # the default (exact) auto against plain none
            "auto_le_best_fixed": total["auto-lossy"] <= total[best],
            "auto_exact_le_best_exact": total["auto"] <= total[best_exact]}


async def bench_codecs(lengths: Sequence[int], rounds: int, emulated_gbps: float,
                       wanted: Sequence[str] = LINK_KEYS) -> dict[str, Any]:
    model = resolve_model("smollm2")
    tokens = doc_tokens(Tokenizer.load(model))
    prompts = [windows(tokens, n, 1, start=1000 * i)[0] for i, n in enumerate(lengths)]
    blocks = sum(-(-n // 16) for n in lengths) + 64
    cfg = WorkerConfig(model="smollm2", engine=EngineConfig(num_blocks=blocks, max_model_len=max(lengths) + 64),
                       transfer=TransferConfig(send_staging_bytes=64 * MIB, recv_staging_bytes=64 * MIB))
    figures: dict[str, Any] = {"prompt_tokens": list(lengths), "rounds": rounds, "links": {}}
    for link in links(emulated_gbps, wanted):
        progress(f"codecs: {link.name}")
        warm, samples = await run_link(link, cfg, prompts, rounds, lambda: Engine.from_pretrained(model, cfg.engine))
        figures["links"][link.name] = {**summarize(samples), "warmup": summarize(warm)}
    return figures


def render_codecs(f: dict[str, Any]) -> str:
    rows = []
    for name, s in f["links"].items():
        p = s["policies"]
        w = s["warmup"]["policies"]
        mixes = [" ".join(f"{c}:{n}" for c, n in sorted(p[a]["chosen"].items())) for a in AUTOS]
        rows.append([name, *(p[k]["total_ms_mean"] for k in POLICIES), s["auto_vs_none"],
                     "yes" if s["auto_exact_le_best_exact"] else "NO", "yes" if s["auto_le_best_fixed"] else "NO",
                     *mixes, p["auto"]["explored"] + p["auto-lossy"]["explored"],
                     w["auto"]["total_ms_mean"], w["none"]["total_ms_mean"]])
    title = (f"KV transfer + codec time per request (encode + send + receiver decode, mean ms), prompts "
             f"{', '.join(map(str, f['prompt_tokens']))} tokens of real text, {f['rounds']} rounds; "
             f"after warm-up passes over the prompts (their means: last two columns); EMULATED = throttled, "
             f"not a real NIC")
    heads = ["link", *(f"{k} ms" for k in POLICIES), "auto / none", "auto <= best exact", "auto-lossy <= best",
             "auto chose", "auto-lossy chose", "explored", "warm-up auto ms", "warm-up none ms"]
    detail = []
    for name, s in f["links"].items():
        for k in POLICIES:
            r = s["policies"][k]
            detail.append([name, k, r["encode_ms_mean"], r["send_ms_mean"], r["decode_ms_mean"], r["wire_mb_mean"],
                           *r["by_length_total_ms"].values()])
    lens = [f"{n} tok ms" for n in f["prompt_tokens"]]
    return "\n\n".join([
        format_table(heads, rows, title=title),
        format_table(["link", "policy", "encode ms", "send ms", "decode ms", "wire MB", *lens], detail,
                     title="Where it goes (means), and the total by prompt length"),
    ])
