"""When triton may run, and the checks every triton wrapper makes before a launch.

Mental model: triton is optional. `import kernels` never imports it; the dispatcher asks
`use_triton(...)` per call, which is true only when triton imports *and* the tensors live on CUDA
(and the interpreter is off: it cannot run CUDA tensors at speed).
Tests call the triton wrappers directly on CPU tensors under `TRITON_INTERPRET=1` (the interpreter
runs kernels through numpy), so the wrappers accept CPU tensors exactly when interpreting.
A wrapper rejects bad input with a ValueError before launch: a kernel reading the wrong stride or
dtype does not fail, it silently returns garbage.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def triton_available() -> bool:
    """True when the triton package can be imported (it is not installed on every machine)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """The triton interpreter is on (read when triton is imported, so set it before that)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(*tensors: torch.Tensor) -> bool:
    """The dispatcher's choice: compiled triton for CUDA tensors, the torch reference otherwise."""
    return all(t.is_cuda for t in tensors) and triton_available() and not interpreting()


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def check_device(*tensors: torch.Tensor) -> None:
    """One device for all; CUDA unless the interpreter is on (it reads host memory only)."""
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"tensors on different devices: {t.device} vs {device}")
    if device.type != "cuda" and not (interpreting() and device.type == "cpu"):
        raise ValueError(f"triton kernels need CUDA tensors (got {device}); set TRITON_INTERPRET=1 for CPU")


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{name}: dtype {t.dtype} not in {allowed}")


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {shape}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    # Kernels address the innermost dim as `base + arange(D)`: it must be dense.
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: last dim must be contiguous (stride {t.stride(-1)})")


def check_head_dim(head_dim: int) -> None:
    # tl.arange needs a power of two, tl.dot at least 16 on the reduction dim.
    if head_dim < 16 or head_dim != next_pow2(head_dim):
        raise ValueError(f"head_dim {head_dim} must be a power of two >= 16")


def dot_config(compute_dtype: torch.dtype) -> tuple[str, bool]:
    """-> (input_precision, upcast) for the attention dots. float32 asks for IEEE products (the
    default, tf32, keeps 10 mantissa bits). upcast widens bf16 operands to float32 under the
    interpreter, whose bf16 tl.dot multiplies raw bit patterns."""
    precision = "ieee" if compute_dtype == torch.float32 else "tf32"
    return precision, interpreting() and compute_dtype == torch.bfloat16


FLOAT_KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
