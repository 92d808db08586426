"""A receiver in a child process (multiprocessing spawn), driven over a pipe by the tests: NIXL, or
cuda_ipc (shared host memory, or a GPU arena with `device="cuda:0"`).

The KV itself travels over the transport; the pipe carries only the test's commands and the
receiver's findings (what it decoded, a sha256 of the bytes that landed, or which error it raised),
so the parent can assert on them. Every wait on the parent side is bounded (`Peer.ask`), and
`Peer.stop` always ends the child.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

from transfer.units import MIB


def _all_stopped(pid: int) -> bool:
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True  # no /proc here: trust the signal
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):  # a thread that just ended
            continue
        if state not in ("T", "t"):
            return False
    return True


@dataclass(frozen=True)
class PeerSpec:
    name: str
    recv_bytes: int = 32 * MIB
    layout: tuple[str, int, int, int, int] = ("tiny", 6, 2, 16, 4)  # KVLayout fields
    die_after_shards: int | None = None  # SIGKILL itself after taking this many shards
    kind: str = "nixl"  # or "cuda_ipc"
    device: str | None = None  # cuda_ipc's arena (None: shared host memory) or NIXL's staging device


def _open(spec: PeerSpec) -> Any:
    if spec.kind == "cuda_ipc":
        from transfer.cuda_ipc import CudaIpcConfig, CudaIpcTransport

        return CudaIpcTransport(spec.name, CudaIpcConfig(recv_staging_bytes=spec.recv_bytes, device=spec.device))
    from transfer.nixl import NixlConfig, NixlTransport

    return NixlTransport(spec.name, NixlConfig(send_staging_bytes=1 * MIB, recv_staging_bytes=spec.recv_bytes,
                                               staging_device=spec.device))


def _sha256(data: Any) -> str:
    if hasattr(data, "cpu"):  # a device tensor: hashed on the host, for the test's sake only
        data = data.cpu().numpy()
    return hashlib.sha256(memoryview(data)).hexdigest()


def _serve(spec: PeerSpec, conn: Any) -> None:
    from transfer.codec import KVLayout, decode_shard
    from transfer.transport import TransferError

    layout = KVLayout(*spec.layout)
    t = _open(spec)
    conn.send(("ready", t.metadata()))
    taken = 0
    while True:
        if not conn.poll(30.0):
            break  # the parent is gone: do not linger
        cmd, *args = conn.recv()
        if cmd == "exit":
            break
        if cmd == "add_peer":
            conn.send(t.add_peer(args[0]))
        elif cmd == "recv":  # take n shards, decode each, report per shard
            n, timeout_s = args
            found = []
            for _ in range(n):
                try:
                    d = t.recv(timeout_s)
                except TransferError as e:
                    found.append(("error", type(e).__name__, str(e)))
                    break
                taken += 1
                if spec.die_after_shards is not None and taken >= spec.die_after_shards:
                    os.kill(os.getpid(), signal.SIGKILL)
                with d:
                    try:
                        s = decode_shard(d.data, layout)
                        kv = s.kv.float().contiguous()
                        found.append(("ok", d.peer, d.tag, d.shard_index, s.layers.start, s.layers.stop,
                                      str(s.kv.dtype), tuple(kv.shape), kv.cpu().numpy().tobytes(),
                                      _sha256(d.data), str(s.kv.device), type(d.data).__name__))
                    except TransferError as e:
                        found.append(("error", type(e).__name__, str(e), d.shard_index))
            conn.send(found)
        elif cmd == "stats":
            conn.send(t.stats())
    t.close()


class Peer:
    def __init__(self, spec: PeerSpec, start_timeout_s: float = 60.0) -> None:
        self.spec = spec
        self._conn, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(target=_serve, args=(spec, child), daemon=True)
        self.proc.start()
        child.close()
        tag, self.metadata = self.read(start_timeout_s)
        assert tag == "ready"

    def read(self, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"peer {self.spec.name} did not answer within {timeout_s}s")
        return self._conn.recv()

    def ask(self, *cmd: Any, timeout_s: float = 30.0) -> Any:
        self._conn.send(cmd)
        return self.read(timeout_s)

    def request(self, *cmd: Any) -> None:
        """Sends a command without waiting; collect the answer with `read`."""
        self._conn.send(cmd)

    def freeze(self, timeout_s: float = 10.0) -> None:
        """SIGSTOP, and back once every thread of the child is stopped: `kill` only queues the
        signal, and a loaded machine may run one of its threads a moment longer (Linux `/proc`;
        elsewhere the signal is trusted)."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while not _all_stopped(self.proc.pid):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"peer {self.spec.name} not stopped {timeout_s:g}s after SIGSTOP")
            time.sleep(0.005)

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.thaw()
                self._conn.send(("exit",))
            except (OSError, BrokenPipeError):
                pass
            self.proc.join(5.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5.0)
        self._conn.close()

    def wait_dead(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.proc.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not self.proc.is_alive(), "peer should have died"
