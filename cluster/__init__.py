"""The control plane: who runs what, when and where, and how in-flight work survives failures.

Plain classes, deterministic under an injected clock (`clock.py`); the Ray actor wrapping
`scheduler.GlobalScheduler` lives in deploy/. Everything works on descriptors (`descriptors.py`),
never on engine internals; `actors/` is imported for types only.
"""
