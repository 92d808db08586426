"""The decode side's receiver thread when nothing is announced: it waits for the next `expect`
instead of polling its transport, an `expect` wakes it at once, and a transport that must poll for
arrivals hears when KV is announced and when nothing is any more (`expect_senders`)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

import actors.kv_receiver as kv_receiver
from actors.errors import RequestAborted
from actors.kv_receiver import KVReceiver
from transfer.transport import TransferTimeout


class _Transport:
    """Records the receiver's calls; no shard ever arrives."""

    name = "fake"

    def __init__(self) -> None:
        self.recv_calls = 0
        self.polled = threading.Event()
        self.told: list[bool] = []

    def recv(self, timeout_s: float) -> object:
        self.recv_calls += 1
        self.polled.set()
        threading.Event().wait(min(timeout_s, 0.01))
        raise TransferTimeout("nothing")

    def expect_senders(self, expected: bool) -> None:
        self.told.append(expected)


class _Engine:
    """The AsyncEngine surface a receiver uses when nothing lands: a dense model, locks, failed streams."""

    def __init__(self) -> None:
        self.engine = SimpleNamespace(model_config=SimpleNamespace(is_moe=False), cancel_reservation=lambda rid: None)
        self.failed: list[str] = []

    def locked(self, fn, *args):  # type: ignore[no-untyped-def]
        return fn(*args)

    def fail_stream(self, request_id: str, error: BaseException) -> None:
        self.failed.append(request_id)


def test_an_idle_receiver_waits_for_an_announcement_and_wakes_on_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_receiver, "IDLE_WAIT_S", 3600.0)  # idle, only an `expect` can wake it
    transport, engine = _Transport(), _Engine()
    receiver = KVReceiver(engine, transport, layout=None, poll_s=0.01)  # type: ignore[arg-type]
    try:
        assert not transport.polled.wait(0.2)  # parked: no poll of the transport while nothing is announced
        receiver.expect("r1", [3, 4], lease_s=600.0)
        assert transport.polled.wait(30), "the announcement did not wake the receiver"
        assert transport.told == [True]  # polling transports poll warm for the announced KV
        assert receiver.cancel("r1", RequestAborted("r1 went away"))
        assert engine.failed == ["r1"]
        for _ in range(3000):  # the thread's next round tells the transport nothing is expected (hang guard 30 s)
            if transport.told == [True, False]:
                break
            threading.Event().wait(0.01)
        assert transport.told == [True, False]
    finally:
        receiver.close()
