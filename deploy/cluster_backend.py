"""The HTTP app's backend over the Ray data plane: prefill + decode actors (or colocated ones).

Mental model: the ingress owns HTTP; this turns one validated request and its `RequestPolicy`
into a `GenerationRequest` (seed resolved, tenant salt set, `RequestPolicy.request`) and streams the decode actor's `RequestOutput` deltas back through
the `Router` (cluster/router/), which owns placement, deadlines, recovery and aborts. Closing the
stream early aborts the request on its worker (the router fires the abort without awaiting, as the
Backend contract requires). Refusals pass through as they are raised (`actors.errors.Refused`);
the HTTP app maps them in one place (`deploy/openai/errors.refusal_to_api_error`). `/health`
reports each worker's load, memory, KV plan (how its pool was sized: device, blocks, bytes,
explicit or planned, and what capped it) and speculative decoding (method, draft tokens, acceptance).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Iterable
from typing import Any

from actors.engine.output import RequestOutput
from actors.engine.sampling import SamplingParams
from actors.engine.tokenizer import Tokenizer
from actors.messages import RequestPolicy, WorkerLoad
from cluster.router.client import Router
from deploy.openai.timeline import TimelineRecorder
from deploy.pool_source import PoolSource
from transfer.codec import Compression

logger = logging.getLogger(__name__)

POOL_HEALTH_TIMEOUT_S = 3.0


class ClusterBackend:
    def __init__(self, client: Router, tokenizer: Tokenizer, model_name: str, max_model_len: int,
                 *, timeline_capacity: int = 1024, pool: PoolSource | None = None,
                 num_experts: int | None = None) -> None:
        self.client = client
        # Experts per MoE layer (0: dense; None: not known here): the bound of x-ferry-expert-budget.
        self.num_experts = num_experts
        self.pool = pool  # the prefix-cache pool's stores, for /health's prefix_pool section
        self._tokenizer = tokenizer
        self._model_name = model_name
        self._max_model_len = max_model_len
        self.timelines = TimelineRecorder(timeline_capacity)

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       policy: RequestPolicy) -> AsyncGenerator[RequestOutput, None]:
        req = policy.request(request_id, prompt_token_ids, params)
        trace = self.timelines.open(request_id, policy.tenant)
        started = finished = False
        try:
            async for event in self.client.generate(req):
                out = event.output
                started, finished = True, out.finished
                trace.on_worker(event.worker)
                trace.on_output(out)
                yield out
        finally:
            if not started:
                self.timelines.discard(request_id)
            elif not finished:
                trace.finish_reason = "abort"

    def timeline(self, request_id: str) -> dict[str, Any] | None:
        data = self.timelines.get(request_id)
        result = self.client.prefill_result(request_id)
        if data is not None and result is not None:
            nodes = {name: w.node or None for name, w in self.client.board.cached().items()}
            to = data["decode"]["workers"][0] if data["decode"]["workers"] else None
            src, dst = nodes.get(result.worker), nodes.get(to) if to else None
            data["prefill"] = {
                "worker": result.worker, "node": src, "computed_tokens": result.num_computed_tokens,
                # Where its KV went: the first decode worker, its node, and whether it crossed nodes
                # (None where a node is unknown: a worker gone since, or not on Ray).
                "kv_to": {"worker": to, "node": dst, "cross_node": None if src is None or dst is None else src != dst},
                "local_hit_blocks": result.num_local_hit_blocks, "pool_hit_blocks": result.num_pool_hit_blocks,
                "kv_wire_bytes": result.kv_wire_bytes, "queued_s": result.queued_s, "lookup_s": result.lookup_s,
                "compute_s": result.compute_s, "transfer_s": result.transfer_s, "finished_at": result.finished_at,
                "kv_codec": {"codec": result.kv_codec, "reason": result.kv_codec_reason,
                             "predicted_s": result.kv_codec_predicted_s, "actual_s": result.kv_codec_actual_s,
                             "encode_s": result.kv_encode_s, "send_s": result.kv_send_s,
                             "kv_raw_bytes": result.kv_raw_bytes, "predictions_s": dict(result.kv_codec_predictions),
                             "fidelity": result.kv_fidelity,
                             "lossless": Compression.parse(result.kv_codec).lossless},
                # MoE, a budgeted request: the experts per layer chosen from its prompt, sent to decode
                "expert_choice": None if result.expert_choice is None else [list(e) for e in result.expert_choice],
            }
        return data

    async def health(self) -> dict[str, Any]:
        loads = await self.client.loads()
        workers = {name: {"kind": w.kind, "healthy": w.healthy, "running": w.num_running, "waiting": w.num_waiting,
                          "free_blocks": w.num_free_blocks, "total_blocks": w.num_total_blocks,
                          "rss_mib": w.rss_mib, "kv_shadow_mib": round(w.shadow_bytes / 2**20, 1),
                          "kv_blocks_by_tenant": dict(w.kv_blocks_by_tenant),
                          "kv_offloaded_mib": round(w.offloaded_bytes / 2**20, 1),
                          "kv_plan": w.kv_plan_report(), "speculation": w.spec_report(),
                          "cores_lent_s": round(w.cores_lent_s, 1)}
                   for name, w in loads.items()}
        report: dict[str, Any] = {"healthy": can_serve(loads.values()), "workers": workers}
        room = self.client.room  # requests waiting for a decode row now, and how many ever had to
        cfg = self.client.cfg  # a waiter is refused once nothing moved for stall_after_s, or at max_wait_s
        report["row_queue"] = {"waiting": len(room), "num_queued": room.num_queued,
                               "capacity_coming": self.client.capacity_coming(),
                               "interactive_waiting": room.interactive_waiting(),
                               "oldest_wait_s": round(room.oldest_wait_s(), 1),
                               "stall_after_s": cfg.room_wait_s, "max_wait_s": cfg.room_max_wait_s}
        down = sorted(name for name, w in workers.items() if not w["healthy"])
        if down:  # serving on the others (or not at all); dead ones are being replaced
            reps = self.client.replacements
            report["degraded"] = {"down": down, "replacing": sorted(reps.replacing) if reps is not None else []}
        control = self.client.control
        stats = getattr(control, "stats", None)
        if control is not None and stats is not None:  # not on the request path: its state is detail only
            report["scheduler"] = {"available": control.available, **vars(stats)}
        if self.pool is not None:
            try:  # detail only: a store that does not answer is empty in it, never an unhealthy app
                report["prefix_pool"] = await asyncio.wait_for(self.pool.health(), POOL_HEALTH_TIMEOUT_S)
            except Exception as e:
                report["prefix_pool"] = {"error": f"{type(e).__name__}: {e}"}
        return report


def can_serve(loads: Iterable[WorkerLoad]) -> bool:
    """Whether a request can be served now: a healthy worker that decodes, and a healthy prefill
    worker unless there are none (colocated). A worker down while others of its kind serve makes
    the app degraded, not unhealthy: a load balancer keeps sending here."""
    loads = list(loads)
    decodes = any(w.healthy for w in loads if w.kind in ("decode", "colocated"))
    prefills = [w for w in loads if w.kind == "prefill"]
    return decodes and (not prefills or any(w.healthy for w in prefills))
