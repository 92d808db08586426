"""Byte units, named once for every package above kernels/ (sizes in configs and messages)."""

MIB = 1 << 20
GIB = 1 << 30
