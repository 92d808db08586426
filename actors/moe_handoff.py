"""A request's expert budget at the worker's edge, and its expert choice across a prefill -> decode handoff.

Mental model: a `GenerationRequest` may carry `expert_budget` (experts per layer its generated
tokens may use; the caller's `x-ferry-expert-budget` header). A worker sets it on its engine's
`BudgetTracker` before the request enters the engine (`apply_request_budget`); the tenant's budget
applies otherwise. In disaggregated serving the decode worker never computes the prompt, so the
prefill worker takes the request's choice once the prompt is computed (`take_expert_choice`) and
sends it to the decode worker's endpoint as one small message of its own (`encode_choice`, under
`choice_tag`, not the KV's tag) just before the KV: the transport delivers in arrival order, so the
receiver holds it when the last KV shard lands and gives it to the tracker (`give_choice`) right
before it commits the request. Dense models and requests without a budget send nothing and pay a
dict lookup at most.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from typing import Any

import torch

from actors.engine.async_engine import AsyncEngine
from actors.engine.engine import Engine
from actors.engine.moe.budget import BudgetTracker
from actors.engine.moe.control import moe_control_of
from actors.handoff import TAG_BITS
from actors.messages import GenerationRequest

CHOICE_MAGIC = b"FERRY-MOE-CHOICE/1\n"


_trackers: weakref.WeakKeyDictionary[Any, BudgetTracker] = weakref.WeakKeyDictionary()


def budget_tracker(engine: Engine) -> BudgetTracker | None:
    """The engine's expert-budget tracker; None for a dense model or one without MoE control (yet)."""
    if not engine.model_config.is_moe:
        return None
    model = engine.runner.model
    tracker = _trackers.get(model)
    if tracker is None:  # found once per model: a lookup walks its modules
        control = moe_control_of(model)
        if control is None:
            return None
        tracker = _trackers[model] = control.budget
    return tracker


def apply_request_budget(async_engine: AsyncEngine, req: GenerationRequest) -> None:
    """Sets `req`'s own expert budget on this worker's tracker (before it enters the engine)."""
    if req.expert_budget is None:
        return
    tracker = budget_tracker(async_engine.engine)
    if tracker is not None:
        tracker.set_request_budget(req.request_id, req.expert_budget)


def take_expert_choice(engine: Engine, req: GenerationRequest) -> list[list[int]] | None:
    """Under the engine lock, after `req`'s prompt was computed here: its experts per layer, or
    None (dense model, no budget, or no prompt computed here)."""
    tracker = budget_tracker(engine)
    return None if tracker is None else tracker.take_choice(req.request_id, req.tenant)


def choice_tag(request_id: str) -> int:
    """The transport tag of a request's expert choice: stable across processes, never its KV's tag."""
    digest = hashlib.sha256(b"moe-choice:" + request_id.encode()).digest()
    return int.from_bytes(digest[:8], "little") >> (64 - TAG_BITS)


def encode_choice(experts: list[list[int]]) -> bytes:
    return CHOICE_MAGIC + json.dumps(experts, separators=(",", ":")).encode()


def decode_choice(data: Any) -> list[list[int]]:
    """A delivered choice (bytes, a memoryview, or a uint8 tensor on any device) -> experts per
    layer. Raises ValueError for anything else."""
    raw = data.cpu().numpy().tobytes() if isinstance(data, torch.Tensor) else bytes(data)
    if not raw.startswith(CHOICE_MAGIC):
        raise ValueError("not an expert choice")
    experts = json.loads(raw[len(CHOICE_MAGIC):])
    if not isinstance(experts, list) or not all(isinstance(e, list) and all(isinstance(i, int) for i in e)
                                                for e in experts):
        raise ValueError(f"a malformed expert choice: {experts!r}")
    return experts


def give_expert_choice(engine: Engine, request_id: str, experts: list[list[int]]) -> bool:
    """Under the engine lock, before the request is committed: its generated tokens route only
    among `experts`. False where this engine has no MoE control."""
    tracker = budget_tracker(engine)
    if tracker is None or not tracker.fits(experts):
        return False
    tracker.give_choice(request_id, experts)
    return True


def forget_request(engine: Engine, request_id: str) -> None:
    """Drops a request's budget and choice that no step will carry (its handoff failed)."""
    tracker = budget_tracker(engine)
    if tracker is not None:
        tracker.forget(request_id)
