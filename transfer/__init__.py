"""Moving KV between processes: a codec that makes self-checking, compressed, layer-sharded byte
strings out of a request's KV blocks, and transports that carry them (NIXL over UCX, CUDA IPC between
processes on one node, the Ray object store, in-process) behind one `KVTransport` protocol.

Sender:   shards = encode(runner.read_blocks(ids), layout, compression="int8", num_shards=4, ...)
          transport.send(decode_peer, shards, tag=transfer_id, timeout_s=5)
Receiver: with transport.recv(timeout_s=5) as d:
              s = decode_shard(d.data, layout)
              runner.write_blocks(ids, s.kv, layers=s.layers)
KV on a GPU: `encode(..., device=kv.device)` for a transport that moves device memory
(`takes_device_shards`: cuda_ipc with a GPU arena, NIXL with VRAM staging); `d.data` is then a
device tensor and `decode_shard` works on the GPU (codec.py says where the host still sees bytes).
Importing this package loads neither NIXL, Ray nor cupy; `make_transport` loads the one it builds.
"""

from transfer.codec import Compression, DecodedShard, KVLayout, decode, decode_shard, encode, error_bound, layer_groups
from transfer.config import TransferConfig, make_transport, resolve_kind
from transfer.header import ShardHeader
from transfer.transport import (
    CorruptShard,
    Delivery,
    IncompatiblePeer,
    KVTransport,
    PeerGone,
    PeerStats,
    SendStats,
    TransferError,
    TransferTimeout,
    TransportStats,
)

__all__ = [
    "Compression", "CorruptShard", "DecodedShard", "Delivery", "IncompatiblePeer", "KVLayout", "KVTransport",
    "PeerGone", "PeerStats", "SendStats", "ShardHeader", "TransferConfig", "TransferError", "TransferTimeout",
    "TransportStats", "decode", "decode_shard", "encode", "error_bound", "layer_groups", "make_transport",
    "resolve_kind",
]
