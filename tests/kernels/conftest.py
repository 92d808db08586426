"""Kernel tests run every triton kernel: compiled on a CUDA machine, through the triton interpreter
(numpy, slow: small shapes only) everywhere else. The interpreter is chosen by an environment
variable that triton reads when it is imported, so it is set here, before any test imports it."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
