"""What NIXL endpoints say to each other besides the data: the published metadata envelope and the
small control messages that ride on NIXL notifications. All fixed binary structs, never pickle.

The flow of one shard (sender S, receiver R; every arrow is a NIXL notification except WRITE):
    S -> R  HELLO(envelope)          once per peer, so R can answer S (R needs S's NIXL metadata)
    S -> R  REQ(send, shard, size)   asks for room in R's receive staging
    R -> S  GRANT(send, shard, off)  room reserved (REFUSE when the shard can never fit)
    S => R  WRITEs local -> R.recv_base + off, one per segment of the shard (so copying segment
            k+1 into send staging overlaps writing segment k), each carrying
            DATA(send, shard, n, tag, off, size, segment bytes) as its notification, which NIXL
            delivers after that WRITE's bytes; R hands the shard out once all its bytes arrived
    S -> R  CANCEL(send)             S gave up (deadline): R frees what it granted to that send
    S -> R  PING                     liveness probe while waiting: raises at once if R died
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from transfer.transport import IncompatiblePeer

ENVELOPE_MAGIC = b"FKVN"
ENVELOPE_VERSION = 1

_ENVELOPE = struct.Struct("<4sHHQQQHI")


@dataclass(frozen=True)
class NixlEnvelope:
    """What `NixlTransport.metadata()` publishes: who we are, where our receive staging lives, and
    the NIXL agent metadata a peer loads with `add_remote_agent`."""

    name: str
    incarnation: int  # random per process start: tells a restarted peer from the old one
    recv_base: int
    recv_size: int
    agent_metadata: bytes
    # Where the receive staging lives: None is host memory (DRAM), k is CUDA device k (VRAM). It
    # rides in the header's once-reserved u16 as k + 1, so a peer that wrote 0 there means DRAM.
    recv_device: int | None = None

    @property
    def recv_mem(self) -> tuple[str, int]:
        """(NIXL memory type, device id) of the receive staging, for WRITE descriptors."""
        return ("DRAM", 0) if self.recv_device is None else ("VRAM", self.recv_device)

    def pack(self) -> bytes:
        name = self.name.encode()
        where = 0 if self.recv_device is None else self.recv_device + 1
        head = _ENVELOPE.pack(
            ENVELOPE_MAGIC, ENVELOPE_VERSION, where, self.incarnation, self.recv_base, self.recv_size,
            len(name), len(self.agent_metadata),
        )
        return head + name + self.agent_metadata

    @classmethod
    def unpack(cls, data: bytes) -> "NixlEnvelope":
        if len(data) < _ENVELOPE.size:
            raise IncompatiblePeer(f"{len(data)} bytes is too short for NIXL peer metadata")
        magic, version, where, inc, base, size, name_len, md_len = _ENVELOPE.unpack_from(data, 0)
        if magic != ENVELOPE_MAGIC or version != ENVELOPE_VERSION:
            raise IncompatiblePeer(f"not ferry NIXL peer metadata of version {ENVELOPE_VERSION} ({magic!r} v{version})")
        at = _ENVELOPE.size
        if len(data) != at + name_len + md_len:
            raise IncompatiblePeer("NIXL peer metadata is truncated")
        name = bytes(data[at : at + name_len]).decode()
        return cls(name, inc, base, size, bytes(data[at + name_len :]), None if where == 0 else where - 1)


class MessageKind(enum.IntEnum):
    HELLO = 1
    REQ = 2
    GRANT = 3
    REFUSE = 4
    DATA = 5
    CANCEL = 6
    PING = 7


_SHARD_MSG = struct.Struct("<BQIQ")  # kind, send_id, shard, size|offset|capacity
_DATA = struct.Struct("<BQIIQQQQ")  # kind, send_id, shard, num_shards, tag, offset, size, segment bytes
_CANCEL = struct.Struct("<BQ")


@dataclass(frozen=True)
class Message:
    kind: MessageKind
    send_id: int = 0
    shard: int = 0
    value: int = 0  # REQ: size; GRANT: offset; REFUSE: the receiver's capacity
    num_shards: int = 0  # DATA only
    tag: int = 0  # DATA only
    size: int = 0  # DATA only (value holds the offset)
    segment: int = 0  # DATA only: bytes this WRITE carried
    envelope: bytes = b""  # HELLO only


def hello(envelope: bytes) -> bytes:
    return bytes([MessageKind.HELLO]) + envelope


def shard_msg(kind: MessageKind, send_id: int, shard: int, value: int) -> bytes:
    return _SHARD_MSG.pack(kind, send_id, shard, value)


def data(send_id: int, shard: int, num_shards: int, tag: int, offset: int, size: int, segment: int) -> bytes:
    return _DATA.pack(MessageKind.DATA, send_id, shard, num_shards, tag, offset, size, segment)


def cancel(send_id: int) -> bytes:
    return _CANCEL.pack(MessageKind.CANCEL, send_id)


PING = bytes([MessageKind.PING])


def parse(msg: bytes) -> Message:
    """Raises ValueError on anything malformed (the caller logs and drops it)."""
    if not msg:
        raise ValueError("empty control message")
    kind = MessageKind(msg[0])
    if kind is MessageKind.HELLO:
        return Message(kind, envelope=bytes(msg[1:]))
    if kind is MessageKind.PING:
        return Message(kind)
    if kind is MessageKind.CANCEL:
        return Message(kind, send_id=_CANCEL.unpack(msg)[1])
    if kind is MessageKind.DATA:
        _, send_id, shard, n, tag, offset, size, segment = _DATA.unpack(msg)
        return Message(kind, send_id, shard, offset, num_shards=n, tag=tag, size=size, segment=segment)
    _, send_id, shard, value = _SHARD_MSG.unpack(msg)
    return Message(kind, send_id, shard, value)
