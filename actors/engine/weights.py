"""Load a model's weights into float32 torch tensors under Hugging Face parameter names.

Mental model: every source is translated into ONE canonical form, `LoadedWeights` = a
`ModelConfig` plus `{hf_name: float32 tensor}`, so the model code knows a single naming scheme
(Llama / Mixtral layout, see `expected_shapes`). Two sources:

- a GGUF file (llama architecture): config from the metadata, each tensor dequantized with
  `gguf.quants.dequantize`, renamed (`blk.0.attn_q.weight` -> `model.layers.0.self_attn.q_proj.weight`),
  stacked MoE experts split per expert, and Q/K rows un-permuted from llama.cpp's interleaved rotary
  layout back to HF's `rotate_half` layout;
- an HF folder: config.json + safetensors (one file or sharded with an index).

Both end in the same completeness check against the shapes the config implies, so a truncated or
foreign checkpoint fails here, with a message, rather than as a shape error deep in a forward pass.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from actors.engine.config import ModelConfig, RopeScaling
from actors.engine.errors import ModelNotFound, UnsupportedModel

logger = logging.getLogger(__name__)


@dataclass
class LoadedWeights:
    """A model ready to build: its config and its tensors (float32, contiguous, writable)."""

    config: ModelConfig
    tensors: dict[str, torch.Tensor]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def load_weights(path: str | Path) -> LoadedWeights:
    """Loads a `.gguf` file or an HF folder (config.json + *.safetensors)."""
    path = Path(path).expanduser()
    start_s = time.perf_counter()
    if path.is_file() and path.suffix == ".gguf":
        loaded = _load_gguf(path)
    elif path.is_dir():
        loaded = _load_hf_dir(path)
    elif not path.exists():
        raise ModelNotFound(f"model path {path} does not exist")
    else:
        raise UnsupportedModel(f"{path} is neither a .gguf file nor a folder with config.json and safetensors")
    _check_complete(loaded, path)
    logger.info("loaded %s: %d tensors, %.1f MB float32, in %.2f s",
                path, len(loaded.tensors), loaded.num_bytes / 1e6, time.perf_counter() - start_s)
    return loaded


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model loads, with its HF shape (Linear weights are [out, in])."""
    h, d = cfg.hidden_size, cfg.head_dim
    q_out, kv_out = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for proj, out in (("q", q_out), ("k", kv_out), ("v", kv_out)):
            shapes[f"{p}self_attn.{proj}_proj.weight"] = (out, h)
            if cfg.attention_bias:
                shapes[f"{p}self_attn.{proj}_proj.bias"] = (out,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        if cfg.is_moe:
            shapes[p + "block_sparse_moe.gate.weight"] = (cfg.num_experts, h)
            for j in range(cfg.num_experts):
                e = f"{p}block_sparse_moe.experts.{j}."
                shapes[e + "w1.weight"] = (cfg.intermediate_size, h)
                shapes[e + "w3.weight"] = (cfg.intermediate_size, h)
                shapes[e + "w2.weight"] = (h, cfg.intermediate_size)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, h)
            shapes[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, h)
            shapes[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
    return shapes


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's convert-time `permute` of a Q or K weight ([out, in]) or bias ([out]).

    llama.cpp stores each head's rows as interleaved pairs (x0, x1), (x2, x3), ... because its RoPE
    rotates adjacent pairs; HF's `rotate_half` pairs row i with row i + head_dim/2.
    """
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------- HF folder

def _load_hf_dir(path: Path) -> LoadedWeights:
    from safetensors.torch import load_file

    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelNotFound(f"{path} has no config.json (an HF model folder needs config.json + *.safetensors)")
    try:
        config = ModelConfig.from_hf_config(json.loads(config_path.read_text()), name=path.name)
    except (KeyError, ValueError) as e:
        raise UnsupportedModel(f"{config_path}: {e}") from e
    index_path = path / "model.safetensors.index.json"
    if index_path.is_file():
        files = sorted({path / f for f in json.loads(index_path.read_text())["weight_map"].values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelNotFound(f"{path}: shards listed in {index_path.name} are missing: {missing}")
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ModelNotFound(f"{path} has no *.safetensors files (ferry does not read .bin/.pt checkpoints)")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            tensors[name] = t.to(torch.float32).contiguous()
    return LoadedWeights(config, tensors)


# ---------------------------------------------------------------- GGUF

_GGUF_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "block_sparse_moe.gate",
}
# Mixtral's expert names: w1 = gate, w3 = up, w2 = down.
_GGUF_EXPERT = {"ffn_gate": "w1", "ffn_up": "w3", "ffn_down": "w2"}


def read_config(path: str | Path) -> ModelConfig:
    """The architecture alone, without reading or dequantizing weights (for a process that only
    routes requests, e.g. the HTTP ingress)."""
    path = Path(path)
    if path.is_dir():
        try:
            return ModelConfig.from_hf_config(json.loads((path / "config.json").read_text()), name=path.name)
        except FileNotFoundError as e:
            raise ModelNotFound(f"{path} has no config.json") from e
    return _open_gguf(path)[1]


def _open_gguf(path: Path) -> tuple[Any, ModelConfig, dict[str, Any]]:
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises bare ValueError/struct errors on corrupt files
        raise UnsupportedModel(f"{path} is not a readable GGUF file: {e}") from e
    meta = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("tokenizer.ggml.")}
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UnsupportedModel(f"{path}: GGUF architecture {arch!r} is not supported (ferry reads 'llama', incl. MoE)")
    if int(meta.get("split.count", 1)) > 1:
        raise UnsupportedModel(f"{path} is one part of a split GGUF; merge it first (llama-gguf-split --merge)")
    raw = {t.name: t for t in reader.tensors}
    return reader, _gguf_config(reader, meta, raw, path), raw


def _load_gguf(path: Path) -> LoadedWeights:
    _, config, raw = _open_gguf(path)
    shapes = expected_shapes(config)

    tensors: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name == "rope_freqs.weight":
            continue  # folded into config.rope_scaling by _gguf_config
        for hf_name, arr in _convert_gguf_tensor(name, _dequantize(t, path), config):
            if shapes.get(hf_name) != arr.shape:
                raise UnsupportedModel(f"{path}: tensor {name} -> {hf_name} has shape {arr.shape}, "
                                       f"the config implies {shapes.get(hf_name)}")
            tensors[hf_name] = torch.from_numpy(arr)
    return LoadedWeights(config, tensors)


def _dequantize(t: Any, path: Path) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        arr = dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise UnsupportedModel(f"{path}: tensor {t.name} has type {t.tensor_type.name}, "
                               "which gguf cannot dequantize") from e
    # F32 tensors come back as read-only views of the memmapped file: copy them so the caller
    # owns writable memory and the file can be closed.
    if isinstance(arr, np.memmap) or arr.dtype != np.float32 or not (arr.flags.writeable and arr.flags.c_contiguous):
        arr = np.array(arr, dtype=np.float32, order="C", copy=True)
    return arr


def _convert_gguf_tensor(name: str, arr: np.ndarray, cfg: ModelConfig) -> list[tuple[str, np.ndarray]]:
    """Maps one GGUF tensor to its HF tensor(s): stacked experts become one tensor per expert."""
    parts = name.split(".")
    if len(parts) == 2 and parts[0] in _GGUF_GLOBAL:
        return [(f"{_GGUF_GLOBAL[parts[0]]}.{parts[1]}", arr)]
    if len(parts) < 4 or parts[0] != "blk":
        raise UnsupportedModel(f"unknown GGUF tensor {name!r}")
    prefix, kind, suffix = f"model.layers.{parts[1]}.", parts[2], parts[-1]
    if kind.endswith("_exps"):  # [num_experts, out, in]
        w = _GGUF_EXPERT.get(kind.removesuffix("_exps"))
        if w is None:
            raise UnsupportedModel(f"unknown GGUF tensor {name!r}")
        return [(f"{prefix}block_sparse_moe.experts.{j}.{w}.{suffix}", arr[j]) for j in range(arr.shape[0])]
    if len(parts) == 5 and kind in _GGUF_EXPERT:  # older MoE GGUFs: blk.N.ffn_gate.J.weight
        return [(f"{prefix}block_sparse_moe.experts.{parts[3]}.{_GGUF_EXPERT[kind]}.{suffix}", arr)]
    if len(parts) != 4 or kind not in _GGUF_LAYER:
        raise UnsupportedModel(f"unknown GGUF tensor {name!r}")
    if kind == "attn_q":
        arr = np.ascontiguousarray(unpermute_qk(arr, cfg.num_heads))
    elif kind == "attn_k":
        arr = np.ascontiguousarray(unpermute_qk(arr, cfg.num_kv_heads))
    return [(f"{prefix}{_GGUF_LAYER[kind]}.{suffix}", arr)]


def _gguf_config(reader: Any, meta: dict[str, Any], raw: dict[str, Any], path: Path) -> ModelConfig:
    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise UnsupportedModel(f"{path}: GGUF metadata lacks llama.{key}")
        if isinstance(value, list):
            raise UnsupportedModel(f"{path}: per-layer llama.{key} is not supported")
        return value

    hidden, num_heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", meta.get("llama.rope.dimension_count", hidden // num_heads)))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise UnsupportedModel(f"{path}: partial rotary embeddings (rope dim != head_dim {head_dim}) are not supported")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab_size = len(tokens.data) if tokens is not None else int(get("vocab_size"))
    eos_ids: list[int] = []
    # eot/eom end a chat turn in Llama-3-style vocabularies: a server must stop on them too.
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        field = reader.fields.get(f"tokenizer.ggml.{key}")
        if field is not None and int(field.contents()) not in eos_ids:
            eos_ids.append(int(field.contents()))
    bos = reader.fields.get("tokenizer.ggml.bos_token_id")
    rope_theta = _f32(get("rope.freq_base", 10000.0))
    try:
        return ModelConfig(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=int(get("expert_feed_forward_length", meta.get("llama.feed_forward_length"))),
            num_layers=int(get("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            max_position_embeddings=int(get("context_length")),
            rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=_gguf_rope_scaling(meta, raw, rope_theta, head_dim, path),
            tie_word_embeddings="output.weight" not in raw,  # llama.cpp drops output.weight when tied
            attention_bias="blk.0.attn_q.bias" in raw,
            num_experts=int(get("expert_count", 0)),
            num_experts_per_tok=int(get("expert_used_count", 0)),
            bos_token_id=None if bos is None else int(bos.contents()),
            eos_token_ids=tuple(eos_ids),
            name=path.stem,
        )
    except (AssertionError, ValueError) as e:
        raise UnsupportedModel(f"{path}: inconsistent GGUF metadata: {e}") from e


def _f32(value: float) -> float:
    # GGUF floats are float32 (1e-5 reads back as 9.99999974e-06): the shortest decimal that
    # round-trips is the value the converter was given, so configs compare equal to HF's.
    return float(str(np.float32(value)))


def _gguf_rope_scaling(
    meta: dict[str, Any], raw: dict[str, Any], base: float, head_dim: int, path: Path
) -> RopeScaling:
    kind = meta.get("llama.rope.scaling.type", "none")
    orig = int(meta.get("llama.rope.scaling.original_context_length") or 8192)
    if kind == "linear":
        factor = _f32(meta["llama.rope.scaling.factor"])
        return RopeScaling("linear", factor=factor, original_max_position_embeddings=orig)
    if kind != "none":
        raise UnsupportedModel(f"{path}: rope scaling {kind!r} is not supported (none, linear, llama3)")
    if "rope_freqs.weight" not in raw:
        return RopeScaling()
    # Llama 3.x GGUFs carry llama3 scaling only as per-frequency divisors (rope_freqs). Rebuild the
    # HF parameters (factor from the largest divisor, Meta's low/high factors 1 and 4) and accept
    # them only if they reproduce the stored divisors: a mismatch would silently skew every position.
    stored = np.asarray(raw["rope_freqs.weight"].data, dtype=np.float64).reshape(-1)
    scaling = RopeScaling("llama3", factor=_f32(stored.max()), original_max_position_embeddings=orig)
    if not np.allclose(_llama3_divisors(scaling, base, head_dim), stored, rtol=1e-4):
        raise UnsupportedModel(f"{path}: rope_freqs does not match llama3 scaling; other rope factors are unsupported")
    return scaling


def _llama3_divisors(s: RopeScaling, base: float, head_dim: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter computes for HF `rope_type: llama3`."""
    inv_freq = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    orig = s.original_max_position_embeddings
    smooth = (orig / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    medium = 1.0 / ((1 - smooth) / s.factor + smooth)
    low_freq_wavelen, high_freq_wavelen = orig / s.low_freq_factor, orig / s.high_freq_factor
    return np.where(wavelen < high_freq_wavelen, 1.0, np.where(wavelen > low_freq_wavelen, s.factor, medium))


def _check_complete(loaded: LoadedWeights, path: Path) -> None:
    """Drops tensors the model never reads and insists on every one it does, with the right shape."""
    shapes = expected_shapes(loaded.config)
    extra = sorted(set(loaded.tensors) - set(shapes))
    for name in extra:
        del loaded.tensors[name]
    # Rotary inv_freq buffers and an lm_head saved beside tied embeddings are expected leftovers;
    # anything else may be a weight the model would need (biases, a different MLP) and is worth a warning.
    odd = [n for n in extra if not (n.endswith("rotary_emb.inv_freq") or n == "lm_head.weight")]
    if odd:
        logger.warning("%s: ignoring %d tensors the model does not use, e.g. %s", path, len(odd), odd[:5])
    missing = sorted(set(shapes) - set(loaded.tensors))
    if missing:
        raise UnsupportedModel(f"{path}: {len(missing)} expected tensors are missing, e.g. {missing[:5]}")
    for name, shape in shapes.items():
        if tuple(loaded.tensors[name].shape) != shape:
            raise UnsupportedModel(f"{path}: {name} has shape {tuple(loaded.tensors[name].shape)}, expected {shape}")
