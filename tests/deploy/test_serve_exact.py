"""Exact by default, through the real disaggregated app: Ray, Serve, the prefill and decode
deployments, the KV over the configured transport (NIXL where it imports), with deploy/serve.yaml's
own settings (compression auto, float32). Greedy tokens for two short prompts and one of >= 600
tokens (past the 512-token prefill chunk and dozens of 16-token KV blocks), sent at once, equal the
in-process engine's exactly, on a tiny random model here and on SmolLM2 in test_multinode.py (the
same check across four nodes, so the real model loads once); every
exact tenant's transfer names a lossless codec in its timeline, and a tenant that opted into lossy KV
gets the lossy codec it asked for (and its fidelity) in its own."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.serving import served_app

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PORT = 8333
REPO = Path(__file__).resolve().parents[2]
EXACT = {"Authorization": "Bearer sk-exact"}
LOSSY = {"Authorization": "Bearer sk-lossy"}
MAX_TOKENS = 16
SHORT = ["The ferry leaves the harbor at seven in the morning", "Photosynthesis is the process by which plants"]


def serve_yaml_args(model: str) -> dict[str, Any]:
    """deploy/serve.yaml's app args as shipped, sized for a 2-core test box, plus two tenants: acme
    with the defaults (exact KV), lab opted into lossy int8. P->D always (no local prefill), so
    every request's KV crosses the wire."""
    doc = yaml.safe_load((REPO / "deploy" / "serve.yaml").read_text())
    args = doc["applications"][0]["args"]
    args["model"] = model
    args["engine"] |= {"kv_cache_mib": 64, "max_num_seqs": 8}
    args["prefix_cache"] |= {"dram_mib": 32, "disk_mib": 0}
    args["transfer"] |= {"staging_mib": 32}
    args["scheduler"] = {"local_prefill": False,
                         "tenants": {"acme": {}, "lab": {"kv_fidelity": "lossy", "kv_compression": "int8"}}}
    args["api"] = {"api_keys": {"sk-exact": "acme", "sk-lossy": "lab"}}
    return args


def long_prompts(model: Path, num_tokens: int, count: int) -> list[str]:
    """`count` distinct texts of at least `num_tokens` tokens: windows of the README."""
    from actors.engine.tokenizer import Tokenizer

    tok = Tokenizer.load(model)
    words = (REPO / "README.md").read_text().split()
    out = []
    for i in range(count):
        at, n = 400 * i, 200
        while len(tok.encode(" ".join(words[at : at + n]))) < num_tokens:
            n += 100
        out.append(" ".join(words[at : at + n]))
    return out


@functools.cache
def _engine(model: Path) -> Any:
    from actors.engine.config import EngineConfig
    from actors.engine.engine import Engine

    return Engine.from_pretrained(model, EngineConfig(dtype="float32", kv_cache_bytes=256 << 20))


def reference(model: Path, prompts: list[str], max_tokens: int = MAX_TOKENS) -> list[str]:
    """The engine alone, in this process (loaded once per model): what the app must answer."""
    from actors.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [o.text for o in _engine(model).generate(prompts, params)]


def complete(url: str, prompt: str, headers: dict[str, str]) -> tuple[str, dict[str, Any]]:
    """(greedy text, the request's timeline) through the app."""
    import httpx2

    body = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    r = httpx2.post(f"{url}/v1/completions", json=body, headers=headers, timeout=300)
    assert r.status_code == 200, r.text
    timeline = httpx2.get(f"{url}/v1/requests/{r.json()['id']}/timeline", headers=headers, timeout=30)
    assert timeline.status_code == 200, timeline.text
    return r.json()["choices"][0]["text"], timeline.json()


def check_codecs(exact: list[dict[str, Any]], lossy: dict[str, Any], cross_node: bool = False) -> None:
    """Every exact tenant's transfer went lossless; the lossy tenant's as the int8 it asked for;
    each from the prefill worker's Ray node to its decode worker's, another one or not."""
    for timeline in [*exact, lossy]:
        to = timeline["prefill"]["kv_to"]
        assert to["worker"] == timeline["decode"]["workers"][0] and to["cross_node"] is cross_node, timeline["prefill"]
        assert (timeline["prefill"]["node"] != to["node"]) is cross_node and to["node"], timeline["prefill"]
    for timeline in exact:
        codec = timeline["prefill"]["kv_codec"]
        assert codec["codec"] in ("none", "zstd") and codec["lossless"] and codec["fidelity"] == "exact", codec
    codec = lossy["prefill"]["kv_codec"]
    assert (codec["codec"], codec["reason"], codec["fidelity"], codec["lossless"]) == ("int8", "forced", "lossy", False)


def test_served_tiny_model_is_the_engine_token_for_token(ray_cluster: Any, tmp_path: Path) -> None:
    """SmolLM2 gets the same check on four nodes (tests/deploy/test_multinode.py), so it loads once."""
    from actors.engine.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny-exact", seed=3)
    prompts = SHORT + long_prompts(model, 600, 1)
    want = reference(model, prompts)
    args = serve_yaml_args(str(model))
    args["api"]["served_model_names"] = ["m"]
    with served_app("ferry-exact-tiny", PORT, args) as url:
        with ThreadPoolExecutor(len(prompts)) as pool:  # several at once: batched prefill and decode
            got = list(pool.map(lambda p: complete(url, p, EXACT), prompts))
        _, lossy = complete(url, prompts[2], LOSSY)  # int8 KV: its tokens may differ, by the tenant's choice
    assert [text for text, _ in got] == want
    check_codecs([timeline for _, timeline in got], lossy)
