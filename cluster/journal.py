"""Recovery journal: enough about every in-flight request to resume it on another worker.

Mental model: a request can be replayed anywhere from (prompt tokens, sampling params, seed, the
tokens already streamed): sampling draws are keyed by (seed, output position), so a replay that
prefills prompt + streamed tokens and continues at RNG position = number of streamed tokens
produces exactly the tokens a failure-free run would have, and the client stream continues with no
duplicate or gap. The journal keeps that state plus where the request lives (its placement and
phase), indexed by worker so a death finds its victims in O(victims).

`recovery_plan(dead_worker)` lists the requests that lost state on the dead worker, most urgent
first: ordered by remaining SLO budget (time left before the TTFT deadline, before the next token
is due to keep the mean TPOT on target, or before the batch deadline) minus the predicted cost of
recomputing them. Requests that only lost their *future* decode worker (still prefilling
elsewhere) are included too; `needs_prefill` says which ones must be recomputed. A request already
decoding has nothing left on its prefill worker: that worker's death does not touch it
(`lost_with`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from cluster.descriptors import RequestDesc, RequestId, SloClass, TenantId, WorkerName
from cluster.tenants import BatchSlo, InteractiveSlo, Slo


class Phase(str, enum.Enum):
    QUEUED = "queued"  # placed; prefill not started
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"  # prefill done (first token out), KV on its way to decode
    DECODING = "decoding"
    PREEMPTED = "preempted"  # evicted to make room; waiting to be placed again


@dataclass(slots=True)
class JournalEntry:
    """One in-flight request. `num_output_tokens` is the RNG position to resume at; when token
    ids are journaled, `output_token_ids` holds exactly that many ids."""

    desc: RequestDesc
    slo_class: SloClass
    ttft_deadline_s: float | None
    tpot_s: float | None
    completion_deadline_s: float | None
    prefill_worker: WorkerName | None
    decode_worker: WorkerName | None
    phase: Phase = Phase.QUEUED
    prompt_token_ids: tuple[int, ...] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_output_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_recoveries: int = 0

    @classmethod
    def for_request(cls, desc: RequestDesc, slo: Slo, batch_deadline_s: float,
                    prompt_token_ids: Sequence[int] | None = None, sampling: dict[str, Any] | None = None,
                    seed: int | None = None) -> "JournalEntry":
        """A new request's entry with absolute deadlines from its tenant's SLO. An interactive
        tenant may downgrade a request to batch (`desc.slo_class`), which then gets
        `batch_deadline_s`; a batch tenant cannot upgrade one."""
        interactive = isinstance(slo, InteractiveSlo) and desc.slo_class is not SloClass.BATCH
        deadline = slo.deadline_s if isinstance(slo, BatchSlo) else batch_deadline_s
        return cls(
            desc=desc, slo_class=SloClass.INTERACTIVE if interactive else SloClass.BATCH,
            ttft_deadline_s=desc.arrival_time + slo.ttft_ms / 1e3 if isinstance(slo, InteractiveSlo)
            and interactive else None,
            tpot_s=slo.tpot_ms / 1e3 if isinstance(slo, InteractiveSlo) and interactive else None,
            completion_deadline_s=None if interactive else desc.arrival_time + deadline,
            prefill_worker=None, decode_worker=None,
            prompt_token_ids=None if prompt_token_ids is None else tuple(prompt_token_ids),
            sampling=dict(sampling or {}), seed=seed)

    @property
    def request_id(self) -> RequestId:
        return self.desc.request_id

    def remaining_budget_s(self, now: float) -> float:
        """Seconds until this request's promise breaks if nothing more happens for it."""
        if self.slo_class is SloClass.INTERACTIVE:
            if self.first_token_time is None:
                assert self.ttft_deadline_s is not None
                return self.ttft_deadline_s - now
            assert self.tpot_s is not None
            # Mean TPOT <= target holds while token n+1 comes by first + n * target.
            return self.first_token_time + self.tpot_s * self.num_output_tokens - now
        assert self.completion_deadline_s is not None
        return self.completion_deadline_s - now

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["desc"]["slo_class"] = None if self.desc.slo_class is None else self.desc.slo_class.value
        d["slo_class"] = self.slo_class.value
        d["phase"] = self.phase.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "JournalEntry":
        dd = dict(d["desc"])
        dd["request_id"], dd["tenant"] = RequestId(dd["request_id"]), TenantId(dd["tenant"])
        dd["block_hashes"] = tuple(dd["block_hashes"])
        dd["slo_class"] = None if dd["slo_class"] is None else SloClass(dd["slo_class"])
        rest = {k: v for k, v in d.items() if k != "desc"}
        rest["slo_class"] = SloClass(rest["slo_class"])
        rest["phase"] = Phase(rest["phase"])
        if rest.get("prompt_token_ids") is not None:
            rest["prompt_token_ids"] = tuple(rest["prompt_token_ids"])
        rest["output_token_ids"] = list(rest.get("output_token_ids", ()))
        return cls(desc=RequestDesc(**dd), **rest)


def lost_with(entry: JournalEntry, dead: WorkerName) -> bool:
    """Whether `entry` lost state with `dead`: its KV (prefill not handed off, or decode rows) or
    the decode worker it was on its way to. Once decoding, its prefill worker holds nothing of it."""
    if entry.decode_worker == dead:
        return True
    return entry.prefill_worker == dead and entry.phase is not Phase.DECODING


def needs_prefill(entry: JournalEntry, dead: WorkerName) -> bool:
    """Whether the request's KV died with `dead` (so it must be recomputed), as opposed to it only
    needing a new decode worker (the prefill side still holds the KV until the receiver confirms)."""
    if entry.phase is Phase.PREEMPTED:
        return True
    if entry.prefill_worker == dead and entry.phase in (Phase.QUEUED, Phase.PREFILLING, Phase.TRANSFERRING):
        return True
    return entry.decode_worker == dead and entry.phase is Phase.DECODING


class Journal:
    """In-flight requests by id and by worker. Every method is O(1) except the plans (O(k log k)
    for the k requests of one worker)."""

    def __init__(self) -> None:
        self._entries: dict[RequestId, JournalEntry] = {}
        self._by_worker: dict[WorkerName, set[RequestId]] = {}

    def _index(self, entry: JournalEntry) -> None:
        rid, by = entry.request_id, self._by_worker
        for w in (entry.prefill_worker, entry.decode_worker):
            if w is not None:
                ids = by.get(w)
                if ids is None:
                    ids = by[w] = set()
                ids.add(rid)

    def _unindex(self, entry: JournalEntry) -> None:
        rid, by = entry.request_id, self._by_worker
        for w in (entry.prefill_worker, entry.decode_worker):
            if w is not None:
                ids = by.get(w)
                if ids is not None:
                    ids.discard(rid)

    def add(self, entry: JournalEntry) -> None:
        assert entry.request_id not in self._entries, f"{entry.request_id} journaled twice"
        self._entries[entry.request_id] = entry
        self._index(entry)

    def get(self, rid: RequestId) -> JournalEntry | None:
        return self._entries.get(rid)

    def remove(self, rid: RequestId) -> JournalEntry | None:
        entry = self._entries.pop(rid, None)
        if entry is not None:
            self._unindex(entry)
        return entry

    def move(self, rid: RequestId, prefill: WorkerName | None, decode: WorkerName | None,
             phase: Phase) -> JournalEntry:
        entry = self._entries[rid]
        self._unindex(entry)
        entry.prefill_worker, entry.decode_worker, entry.phase = prefill, decode, phase
        self._index(entry)
        return entry

    def record_tokens(self, rid: RequestId, t: float, token_ids: tuple[int, ...] = (), count: int = 1) -> None:
        """`count` tokens were streamed at `t`; their ids are journaled when given."""
        entry = self._entries.get(rid)
        if entry is None:
            return
        n = len(token_ids) if token_ids else count
        if entry.first_token_time is None:
            entry.first_token_time = t
        entry.last_token_time = t
        entry.num_output_tokens += n
        entry.output_token_ids.extend(token_ids)

    def on_worker(self, worker: WorkerName) -> list[JournalEntry]:
        return [self._entries[r] for r in self._by_worker.get(worker, ())]

    def recovery_plan(self, dead: WorkerName, now: float,
                      recompute_s: Callable[[JournalEntry], float] = lambda e: 0.0) -> list[JournalEntry]:
        """Requests that lost state with `dead`, least remaining budget (minus recompute cost)
        first; ties by arrival, then id, so the plan is deterministic."""
        touched = [e for e in self.on_worker(dead) if lost_with(e, dead)]
        return sorted(touched, key=lambda e: (e.remaining_budget_s(now) - recompute_s(e),
                                              e.desc.arrival_time, e.request_id))

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[JournalEntry]:
        return iter(self._entries.values())

    def snapshot(self) -> list[dict[str, Any]]:
        return [e.to_dict() for e in self._entries.values()]

    @classmethod
    def restore(cls, entries: list[dict[str, Any]]) -> "Journal":
        j = cls()
        for d in entries:
            j.add(JournalEntry.from_dict(d))
        return j
