"""Which codec one KV transfer uses: the one predicted to deliver it soonest, within the tenant's policy.

Mental model: shipping `raw` bytes of KV to a peer with codec c takes
    encode_s(c, raw) + wire_s(peer, ratio(c) * raw) + decode_s(c, raw)
and the chooser predicts each term from what it measured (codec_cost.py: the codec lines are
calibrated when the worker starts, then fed by every real transfer's encode). The wire term is a
line per peer, `overhead_s + wire_bytes / bandwidth`, fitted from the peer's real sends (the
transport's `SendStats.latency_s` over its `wire_bytes`); until a peer has been sent to, the
prior of its link class stands in:
    process     one process, the in-process transport: a memory copy   8 GB/s, 50 us
    node        another process on this node (NIXL over cma, the Ray
                object store, CUDA IPC)                                4 GB/s, 1 ms
    cross_node  another node: a 10 GbE NIC (a GPU cluster's RDMA is
                faster, and its first sends say so)                    1.25 GB/s, 1 ms
A slow link makes the bytes a codec saves worth its encode and decode; a fast one may not be,
and none (bit-exact, though it still copies and checksums every byte) wins. The policy is the set
of codecs allowed, and a tenant's KV fidelity bounds it (`allowed_codecs`): `exact`, the default,
allows only the lossless codecs (none, zstd), so `auto` picks between them by predicted time and
the decode worker continues from the model's own KV; `lossy` allows int8 and fp8 too. A lossy codec
must be predicted to save a real margin over the best lossless one (`lossy_min_gain_s`,
`lossy_min_gain_ratio`): a near tie stays exact. One codec named forces it. Exploration keeps the estimates
real: per peer, a codec never sent there is tried every other transfer until each allowed one has
been once; after that at most one transfer in `explore_every` takes the least tried codec
predicted within `explore_max_ratio` of the best. Only a transfer no larger than the peer's
typical one (a decayed mean) explores, so a codec worse than predicted costs little, and only one
whose size-dependent time is worth learning (`explore_min_s`: not a few KB, whose choice buys
nothing). Each choice carries every allowed codec's prediction, for the request's timeline and
metrics. Thread-safe: a prefill worker ships from several threads.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from transfer.codec import LOSSLESS, Compression, KVLayout
from transfer.codec_cost import CodecCost, LineFit, calibrate

LinkClass = Literal["process", "node", "cross_node"]
ChoiceReason = Literal["forced", "predicted", "explore"]
Fidelity = Literal["exact", "lossy"]
FIDELITIES: tuple[Fidelity, ...] = ("exact", "lossy")
ALL_CODECS: tuple[Compression, ...] = tuple(Compression)
EXACT_CODECS: tuple[Compression, ...] = tuple(c for c in Compression if c.lossless)
POLICIES = ("auto", *(c.name.lower() for c in Compression))


class LossyCodecForExactTenant(ValueError):
    """A policy names a lossy codec for KV whose fidelity is `exact`."""


def allowed_codecs(policy: str, fidelity: Fidelity = "exact") -> tuple[Compression, ...]:
    """The codecs a policy allows under a fidelity: `auto` every codec the fidelity admits (exact:
    the lossless ones; lossy: all), a codec's name only it. A lossy codec named for exact KV raises
    `LossyCodecForExactTenant`: lossy KV is an opt-in (fidelity lossy), never a side effect."""
    if fidelity not in FIDELITIES:
        raise ValueError(f"unknown KV fidelity {fidelity!r}; choose exact or lossy")
    if policy == "auto":
        return EXACT_CODECS if fidelity == "exact" else ALL_CODECS
    if policy not in POLICIES:
        raise ValueError(f"unknown KV compression policy {policy!r}; choose one of {', '.join(POLICIES)}")
    codec = Compression.parse(policy)
    if fidelity == "exact" and not codec.lossless:
        raise LossyCodecForExactTenant(
            f"KV compression {policy} is lossy, but the KV fidelity is exact; set kv_fidelity: lossy to opt in "
            f"(README: KV fidelity), or pick a lossless codec ({', '.join(c.name.lower() for c in EXACT_CODECS)})")
    return (codec,)


@dataclass(frozen=True)
class LinkPrior:
    """A link class's wire, until a peer's own sends are measured."""

    bandwidth_bytes_per_s: float
    overhead_s: float


LINK_PRIORS: Mapping[str, LinkPrior] = {
    "process": LinkPrior(8e9, 5e-5),
    "node": LinkPrior(4e9, 1e-3),
    "cross_node": LinkPrior(1.25e9, 1e-3),
}


def link_class(transport_kind: str, this_node: str, peer_node: str | None) -> LinkClass:
    """The link to a peer: the in-process transport is one process; otherwise the peer's node
    (when known) against ours. An unknown node counts as another node, the conservative prior
    (compression pays there): the peer's first sends replace it."""
    if transport_kind == "local":
        return "process"
    if transport_kind == "cuda_ipc" or (peer_node is not None and peer_node == this_node):
        return "node"
    return "cross_node"


@dataclass(frozen=True)
class ChooserConfig:
    explore_every: int = 16  # per peer: at most one exploring transfer in this many (once all were tried)
    explore_max_ratio: float = 1.5  # explore a codec tried before only if predicted within this of the best
    # Only transfers whose size-dependent time (codecs + wire bytes, the fixed wire overhead left
    # out) is predicted at least this long explore: a few KB teach nothing about the transfers
    # where the choice matters, and a lossy codec there would buy nothing.
    explore_min_s: float = 0.005
    # Exact KV unless a lossy codec is predicted to save at least this much of the best exact codec's time, and
    # this share of it: a tie, or a gain within the estimates' noise (a start-up calibration on a
    # loaded host can be off by a millisecond or two), is never worth lossy KV.
    lossy_min_gain_s: float = 0.005
    lossy_min_gain_ratio: float = 0.05
    decay: float = 0.2  # weight each older sample loses per new one (codec lines and wire lines)

    def __post_init__(self) -> None:
        if self.explore_every < 2 or self.explore_max_ratio < 1 or not 0 < self.decay < 1:
            raise ValueError("explore_every must be >= 2, explore_max_ratio >= 1 and decay in (0, 1)")


@dataclass(frozen=True)
class CodecChoice:
    """One transfer's codec, why, and every allowed codec's predicted encode + wire + decode seconds."""

    codec: Compression
    reason: ChoiceReason
    link: LinkClass
    predicted_s: Mapping[str, float]  # by codec name

    @property
    def name(self) -> str:
        return self.codec.name.lower()

    @property
    def chosen_predicted_s(self) -> float:
        return self.predicted_s[self.name]


@dataclass(frozen=True)
class PeerEstimate:
    """What the chooser believes about one peer's wire (for operators and tests)."""

    peer: str
    link: LinkClass
    bandwidth_bytes_per_s: float
    overhead_s: float
    num_sends: int
    tries: Mapping[str, int]  # transfers sent to it, by codec


@dataclass
class _Peer:
    link: LinkClass
    wire: LineFit
    num_choices: int = 0
    last_explore: int = 0
    typical_raw: float = 0.0  # decayed mean of the raw bytes of its transfers
    tries: Counter[Compression] = field(default_factory=Counter)


class CodecChooser:
    def __init__(self, costs: Mapping[Compression, CodecCost], cfg: ChooserConfig | None = None,
                 default_link: LinkClass = "cross_node", priors: Mapping[str, LinkPrior] = LINK_PRIORS) -> None:
        if Compression.NONE not in costs:
            raise ValueError("no cost for codec none: every chooser can at least send KV as it is")
        self.cfg = cfg or ChooserConfig()
        self.default_link = default_link
        self._priors = dict(priors)
        self._costs = dict(costs)
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()

    @classmethod
    def calibrated(cls, layout: KVLayout, dtype: torch.dtype, device: torch.device | str = "cpu", *,
                   device_shards: bool = False, num_shards: int = 2, cfg: ChooserConfig | None = None,
                   default_link: LinkClass = "cross_node") -> "CodecChooser":
        """A chooser whose codec costs are measured here and now (codec_cost.calibrate)."""
        cfg = cfg or ChooserConfig()
        costs = calibrate(layout, dtype, device, device_shards=device_shards, num_shards=num_shards, decay=cfg.decay)
        return cls(costs, cfg, default_link)

    def _peer(self, peer: str) -> _Peer:
        # Caller holds _lock.
        state = self._peers.get(peer)
        if state is None:
            state = self._peers[peer] = _Peer(self.default_link, LineFit(self.cfg.decay))
        return state

    def set_link(self, peer: str, link: LinkClass) -> None:
        """The peer's link class (its prior); measurements already taken stay."""
        if link not in self._priors:
            raise ValueError(f"unknown link class {link!r}; choose one of {', '.join(self._priors)}")
        with self._lock:
            self._peer(peer).link = link

    def _wire_s(self, state: _Peer, wire_bytes: float) -> float:
        prior = self._priors[state.link]
        return state.wire.predict(wire_bytes, prior.overhead_s, 1.0 / prior.bandwidth_bytes_per_s)

    def _wire_fixed_s(self, state: _Peer) -> float:
        prior = self._priors[state.link]
        fit = state.wire.line(prior.overhead_s, 1.0 / prior.bandwidth_bytes_per_s)
        return prior.overhead_s if fit is None else fit[0]

    def _predict(self, state: _Peer, raw_bytes: int, codecs: Iterable[Compression]) -> dict[Compression, float]:
        out = {}
        for c in codecs:
            cost = self._costs[c]
            out[c] = cost.codec_s(raw_bytes) + self._wire_s(state, cost.wire_ratio * raw_bytes)
        return out

    def predict(self, peer: str, raw_bytes: int) -> dict[str, float]:
        """Predicted encode + wire + decode seconds of every codec, by name."""
        with self._lock:
            return {c.name.lower(): s for c, s in self._predict(self._peer(peer), raw_bytes, self._costs).items()}

    def choose(self, peer: str, raw_bytes: int, allowed: Iterable[Compression] = ALL_CODECS) -> CodecChoice:
        """The codec to send `raw_bytes` of KV to `peer` with, among `allowed` (in codec order) that
        this worker can send (a device-shard worker has no host-only codec: none stands in)."""
        wanted = set(allowed)
        if not wanted:
            raise ValueError("no codec allowed")
        allowed = sorted(wanted & set(self._costs))
        if not allowed and wanted <= LOSSLESS:
            allowed = [Compression.NONE]  # exact KV: a lossless codec this worker lacks falls back to none
        if not allowed:
            raise ValueError(f"none of {sorted(c.name.lower() for c in wanted)} can be sent from this worker")
        with self._lock:
            state = self._peer(peer)
            predicted = self._predict(state, raw_bytes, allowed)
            names = {c.name.lower(): s for c, s in predicted.items()}
            if len(allowed) == 1:
                return CodecChoice(allowed[0], "forced", state.link, names)
            state.num_choices += 1
            state.typical_raw += (raw_bytes - state.typical_raw) * (1.0 if state.num_choices == 1 else self.cfg.decay)
            best = min(allowed, key=lambda c: (predicted[c], c))
            exact = [c for c in allowed if c.lossless]
            if exact and not best.lossless:  # lossy only for a real gain over the best exact codec
                best_exact = min(exact, key=lambda c: (predicted[c], c))
                exact_s = predicted[best_exact]
                if exact_s - predicted[best] < max(self.cfg.lossy_min_gain_s, self.cfg.lossy_min_gain_ratio * exact_s):
                    best = best_exact
            sized = predicted[best] - self._wire_fixed_s(state)  # what depends on the transfer's size
            worth = raw_bytes <= state.typical_raw and sized >= self.cfg.explore_min_s
            explore = self._exploration(state, best, predicted) if worth else None
            if explore is not None:
                state.last_explore = state.num_choices
                return CodecChoice(explore, "explore", state.link, names)
            return CodecChoice(best, "predicted", state.link, names)

    def _exploration(self, state: _Peer, best: Compression,
                     predicted: Mapping[Compression, float]) -> Compression | None:
        # Caller holds _lock. A codec never sent to this peer is tried every other transfer until
        # each has been once (its codec lines may rest on a start-up calibration taken under load,
        # which only a real transfer corrects); after that, once per `explore_every`.
        untried = [c for c in predicted if c != best and state.tries[c] == 0]
        period = 2 if untried else self.cfg.explore_every
        if state.num_choices - state.last_explore < period:
            return None
        others = untried or [c for c in predicted if c != best
                             and predicted[c] <= self.cfg.explore_max_ratio * predicted[best]]
        if not others:
            return None
        return min(others, key=lambda c: (state.tries[c], c))

    def record(self, peer: str, codec: Compression, raw_bytes: int, wire_bytes: int, encode_s: float,
               wire_s: float) -> None:
        """A finished transfer: its encode seconds feed the codec's line, its send the peer's wire."""
        with self._lock:
            state = self._peer(peer)
            state.tries[codec] += 1
            state.wire.add(wire_bytes, wire_s)
            cost = self._costs[codec]
            cost.encode.add(raw_bytes, encode_s)
            cost.add_ratio(raw_bytes, wire_bytes)

    def decode_s(self, codec: Compression, raw_bytes: int) -> float:
        """Predicted decode seconds on the receiver (the sender's own line: same hardware class)."""
        with self._lock:
            return self._costs[codec].decode.predict(raw_bytes, 0.0, 0.0)

    def estimate(self, peer: str) -> PeerEstimate:
        with self._lock:
            state = self._peer(peer)
            prior = self._priors[state.link]
            per_byte0 = 1 / prior.bandwidth_bytes_per_s
            fixed, per_byte = state.wire.line(prior.overhead_s, per_byte0) or (prior.overhead_s, per_byte0)
            return PeerEstimate(peer, state.link, 1.0 / per_byte, fixed, state.wire.num_samples,
                                {c.name.lower(): n for c, n in state.tries.items()})
