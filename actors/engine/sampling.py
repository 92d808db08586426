"""Sampling: one decode step's logits -> one token (and optional logprobs) per request.

Mental model: every row of logits runs the same fixed pipeline, driven by its request's
`SamplingParams` and by what the request has generated so far (`SamplingState`):

    raw logits ──log_softmax──> reported logprobs (OpenAI reports the model's own distribution)
      -> repetition penalty (HF: prompt + output) -> presence/frequency penalty (OpenAI: output)
      -> eos / stop-token masks (min_tokens, ignore_eos)
      -> argmax                                                      if temperature == 0
      -> / temperature -> softmax -> top-k -> top-p -> min-p -> draw  otherwise

The draw is a pure function of (seed, output position, processed distribution): a uniform u is
hashed (splitmix64) from (seed, len(output_token_ids)) and picks the token by inverse CDF over the
distribution in token-id order. No generator state lives between steps or is shared between rows,
so a request samples the same tokens whatever else shares its batch, and a request resumed on
another worker (recompute after preemption, failover) continues the very same random stream from
its journal (params, resolved seed, tokens so far). Being plain integer arithmetic, the stream
does not depend on torch's RNG implementation or version either, and one uniform per row costs
far less than a vocab-sized exponential race.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import NoReturn

import torch

from actors.engine.errors import InvalidSamplingParams

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
_MASK64 = (1 << 64) - 1
_TOP_P_FIRST_GUESS = 256  # top-p usually ends within a few hundred tokens; a full sort costs ~35x


def _fail(msg: str) -> NoReturn:
    raise InvalidSamplingParams(msg)


def _int_field(name: str, value: object, lo: int, hi: int | None = None) -> int:
    if not isinstance(value, Integral) or isinstance(value, bool):
        _fail(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        _fail(f"{name} must be in [{lo}, {'inf' if hi is None else hi}], got {value!r}")
    return int(value)


def _float_field(name: str, value: object, lo: float, hi: float, *, lo_open: bool = False) -> float:
    if not isinstance(value, Real) or isinstance(value, bool) or not math.isfinite(value):
        _fail(f"{name} must be a finite number, got {value!r}")
    if value < lo or (lo_open and value == lo) or value > hi:
        _fail(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens. Validated on construction (bad input -> 400)."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None  # None: the engine draws one when the request is added
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n alternatives to report; 0 = only the chosen token's
    min_tokens: int = 0

    def __post_init__(self) -> None:
        put = object.__setattr__  # frozen: normalise in place once, before anyone can see it
        put(self, "max_tokens", _int_field("max_tokens", self.max_tokens, 1))
        put(self, "temperature", _float_field("temperature", self.temperature, 0.0, 100.0))
        put(self, "top_k", _int_field("top_k", self.top_k, 0))
        put(self, "top_p", _float_field("top_p", self.top_p, 0.0, 1.0, lo_open=True))
        put(self, "min_p", _float_field("min_p", self.min_p, 0.0, 1.0))
        for name in ("presence_penalty", "frequency_penalty"):
            put(self, name, _float_field(name, getattr(self, name), -2.0, 2.0))
        put(self, "repetition_penalty",
            _float_field("repetition_penalty", self.repetition_penalty, 0.0, 10.0, lo_open=True))
        if self.seed is not None:
            put(self, "seed", _int_field("seed", self.seed, -(1 << 63), _MASK64))
        # OpenAI accepts one stop string or a list of them.
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            _fail(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if len(stop) > MAX_STOP_STRINGS:
            _fail(f"stop must hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        put(self, "stop", tuple(stop))
        if not isinstance(self.stop_token_ids, (list, tuple)):
            _fail(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        put(self, "stop_token_ids",
            tuple(_int_field("stop_token_ids", t, 0) for t in self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            _fail(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            put(self, "logprobs", _int_field("logprobs", self.logprobs, 0, MAX_LOGPROBS))
        put(self, "min_tokens", _int_field("min_tokens", self.min_tokens, 0))
        if self.min_tokens > self.max_tokens:
            _fail(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


@dataclass
class SamplingState:
    """One request as the sampler sees it. The sampler reads the token lists, never mutates them."""

    params: SamplingParams
    seed: int  # resolved: params.seed, or drawn by the engine (and journaled) when it was None
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    # The prompt never changes, so its ids tensor is built once rather than at every step.
    _prompt_ids: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def prompt_ids(self, device: torch.device) -> torch.Tensor:
        if self._prompt_ids is None or self._prompt_ids.device != device:
            ids = torch.tensor(self.prompt_token_ids, dtype=torch.long, device=device)
            self._prompt_ids = torch.unique(ids)
        return self._prompt_ids


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), most likely first; len = params.logprobs


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None]  # None for rows that did not ask for logprobs


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform_for(seed: int, position: int) -> float:
    """The uniform in [0, 1) that decides output position `position` of a request seeded `seed`."""
    bits = _splitmix64(_splitmix64(seed & _MASK64) ^ position)
    return (bits >> 11) * 2.0**-53  # top 53 bits: every value exactly representable, never 1.0


def apply_penalties(logits_row: torch.Tensor, state: SamplingState) -> torch.Tensor:
    """Repetition, presence and frequency penalties on one row [vocab]; returns a new row.

    Repetition (HF): every token seen in prompt + output has a positive logit divided by the
    penalty and a negative one multiplied by it. Presence and frequency (OpenAI), over the output
    only: logit -= frequency_penalty * count + presence_penalty * (count > 0).
    """
    p = state.params
    row = logits_row.clone()
    out = state.output_token_ids
    if p.repetition_penalty != 1.0:
        out_ids = torch.tensor(out, dtype=torch.long, device=row.device)
        seen = torch.cat([state.prompt_ids(row.device), out_ids])  # duplicates write equal values
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if out and (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0):
        ids, counts = torch.unique(torch.tensor(out, dtype=torch.long, device=row.device),
                                   return_counts=True)
        row[ids] -= counts.to(row.dtype) * p.frequency_penalty + p.presence_penalty
    return row


def _banned_tokens(state: SamplingState, eos_token_ids: frozenset[int]) -> set[int]:
    p = state.params
    banned: set[int] = set()
    too_short = len(state.output_token_ids) < p.min_tokens
    if p.ignore_eos or too_short:
        banned |= eos_token_ids
    if too_short:
        banned |= set(p.stop_token_ids)
    return banned


def process_logits(logits_row: torch.Tensor, state: SamplingState,
                   eos_token_ids: frozenset[int]) -> torch.Tensor:
    """Penalties, then the eos/stop masks: the row that greedy decoding and sampling start from."""
    row = apply_penalties(logits_row, state)
    # Ids past the vocab can never be drawn, so there is nothing to mask (and indexing would fail).
    banned = sorted(t for t in _banned_tokens(state, eos_token_ids) if t < row.numel())
    if banned:
        row[banned] = float("-inf")
    return row


def filter_probs(logits_row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on a processed row: the unnormalised probs to draw from."""
    probs = torch.softmax(logits_row / params.temperature, dim=-1)  # [vocab]
    vocab = probs.numel()
    top_k = params.top_k if params.top_k < vocab else 0
    if top_k or params.top_p < 1.0:
        vals, idx = _kept_head(probs, top_k, params.top_p)
        probs = torch.zeros_like(probs).index_put_((idx,), vals)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs


def _kept_head(probs: torch.Tensor, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens surviving top-k then top-p, most probable first, sorting only as far as needed."""
    vocab = probs.numel()
    k = top_k or min(_TOP_P_FIRST_GUESS, vocab)
    while True:
        vals, idx = torch.topk(probs, k)  # [k], descending
        if top_p >= 1.0:
            return vals, idx
        cum = torch.cumsum(vals, dim=0)
        total = cum[-1] if top_k else probs.sum()  # top-p renormalises over the top-k survivors
        if top_k or k == vocab or bool(cum[-1] >= top_p * total):
            break
        k = min(k * 8, vocab)  # the nucleus runs past this prefix: look further
    # Smallest prefix reaching top_p: keep a token while the mass before it is still short.
    # The top token has nothing before it, so it always stays.
    keep = (cum - vals) < top_p * total
    return vals[keep], idx[keep]


def draw(probs: torch.Tensor, u: float) -> int:
    """Inverse CDF over `probs` [vocab] (unnormalised, in token-id order) at uniform u in [0, 1)."""
    return int(draw_index(probs, u))


def draw_index(probs: torch.Tensor, u: float) -> torch.Tensor:
    """`draw` as a 0-dim int64 tensor on the probs' device: no device->host copy."""
    cdf = torch.cumsum(probs, dim=0, dtype=torch.float64)
    # right=True lands on the first token whose cdf exceeds the target; a zero-probability token
    # shares its predecessor's cdf and so can never be that first one.
    idx = torch.searchsorted(cdf, cdf[-1:] * u, right=True)[0]
    return torch.where(idx < probs.numel(), idx, probs.argmax())  # past the end: only NaN/inf mass


def token_logprobs(logits_row: torch.Tensor, token_id: int, num_top: int) -> TokenLogprobs:
    logprobs = torch.log_softmax(logits_row, dim=-1)  # raw model distribution, as OpenAI reports
    top: list[tuple[int, float]] = []
    if num_top:
        vals, idx = torch.topk(logprobs, num_top)
        top = list(zip(idx.tolist(), vals.tolist()))
    return TokenLogprobs(token_id, float(logprobs[token_id]), top)


class Sampler:
    """Stateless: every call is a pure function of its inputs (see the module docstring)."""

    def sample(self, logits: torch.Tensor, states: list[SamplingState],
               eos_token_ids: frozenset[int]) -> SampleResult:
        """One token per row of `logits` [num_seqs, vocab], row i belonging to states[i]."""
        assert logits.dim() == 2 and logits.shape[0] == len(states), (logits.shape, len(states))
        if logits.dtype != torch.float32:
            logits = logits.float()
        # Greedy rows without penalties or logprobs (the common case: ignore_eos and min_tokens only
        # ban tokens) take one batched argmax over their rows, their banned tokens masked first;
        # argmax is per row, so a row's token still does not depend on its batch.
        simple = [i for i, s in enumerate(states) if self._is_simple_greedy(s)]
        vocab = logits.shape[1]  # ids past the vocab can never be drawn: nothing to mask
        bans = [(j, t) for j, i in enumerate(simple) for t in _banned_tokens(states[i], eos_token_ids) if t < vocab]
        if len(simple) == len(states) and not bans:
            return SampleResult(logits.argmax(dim=-1).tolist(), [None] * len(states))
        # Every row's token lands in one device tensor, read back to the host once (the step's one
        # device->host copy; logprobs, when asked for, add one per row that asks, and top-p without
        # top-k one per widening of its search).
        ids = torch.empty(len(states), dtype=torch.int64, device=logits.device)
        if simple:
            rows = logits[simple] if len(simple) < len(states) else logits.clone()
            if bans:
                r, c = zip(*bans)
                rows[list(r), list(c)] = float("-inf")
            ids[simple] = rows.argmax(dim=-1)
        # The rest row by row on purpose: a row's result must not depend on the batch it sits in.
        done = set(simple)
        for i, (raw, state) in enumerate(zip(logits, states)):
            if i in done:
                continue
            p = state.params
            row = process_logits(raw, state, eos_token_ids)
            if p.is_greedy:
                ids[i] = row.argmax()
            else:
                ids[i] = draw_index(filter_probs(row, p), uniform_for(state.seed, len(state.output_token_ids)))
        token_ids: list[int] = ids.tolist()
        logprobs: list[TokenLogprobs | None] = [
            None if s.params.logprobs is None else token_logprobs(raw, token, s.params.logprobs)
            for raw, s, token in zip(logits, states, token_ids)]
        return SampleResult(token_ids, logprobs)

    @staticmethod
    def _is_simple_greedy(state: SamplingState) -> bool:
        p = state.params
        return p.is_greedy and not p.has_penalties and p.logprobs is None
