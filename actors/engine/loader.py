"""From a model name or path to a model on its device and its tokenizer: what `Engine.from_pretrained` loads.

Mental model: the weights are read on the host (GGUF or safetensors, `weights.py`), the model is
built on the meta device and materialised once, in the serving dtype, straight on the engine's
device, and the host buffers are handed back to the OS. A float32 copy beside a bf16 one would
double the load-time peak and, through the allocator, the resident size after.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from actors.engine.config import EngineConfig, parse_dtype
from actors.engine.fetch import resolve_model
from actors.engine.model import CausalLM
from actors.engine.tokenizer import Tokenizer
from actors.engine.weights import load_weights

logger = logging.getLogger(__name__)


def load_model(model: str | Path, cfg: EngineConfig) -> tuple[CausalLM, Tokenizer]:
    """`cfg` must be resolved (`EngineConfig.resolved`): a concrete device and dtype."""
    path = resolve_model(str(model))
    t0 = time.perf_counter()
    loaded = load_weights(path)
    tokenizer = Tokenizer.load(path)
    with torch.device("meta"):
        net = CausalLM(loaded.config).to(parse_dtype(cfg.dtype))
    net = net.to_empty(device=cfg.device)
    net.rope.reset_tables()  # derived from the config, not loaded: rebuild off the meta device
    net.load_weights(loaded.tensors)
    net.eval()
    del loaded
    _return_freed_memory()
    logger.info("loaded %s on %s in %s in %.1fs", path, cfg.device, cfg.dtype, time.perf_counter() - t0)
    return net, tokenizer


def _return_freed_memory() -> None:
    """Hands the freed float32 load buffers back to the OS (glibc keeps them otherwise)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
