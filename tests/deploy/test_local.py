"""`ferry serve` on a machine where its ports are taken: a clear error before anything starts."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.local import PortInUse, check_ports_free


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_taken_port_is_named(busy_port: int) -> None:
    check_ports_free({"the API": free_port()})
    with pytest.raises(PortInUse, match=rf"port {busy_port} \(the API\) on 127.0.0.1 is in use"):
        check_ports_free({"the API": busy_port, "the metrics": free_port()})


def test_ferry_serve_on_a_taken_port_says_so_and_exits_2(busy_port: int) -> None:
    ferry = Path(sys.executable).with_name("ferry")
    done = subprocess.run([str(ferry), "serve", "--port", str(busy_port)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"ferry: error: port {busy_port} (the API)" in done.stderr and "on 127.0.0.1 is in use" in done.stderr
    assert "--port" in done.stderr and "Traceback" not in done.stderr
