"""KV shadows: a decode worker copies each running request's full KV blocks to the prefix-cache
pool as they fill, so a preemption or a recovery resumes from that KV instead of recomputing it.

Mental model: a request with a `shadow_salt` (the router draws one secret per request) has a
private hash chain over prompt + output tokens, salted with its tenant's salt and the secret, so
no other request can name, hit or overwrite its blocks. After every engine step (`after_step`,
under the engine lock, so a block read is the KV the step left and not one reused since), the
blocks that filled are read out and queued for the pool on the worker's offer thread, exact
(no compression) and tagged with the request's epoch. A refused offer (the thread is busy) is
simply tried again after the next step: that is the bandwidth bound. When the request finishes
(stop or length), the chain it knows of (imported + shadowed here) is removed from the pool; an
aborted one's (a preempted row, a stream whose client left) is kept `keep_s` for its resume, then
removed unless it resumed here.

The last, partly filled block is shadowed too, every `PARTIAL_EVERY` tokens, under a key of its
own (the chain's parent plus the tokens it holds so far; the previous one is removed), so a resume
replays at most `PARTIAL_EVERY - 1` tokens beyond it instead of up to a block.

Resuming (`fetch`): the chain of the resumed tokens is fetched up to the first block that is
missing or fails verification (checksum, its own hash, this request's epoch), then the longest
partial block saved after it: everything from there on is recomputed, so a bad block costs time,
never a wrong token. The engine then computes the tail one token a step
(`Engine.resume_from_kv`), which makes the continuation bit-identical.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from actors.engine.block_hash import BlockHash, hash_block, hash_block_chain
from actors.engine.block_hash import ROOT_HASH
from actors.engine.engine import Engine
from actors.engine.output import RequestOutput
from actors.engine.request import RequestStatus
from actors.messages import CacheKey, GenerationRequest
from actors.pool_link import PoolLink

logger = logging.getLogger(__name__)

SHADOW_KEY = "kv-shadow"
BLOCKS_PER_STEP = 16  # most blocks of one request read out per step
PARTIAL_EVERY = 4  # tokens between two shadows of a request's partly filled last block
_ENDED = ("stop", "length")  # a request that ended so will not be resumed; an abort may be (preemption)


def shadow_keys(req: GenerationRequest) -> tuple[CacheKey, ...]:
    assert req.shadow_salt is not None
    return (*(req.cache_salt or ()), SHADOW_KEY, req.shadow_salt)


def shadow_epoch(req: GenerationRequest) -> int:
    """The u64 every shadow block of the request carries as its transfer id."""
    assert req.shadow_salt is not None
    return int.from_bytes(hashlib.sha256(b"epoch:" + req.shadow_salt.encode()).digest()[:8], "little")


def partial_hash(parent: BlockHash, token_ids: list[int], keys: tuple[CacheKey, ...]) -> BlockHash:
    """The key of a partly filled block holding `token_ids` after the chain ending in `parent`."""
    return hash_block(parent, token_ids, (*keys, "partial"))


def resume_hashes(req: GenerationRequest, block_size: int) -> list[BlockHash]:
    """The shadow chain of a resumed request's known tokens, without a block that would hold its
    last token (the engine computes that one to sample the next)."""
    tokens = list(req.prompt_token_ids) + list(req.output_token_ids)
    return hash_block_chain(tokens[: len(tokens) - 1], block_size, shadow_keys(req))


@dataclass
class _Tracked:
    keys: tuple[CacheKey, ...]
    epoch: int
    hashes: list[BlockHash] = field(default_factory=list)  # the chain so far
    num_shadowed: int = 0  # leading blocks in the pool (queued)
    partial: BlockHash | None = None  # the partly filled block after them, in the pool
    partial_len: int = 0  # its tokens
    tenant: str = "default"  # whose pool share its shadows count against

    def saved(self) -> list[BlockHash]:
        """Every key of this request's KV in the pool (or queued for it)."""
        return self.hashes[: self.num_shadowed] + ([self.partial] if self.partial is not None else [])


@dataclass(frozen=True)
class ShadowStats:
    num_tracked: int  # requests being shadowed now
    num_shadow_blocks: int  # of theirs, in the pool (or queued for it)
    shadow_bytes: int  # what those take in the pool (raw KV)
    num_shadowed_blocks: int  # ever queued (partly filled ones included)
    num_shadowed_bytes: int  # their raw KV bytes
    num_deferred: int  # steps a request's new blocks waited for the offer thread
    num_capped: int  # steps a request's new blocks waited for room under max_bytes
    num_removed_chains: int  # chains dropped from the pool as their request ended (or was not resumed)
    num_kept_chains: int  # of aborted requests, kept for a resume
    num_resumed: int  # resumes that imported shadow blocks
    num_resumed_blocks: int
    num_resumed_tokens: int  # tokens whose KV those held (a partly filled block counts its own)


class KVShadows:
    """One decode worker's shadowing of its running requests (`track`, `after_step`) and its
    lookups of shadows to resume from (`fetch`). `max_bytes` bounds the pool memory this
    worker's live shadows take: beyond it, new blocks wait (and a recovery recomputes them)."""

    def __init__(self, link: PoolLink, block_size: int, max_bytes: int = 512 << 20, keep_s: float = 600.0) -> None:
        self.link = link
        self.block_size = block_size
        self.max_bytes = max_bytes
        self.keep_s = keep_s
        self._kept: dict[int, tuple[float, list[BlockHash]]] = {}  # aborted: epoch -> (drop at, keys)
        self._lock = threading.Lock()
        self._tracked: dict[str, _Tracked] = {}  # by engine request id
        self._block_bytes = 0  # raw KV of one block, learned from the first read
        self._n = dict.fromkeys(("shadowed", "bytes", "deferred", "capped", "removed", "resumed", "resumed_blocks",
                                 "resumed_tokens"), 0)

    def track(self, request_id: str, req: GenerationRequest, num_in_pool: int = 0,
              partial: tuple[BlockHash, int] | None = None) -> None:
        """Shadows `request_id` (the engine's id of `req`) from now on; its first `num_in_pool`
        blocks (and `partial`: a partly filled block's key and length) are already there."""
        if req.shadow_salt is None:
            return
        hashes = resume_hashes(req, self.block_size)[:num_in_pool]
        t = _Tracked(shadow_keys(req), shadow_epoch(req), hashes, len(hashes), tenant=req.tenant)
        if partial is not None:
            t.partial, t.partial_len = partial
        with self._lock:
            self._kept.pop(t.epoch, None)  # resumed here: its chain is tracked again
            self._tracked[request_id] = t

    def after_step(self, engine: Engine, outputs: list[RequestOutput]) -> None:
        """Queues the blocks that filled in the step that just ended. Engine lock held."""
        now = time.monotonic()
        with self._lock:
            for epoch in [e for e, (at, _) in self._kept.items() if at <= now]:
                if self.link.remove(self._kept[epoch][1]):
                    del self._kept[epoch]
                    self._n["removed"] += 1
            for out in outputs:
                if out.finished and out.request_id in self._tracked:
                    t = self._tracked.pop(out.request_id)
                    if out.finish_reason not in _ENDED:  # aborted during the step
                        self._kept[t.epoch] = (now + self.keep_s, t.saved())
                    elif self.link.remove(t.saved()):
                        self._n["removed"] += 1
            live = sum(t.num_shadowed for t in self._tracked.values())
            for request_id, t in list(self._tracked.items()):
                req = engine.requests.get(request_id)
                if req is None:
                    if not engine.is_reserved(request_id):  # aborted: its shadows stay for a resume
                        del self._tracked[request_id]
                        self._kept[t.epoch] = (now + self.keep_s, t.saved())
                    continue
                if req.status is not RequestStatus.RUNNING:  # queued, or preempted (its KV offloaded or dropped)
                    continue
                live += self._shadow(engine, request_id, req.token_ids, req.num_computed_tokens, t, live)

    def _shadow(self, engine: Engine, request_id: str, token_ids: list[int], num_computed: int, t: _Tracked,
                live: int) -> int:
        """Queues `t`'s next full blocks, else its partly filled one; the full blocks queued."""
        bs = self.block_size
        # A long prompt's blocks go over several steps: each read holds the engine lock.
        full = min(num_computed // bs, t.num_shadowed + BLOCKS_PER_STEP)
        new = full - t.num_shadowed
        if new > 0 and (live + new) * self._block_bytes > self.max_bytes:
            self._n["capped"] += 1
            return 0
        if new > 0:
            self._extend(t, token_ids, full * bs)
            if not self._put(engine, request_id, t.hashes[t.num_shadowed : full], t.num_shadowed, full, t):
                return 0
            t.num_shadowed = full
            if t.partial is not None:  # the block it stood for is whole now
                self.link.remove([t.partial])
                t.partial, t.partial_len = None, 0
            return new
        tail = num_computed - full * bs
        if new == 0 and full == num_computed // bs and tail - t.partial_len >= PARTIAL_EVERY:
            parent = t.hashes[full - 1] if full else ROOT_HASH
            key = partial_hash(parent, token_ids[full * bs : num_computed], t.keys)
            if self._put(engine, request_id, [key], full, full + 1, t):
                if t.partial is not None:
                    self.link.remove([t.partial])
                t.partial, t.partial_len = key, tail
        return 0

    def _put(self, engine: Engine, request_id: str, keys: list[BlockHash], start: int, end: int, t: _Tracked) -> bool:
        kv = engine.runner.read_blocks(engine.kv.block_ids(request_id)[start:end])
        if not self.link.shadow(keys, kv, t.epoch, t.tenant):
            self._n["deferred"] += 1
            return False
        self._n["shadowed"] += end - start
        self._n["bytes"] += kv.numel() * kv.element_size()
        self._block_bytes = kv.numel() * kv.element_size() // kv.shape[2]
        return True

    def _extend(self, t: _Tracked, token_ids: list[int], num_tokens: int) -> None:
        bs = self.block_size
        while (len(t.hashes) + 1) * bs <= num_tokens:
            i = len(t.hashes)
            parent = t.hashes[-1] if t.hashes else ROOT_HASH
            t.hashes.append(hash_block(parent, token_ids[i * bs : (i + 1) * bs], t.keys))

    def fetch(self, req: GenerationRequest) -> Resume | None:
        """The resumed request's leading shadow blocks that verify, and the longest partly filled
        block after them (None: not one block). Blocking (the pool)."""
        if req.shadow_salt is None:
            return None
        bs, keys, epoch = self.block_size, shadow_keys(req), shadow_epoch(req)
        tokens = list(req.prompt_token_ids) + list(req.output_token_ids)
        hashes = resume_hashes(req, bs)
        _, kv = self.link.fetch(hashes, epoch=epoch)
        n = 0 if kv is None else kv.shape[2]
        partial = None
        tail = tokens[n * bs : len(tokens) - 1]  # known tokens after them, the last one excepted
        if n == len(hashes):
            parent = hashes[n - 1] if n else ROOT_HASH
            for length in range(len(tail) // PARTIAL_EVERY * PARTIAL_EVERY, 0, -PARTIAL_EVERY):
                key = partial_hash(parent, tail[:length], keys)
                _, block = self.link.fetch([key], epoch=epoch)
                if block is not None:
                    kv = block if kv is None else torch.cat((kv, block), dim=2)
                    partial = (key, length)
                    break
        if kv is None:
            return None
        resume = Resume(kv, n * bs + (partial[1] if partial else 0), n, partial)
        with self._lock:
            self._n["resumed"] += 1
            self._n["resumed_blocks"] += kv.shape[2]
            self._n["resumed_tokens"] += resume.num_tokens
        return resume

    def stats(self) -> ShadowStats:
        with self._lock:
            n = self._n
            live = sum(t.num_shadowed for t in self._tracked.values())
            return ShadowStats(
                num_tracked=len(self._tracked), num_shadow_blocks=live, shadow_bytes=live * self._block_bytes,
                num_shadowed_blocks=n["shadowed"], num_shadowed_bytes=n["bytes"], num_deferred=n["deferred"],
                num_capped=n["capped"], num_removed_chains=n["removed"], num_kept_chains=len(self._kept),
                num_resumed=n["resumed"], num_resumed_blocks=n["resumed_blocks"],
                num_resumed_tokens=n["resumed_tokens"])


@dataclass(frozen=True)
class Resume:
    """What a resume imports: KV [L, 2, n, bs, Hkv, D] of the first `num_tokens` tokens (its last
    block partly filled when `partial` names it), `num_blocks` full blocks of the chain."""

    kv: torch.Tensor
    num_tokens: int
    num_blocks: int
    partial: tuple[BlockHash, int] | None
