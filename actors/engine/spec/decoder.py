"""Speculative decoding inside one engine: who speculates this step, drafting, and verification.

The engine calls, per step: `plan` (after scheduling: picks the rows and their k, takes their
slots; n-gram drafts are known here), `draft` (in the forward's phase: model drafters' passes),
then, with the verify forward's logits, `sample` (the tokens each due row emits, 1 + accepted
drafts for a speculating row), and last `settle` per speculating row once its tokens are appended
(its computed KV counts only accepted tokens; the rejected slots' blocks are freed).
"""

from __future__ import annotations

import time
from collections.abc import Collection

import torch

from actors.engine.kv_cache_manager import KVCacheManager
from actors.engine.model import CausalLM
from actors.engine.model_runner import ModelRunner, SeqChunk
from actors.engine.request import Request
from actors.engine.sampling import Sampler, TokenLogprobs, token_logprobs
from actors.engine.scheduler import ScheduledBatch
from actors.engine.spec.config import SpecConfig
from actors.engine.spec.policy import Acceptance, Candidate, TokenTimeModel, choose_k, urgency
from actors.engine.spec.proposers import DraftRow, ModelDrafter, NgramProposer
from actors.engine.spec.verify import num_matching, draft_states, speculative_sample, target_probs

TPOT_EMA = 0.3  # weight of a row's newest inter-token time in its TPOT estimate


class SpecDecoder:
    def __init__(self, cfg: SpecConfig, runner: ModelRunner, kv: KVCacheManager, max_model_len: int,
                 draft_model: CausalLM | None = None) -> None:
        self.cfg = cfg
        self.kv = kv
        self.max_model_len = max_model_len
        self.ngram = NgramProposer(cfg.ngram_min, cfg.ngram_max) if cfg.method == "ngram" else None
        self.drafter: ModelDrafter | None = None
        num_layers = runner.model.cfg.num_layers
        self.draft_share = 0.0  # a drafting pass's time over a full step's, for the same rows (measured)
        if cfg.method == "early_exit":
            exit_layer = min(cfg.exit_layer or max(1, num_layers // 2), num_layers)
            self.drafter = ModelDrafter.early_exit(runner, exit_layer)
            self.draft_share = exit_layer / num_layers
        elif cfg.method == "draft":
            assert draft_model is not None, "method 'draft' needs the draft model"
            self.drafter = ModelDrafter.separate(draft_model, runner, kv.pool.num_blocks)
            self.draft_share = draft_model.cfg.num_layers / (num_layers + draft_model.cfg.num_layers)
        self.step_model = TokenTimeModel()
        self.acceptance = Acceptance()  # engine-wide: the prior of a request's own estimate
        self._requests: dict[str, Acceptance] = {}
        self._tpot: dict[str, tuple[float, float | None]] = {}  # request -> (last token time, TPOT EMA)
        self.num_spec_steps = 0
        self.num_spec_rounds = 0  # rows verified, one per speculating row and step
        # Decode rows, one per decode row and step, speculating or not (a prompt's last chunk is
        # no decode row): the scheduler's tokens per row-step are (rows + accepted) / rows.
        self.num_decode_rows = 0
        self._step_decode_rows = 0  # this step's, counted in `plan`, added in `sample`
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self._draft_s = 0.0

    @property
    def enabled(self) -> bool:
        return self.cfg.enabled

    # ------------------------------------------------------------------------------------- plan
    def plan(self, batch: ScheduledBatch, chunks: list[SeqChunk], budget: int) -> list[DraftRow]:
        """Chooses the speculating rows of a scheduled step and their k, takes their extra slots and
        rewrites their chunks (n-gram drafts go in now; a model drafter's in `draft`)."""
        self._step_decode_rows = sum(c.needs_logits and self._is_decode(req, c)
                                     for req, c in zip(batch.requests, chunks))
        if not self.enabled:
            return []
        cands: list[tuple[int, Request, list[int], Candidate]] = []
        base_value = 0.0
        for i, (req, c) in enumerate(zip(batch.requests, chunks)):
            if not c.needs_logits:
                continue
            u = urgency(self._tpot.get(req.request_id, (0.0, None))[1], req.tpot_target_s)
            base_value += u
            max_k = self._max_k(req, c)
            drafts: list[int] = []
            if max_k and self.ngram is not None:
                drafts = self.ngram.propose(req.token_ids, max_k, req.request_id)
                max_k = len(drafts)
            if max_k:
                acc = self._requests.get(req.request_id) or Acceptance()
                cands.append((i, req, drafts, Candidate(acc.rate(self.acceptance.rate()), max_k, u)))
        if not cands:
            return []
        if self.cfg.policy == "always":
            ks = [c.max_k for *_, c in cands]
        else:
            draft_pass_s = self.draft_share * self.step_model.predict(len(cands)) if self.drafter else 0.0
            ks = choose_k([c for *_, c in cands], self.step_model, batch.num_tokens, base_value, draft_pass_s)
        rows: list[DraftRow] = []
        room = budget - batch.num_tokens
        for (i, req, drafts, c), k in zip(cands, ks):
            k = min(k, room)
            if k <= 0 or not self.kv.allocate_slots(req, 1 + k):
                continue
            room -= k
            row = DraftRow(req, k, self.kv.block_ids(req.request_id), drafts[:k],
                           sampled=self.cfg.sample_drafts and not req.params.is_greedy)
            row.index = i
            rows.append(row)
            chunks[i] = self._verify_chunk(row)
        return rows

    @staticmethod
    def _is_decode(req: Request, chunk: SeqChunk) -> bool:
        """A decode row: one token to compute, after an output token (not a prompt or a replay)."""
        return (len(chunk.token_ids) == 1 and req.num_tokens - req.num_computed_tokens == 1
                and not req.prefill_only and req.num_output_tokens > 0)

    def _max_k(self, req: Request, chunk: SeqChunk) -> int:
        """Drafts a row may verify: a decode row of a request that allows it, short of its
        max_tokens and of the model's length."""
        if not req.speculation or not self._is_decode(req, chunk):
            return 0
        left = min(req.params.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
        return max(0, min(self.cfg.max_draft_tokens, left))

    @staticmethod
    def _verify_chunk(row: DraftRow) -> SeqChunk:
        """The row's verify chunk: its last token and its drafts. A model drafter's drafts come in
        `draft`; until then placeholders stand in, so the step shows its real shape to whoever lays
        out its rows before the forward (MoE budgets)."""
        drafts = row.drafts or [row.req.token_ids[-1]] * row.k
        return SeqChunk([row.req.token_ids[-1]] + drafts, row.last, row.block_ids, True, 1 + row.k)

    # ------------------------------------------------------------------------------------ draft
    def draft(self, rows: list[DraftRow], chunks: list[SeqChunk]) -> None:
        """A model drafter's passes, then the rows' verify chunks; in the forward's phase."""
        if self.drafter is None or not rows:
            return
        t0 = time.perf_counter()
        self.drafter.draft(rows)
        self._draft_s = time.perf_counter() - t0
        passes = max(r.k for r in rows)
        step_s = self.step_model.predict(len(rows))
        self.draft_share = 0.8 * self.draft_share + 0.2 * self._draft_s / passes / step_s
        for row in rows:
            chunks[row.index] = self._verify_chunk(row)

    # ----------------------------------------------------------------------------------- verify
    def sample(self, sampler: Sampler, logits: torch.Tensor, due: list[Request], rows: list[DraftRow],
               eos_token_ids: frozenset[int]) -> list[tuple[list[int], list[TokenLogprobs | None]]]:
        """The tokens (and logprobs) each due row emits, in `due`'s order; logits rows as the
        runner returns them (1 + k for a speculating row)."""
        spec = {r.req.request_id: r for r in rows}
        spans: list[tuple[int, int]] = []
        at = 0
        for req in due:
            n = 1 + spec[req.request_id].k if req.request_id in spec else 1
            spans.append((at, at + n))
            at += n
        # Every row but the rejection-sampled ones in one sampler call, each with its own state.
        plain = [i for i, req in enumerate(due) if not (req.request_id in spec and spec[req.request_id].sampled)]
        states, index = [], []
        for i in plain:
            req = due[i]
            r = spec.get(req.request_id)
            states += draft_states(req.sampling, r.drafts) if r else [req.sampling]
            index += range(*spans[i])
        result = sampler.sample(logits[index], states, eos_token_ids) if index else None
        out: list[tuple[list[int], list[TokenLogprobs | None]]] = []
        at = 0
        for i, req in enumerate(due):
            r = spec.get(req.request_id)
            if r is not None and r.sampled:
                tokens, lps = self._rejection_sample(logits[slice(*spans[i])], req, r, eos_token_ids)
            else:
                n = spans[i][1] - spans[i][0]
                tokens, lps = result.token_ids[at : at + n], result.logprobs[at : at + n]
                at += n
                if r is not None:
                    j = num_matching(r.drafts, tokens)
                    tokens, lps = tokens[: j + 1], lps[: j + 1]
            if r is not None:
                self._record(r, len(tokens) - 1)
            out.append((list(tokens), list(lps)))
        self.num_spec_steps += bool(rows)
        self.num_spec_rounds += len(rows)
        self.num_decode_rows += self._step_decode_rows
        self._step_decode_rows = 0
        return out

    def _rejection_sample(self, logits: torch.Tensor, req: Request, r: DraftRow,
                          eos: frozenset[int]) -> tuple[list[int], list[TokenLogprobs | None]]:
        p = target_probs(logits, draft_states(req.sampling, r.drafts), eos)
        tokens = speculative_sample(p, torch.stack(r.probs), r.drafts, req.sampling.seed, req.num_output_tokens)
        n = req.params.logprobs
        return tokens, [None if n is None else token_logprobs(logits[i], t, n) for i, t in enumerate(tokens)]

    def _record(self, r: DraftRow, num_accepted: int) -> None:
        req = r.req
        req.num_draft_tokens += r.k
        req.num_accepted_tokens += num_accepted
        self.num_draft_tokens += r.k
        self.num_accepted_tokens += num_accepted
        self.acceptance.record(r.k, num_accepted)
        self._requests.setdefault(req.request_id, Acceptance()).record(r.k, num_accepted)
        if self.drafter is not None:
            self.drafter.verified(r, num_accepted)

    def settle(self, req: Request) -> None:
        """A speculating row after its tokens are appended (some may be cut by a stop): its KV is
        computed up to its last token, its full blocks are cached, the rest of its slots freed."""
        req.num_computed_tokens = req.num_tokens - 1
        self.kv.cache_computed_blocks(req)
        self.kv.trim(req, req.num_tokens)

    # ---------------------------------------------------------------------------------- observe
    def observe(self, due: list[Request], num_emitted: list[int], forwarded_tokens: int, step_s: float,
                live: Collection[str]) -> None:
        """After a step: its time (drafting excluded) for the step-time model, rows' TPOT estimates."""
        if not self.enabled:
            return
        self.step_model.observe(forwarded_tokens, max(1e-6, step_s - self._draft_s))
        self._draft_s = 0.0
        now = time.monotonic()
        for req, n in zip(due, num_emitted):
            last, ema = self._tpot.get(req.request_id, (None, None))
            if last is not None and n:
                tpot = (now - last) / n
                ema = tpot if ema is None else (1 - TPOT_EMA) * ema + TPOT_EMA * tpot
            self._tpot[req.request_id] = (now, ema)
        if len(self._tpot) > 2 * len(live) + 64:
            for d in (self._tpot, self._requests):
                for rid in [rid for rid in d if rid not in live]:
                    del d[rid]
            for part in (self.drafter, self.ngram):
                if part is not None:
                    part.forget(live)
