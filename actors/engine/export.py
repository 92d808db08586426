"""Write a GGUF model as a Hugging Face folder, so that another server (vLLM's CPU build, transformers)
loads exactly the weights ferry serves.

Mental model: transformers already reads GGUF files and dequantizes their tensors the way ferry's
loader does (tests/actors/engine/test_weights.py checks the two agree); this module asks it for the
float model and its tokenizer and saves both as a folder: `config.json`, `model.safetensors`,
`generation_config.json`, the tokenizer files and the chat template the GGUF carries. The folder is
written under a temporary name beside the destination and renamed into place, so a folder at the
destination is always complete.
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from actors.engine.errors import ModelNotFound
from actors.engine.fetch import resolve_model

# What an HF folder needs for a server to load it: the config, the weights, a tokenizer.
HF_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def export_hf(model: str | Path, dest: Path, *, dtype: str = "float32", force: bool = False,
              progress: Callable[[str], None] | None = None) -> Path:
    """`model` (a known name, fetched if missing, or a .gguf path) written as an HF folder at `dest`."""
    import torch
    import transformers

    report = progress or (lambda msg: None)
    gguf = resolve_model(str(model))
    if gguf.is_dir():
        raise ModelNotFound(f"{gguf} is already a Hugging Face folder; nothing to export")
    dest = Path(dest).expanduser()
    if dest.exists() and any(dest.iterdir()) and not force:
        raise FileExistsError(f"{dest} exists and is not empty; pass force=True (--force) to replace it")
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    report(f"dequantizing {gguf.name} to {dtype} (transformers' GGUF reader)")
    hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch_dtype, output_loading_info=True)
    if info["missing_keys"] or info["unexpected_keys"]:
        raise ValueError(f"{gguf.name}: transformers left weights unmatched: {info}")
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    report(f"writing {dest}")
    return write_hf(hf_model, tokenizer, dest, source=gguf, dtype=dtype)


EXPORT_RECORD = "ferry_export.json"  # in every export: the GGUF it came from and its dtype


def _record(source: Path, dtype: str) -> dict[str, str]:
    return {"source": source.name, "dtype": dtype}


def is_export_of(folder: Path, source: Path, dtype: str) -> bool:
    """Whether `folder` is an export of the GGUF `source` in `dtype` (its record says so)."""
    try:
        return json.loads((folder / EXPORT_RECORD).read_text()) == _record(source, dtype)
    except (OSError, ValueError):
        return False


def write_hf(hf_model, tokenizer, dest: Path, *, source: Path, dtype: str) -> Path:  # noqa: ANN001
    """A transformers model and tokenizer loaded from the GGUF `source`, saved as an HF folder at `dest`
    (replacing what is there)."""
    import transformers

    if tokenizer.chat_template is None:  # older transformers drop it: take it from the GGUF itself
        from actors.engine.tokenizer import Tokenizer

        tokenizer.chat_template = Tokenizer.load(source).chat_template
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        _save_weights(hf_model, tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / EXPORT_RECORD).write_text(json.dumps(_record(source, dtype), indent=1) + "\n")
        missing = [name for name in HF_FILES if not (tmp / name).is_file()]
        if missing:
            raise RuntimeError(f"the export lacks {missing}; transformers {transformers.__version__} wrote "
                               f"{sorted(p.name for p in tmp.iterdir())}")
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return dest


def _save_weights(hf_model, folder: Path) -> None:  # noqa: ANN001 - a transformers PreTrainedModel
    """config.json, generation_config.json and model.safetensors of the dequantized model.

    transformers refuses `save_pretrained` on a model it loaded from GGUF (it counts as quantized),
    though its tensors are plain floats by then: so the config goes without its GGUF quantization
    entry, and the weights as a plain state dict, the tied output head left out as HF folders do."""
    from safetensors.torch import save_file

    config = copy.deepcopy(hf_model.config)  # the caller's model keeps its own
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(folder)
    hf_model.generation_config.save_pretrained(folder)
    state = {name: t.detach().contiguous() for name, t in hf_model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
