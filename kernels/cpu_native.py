"""CPU kernels in C (kernels/csrc/), built at first use with the host's C compiler and called via ctypes.

Why C and not torch ops: at decode sizes the CPU cost of attention is per-op overhead and copies,
not arithmetic (see kernels/csrc/cpu_decode_attention.c). A few dozen lines of C that read the paged
cache in place run several times faster than the torch reference, which stays the ground truth the
tests compare against and the path used wherever this one is unavailable.

Build: `cc -O3 -march=native -fopenmp -ffast-math` (compile step only, see CFLAGS) into `$FERRY_HOME/kernels/<key>/` (`~/.cache/ferry` by
default), where the key hashes the source, the flags, the compiler and the CPU model, so a cache
shared between machines never hands one a library built for another. The build writes a temporary
file and renames it, so concurrent builders (several engines starting at once) are safe. If there is
no compiler, or the build or load fails, a warning is logged once and callers get None (the torch
path). `FERRY_NATIVE_KERNELS=0` turns the native path off; `CC` picks the compiler.

Threads: the library is linked with OpenMP (libgomp.so.1), which resolves to the copy torch has
already loaded, and each call passes `torch.get_num_threads()`, so native and torch kernels share
one thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = ("cpu_decode_attention.c", "cpu_rms_norm.c", "cpu_exponent_split.c")
# -ffast-math lets the float reductions and expf vectorize (glibc's libmvec); the kernels see only
# finite values. It is given to the compile step only: linking a shared library with it would pull
# in crtfastmath.o, which switches the whole process (torch included) to flush-to-zero.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-ffast-math")
LDFLAGS = ("-shared", "-fopenmp")
LIBS = ("-lmvec", "-lm")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
MAX_HEAD_DIM = 256  # as in the C source
MAX_HEADS = 256

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def enabled() -> bool:
    return os.environ.get("FERRY_NATIVE_KERNELS", "1") not in ("0", "false", "no")


def _cache_root() -> Path:
    # `actors.engine.fetch.ferry_home`'s rule, restated: kernels/ sits below actors/ and cannot import it
    return Path(os.environ.get("FERRY_HOME") or Path.home() / ".cache" / "ferry").expanduser() / "kernels"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build(compiler: str, src_dir: Path, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        objects = [f"{tmp}.{i}.o" for i in range(len(SOURCES))]
        steps = [[compiler, *CFLAGS, "-c", str(src_dir / s), "-o", o] for s, o in zip(SOURCES, objects)]
        steps.append([compiler, *LDFLAGS, "-o", tmp, *objects, *LIBS])
        for cmd in steps:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        for path in (tmp, *(f"{tmp}.{i}.o" for i in range(len(SOURCES)))):
            if os.path.exists(path):
                os.unlink(path)


def library() -> ctypes.CDLL | None:
    """The built library, building it on first call; None where it cannot be had (logged once)."""
    global _lib, _tried
    if not enabled():
        return None
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        try:
            compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
            if compiler is None:
                raise RuntimeError("no C compiler (cc/gcc) on PATH")
            src_dir = Path(__file__).parent / "csrc"
            h = hashlib.sha256()
            for part in (*(src_dir.joinpath(s).read_bytes() for s in SOURCES), " ".join(CFLAGS + LDFLAGS + LIBS).encode(),
                         compiler.encode(), _cpu_model().encode(), platform.machine().encode()):
                h.update(part)
            out = _cache_root() / h.hexdigest()[:16] / "libferry_cpu.so"
            if not out.is_file():
                logger.info("building ferry's CPU kernels into %s", out)
                _build(compiler, src_dir, out)
            lib = ctypes.CDLL(str(out))
            fn = lib.ferry_paged_decode_attention
            fn.restype = ctypes.c_int
            i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
            fn.argtypes = [ptr, ptr, c_int, ptr, ptr, c_int, ptr, i64, ptr, i64, i64, i64, i64, i64,
                           ctypes.c_float, c_int]
            norm = lib.ferry_rms_norm
            norm.restype = ctypes.c_int
            norm.argtypes = [ptr, ptr, ptr, c_int, i64, i64, ctypes.c_float, c_int]
            split, merge = lib.ferry_exponent_split, lib.ferry_exponent_merge
            split.restype = merge.restype = ctypes.c_int
            split.argtypes = [ptr, i64, c_int, ptr, ptr]
            merge.argtypes = [ptr, ptr, i64, c_int, ptr]
            _lib = lib
        except Exception as e:  # noqa: BLE001 - any failure means "use the torch path"
            logger.warning("ferry's native CPU kernels are unavailable, using the torch reference: %s", e)
    return _lib


def paged_decode_attention_native(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
) -> torch.Tensor | None:
    """As `paged_decode_attention_ref` (float caches only), or None when this kernel does not take the
    inputs (device, dtypes, sizes) or is not available: the caller then uses the reference."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if (query.device.type != "cpu" or k_cache.device.type != "cpu" or query.dtype not in _DTYPE_CODES
            or k_cache.dtype not in _DTYPE_CODES or v_cache.dtype != k_cache.dtype or head_dim > MAX_HEAD_DIM
            or num_heads % num_kv_heads or num_heads > MAX_HEADS or num_seqs == 0
            or block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32):
        return None
    lib = library()
    if lib is None:
        return None
    q = query.contiguous()
    kc, vc = k_cache.contiguous(), v_cache.contiguous()  # no copies for the engine's own caches
    tables, lens = block_tables.contiguous(), seq_lens.contiguous()
    out = torch.empty_like(q)
    rc = lib.ferry_paged_decode_attention(
        q.data_ptr(), out.data_ptr(), _DTYPE_CODES[q.dtype], kc.data_ptr(), vc.data_ptr(), _DTYPE_CODES[kc.dtype],
        tables.data_ptr(), tables.shape[1], lens.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim,
        kc.shape[1], float(scale), torch.get_num_threads(),
    )
    return out if rc == 0 else None


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """As `rms_norm_ref` (last dim normalised), or None where this kernel does not take the inputs or
    is not available."""
    if (x.device.type != "cpu" or x.dtype not in _DTYPE_CODES or weight.dtype != x.dtype or weight.dim() != 1
            or x.shape[-1] != weight.shape[0] or x.numel() == 0):
        return None
    lib = library()
    if lib is None:
        return None
    xc, w = x.contiguous(), weight.contiguous()
    out = torch.empty_like(xc)
    hidden = w.shape[0]
    rc = lib.ferry_rms_norm(xc.data_ptr(), w.data_ptr(), out.data_ptr(), _DTYPE_CODES[x.dtype], xc.numel() // hidden,
                            hidden, float(eps), torch.get_num_threads())
    return out if rc == 0 else None
