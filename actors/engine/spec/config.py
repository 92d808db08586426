"""How an engine speculates: which proposer drafts tokens, and how many per row and step at most."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("off", "ngram", "early_exit", "draft")


@dataclass(frozen=True)
class SpecConfig:
    # off; ngram (prompt lookup: the tokens that followed the last n tokens' latest earlier
    # occurrence); early_exit (the model's first `exit_layer` layers and its head draft, the whole
    # model verifies); draft (a separate small model with the same vocabulary drafts).
    method: str = "off"
    max_draft_tokens: int = 4  # k at most per row and step; the engine picks k per row (policy.py)
    ngram_max: int = 4
    ngram_min: int = 2
    exit_layer: int | None = None  # early_exit: None is half the model's layers
    draft_model: str | None = None  # draft: a model name, GGUF file or HF folder (actors/engine/loader.py)
    # draft: rows with temperature > 0 take drafts sampled from the draft model and are verified by
    # rejection sampling against its probabilities; otherwise drafts are the draft's greedy tokens.
    sample_drafts: bool = False
    # auto: the engine prices each step's speculation (policy.py) and drafts only where it pays;
    # always: every eligible row verifies as many drafts as it has, up to max_draft_tokens (for
    # measuring and debugging: it is slower wherever drafts are rarely accepted or the batch is big).
    policy: str = "auto"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculation method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not 1 <= self.max_draft_tokens <= 16:
            raise ValueError(f"max_draft_tokens must be in [1, 16], got {self.max_draft_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}")
        if self.exit_layer is not None and self.exit_layer < 1:
            raise ValueError(f"exit_layer must be >= 1, got {self.exit_layer}")
        if self.policy not in ("auto", "always"):
            raise ValueError(f"speculation policy must be 'auto' or 'always', got {self.policy!r}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculation method 'draft' needs draft_model (a model name or path)")

    @property
    def enabled(self) -> bool:
        return self.method != "off"
