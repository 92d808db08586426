"""`x-ferry-expert-budget: N`: a caller's expert budget for one request to a mixture-of-experts model.

Mental model: with a budget of N, the request's generated tokens route only among the N experts per
layer its prompt routed most to (actors/engine/moe/budget.py): fewer distinct experts per decode
step, at some cost in quality. No header: the tenant's budget, if an operator set one
(`PUT /admin/routing/{model}/budgets`), else none. The Gate reads the header of every API request
into the request's `RequestPolicy` (policy.py; not a whole number >= 1: a 400 naming the header);
the endpoint checks it against the model's experts (`over_model`: more than it has, or any on a
dense model, is a 400 too); the engine request carries it to the workers, resumes included.
"""

from __future__ import annotations

HEADER = "x-ferry-expert-budget"

def parse_expert_budget(value: str | None) -> int | None:
    """The header's budget (None without a header). ValueError, saying why, for anything but a
    whole number >= 1 (the Gate answers it with a 400 naming the header)."""
    if value is None:
        return None
    text = value.strip()
    if not text.isascii() or not text.isdigit() or int(text) < 1:
        raise ValueError(f"Invalid {HEADER} header {value!r}: use a whole number of experts per layer, at least "
                         "1 and at most the model's experts.")
    return int(text)


def over_model(budget: int | None, num_experts: int | None) -> str | None:
    """Why `budget` does not fit a model of `num_experts` experts per layer (0: dense), or None
    when it fits or the backend does not know its model's experts (None)."""
    if budget is None or num_experts is None or budget <= num_experts:
        return None
    detail = "this model has no experts" if num_experts == 0 else f"this model has {num_experts} experts per layer"
    return f"Invalid {HEADER} header {str(budget)!r}: {detail}."
