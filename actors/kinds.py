"""What a worker does, named once for the data plane and the scheduler alike (torch-free, so the
scheduler and the simulator import it without loading the engine)."""

from __future__ import annotations

import enum


class WorkerKind(enum.StrEnum):
    """A str: a `WorkerKind` equals its value ("prefill" == WorkerKind.PREFILL), prints as it and
    travels as it in JSON."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"

    @property
    def serves_prefill(self) -> bool:
        return self is not WorkerKind.DECODE

    @property
    def serves_decode(self) -> bool:
        return self is not WorkerKind.PREFILL
