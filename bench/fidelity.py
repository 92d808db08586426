"""Is the served model the model? Greedy chat answers from a running ferry against transformers'
float32 greedy on the same GGUF.

Start the app first (`make run`, or `ferry serve --config deploy/serve.yaml`), then
`.venv/bin/python -m bench.fidelity [--url http://127.0.0.1:8000] [--prompts 24] [--tokens 64] [--json]`.
Each prompt is one user turn through the model's chat template; the app is asked for temperature 0
and at most `max_tokens` tokens (both sides stop at the end-of-turn token), all prompts at once;
transformers loads the same GGUF (`from_pretrained(folder, gguf_file=...)`, float32) and decodes
greedily. Reported: prompts identical token for token, the mean shared prefix, the codecs the app's
timelines name for the prefill -> decode KV, and each differing prompt's first differing token.
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.common import bench_parser, format_table, progress, run

TOPICS = [
    "the water cycle", "how a bicycle gear works", "why the sky is blue", "the French Revolution",
    "photosynthesis", "how vaccines work", "the rules of chess", "what a compiler does", "the moon's phases",
    "how bread rises", "plate tectonics", "the causes of inflation", "how a refrigerator cools", "black holes",
    "the history of the printing press", "how neurons fire", "what a database index is", "ocean tides",
    "how airplanes fly", "the life of bees", "why leaves change colour", "how a battery stores energy",
    "the Roman Empire's fall", "how rainbows form", "what DNA does", "how a lighthouse works",
]


def prompts(n: int) -> list[str]:
    return [f"In a few sentences, explain {TOPICS[i % len(TOPICS)]}." for i in range(n)]


def served(url: str, prompt: str, max_tokens: int, api_key: str | None) -> tuple[str, str | None]:
    """(answer text, the KV codec of its prefill -> decode handoff, None without one) from the app."""
    import httpx2

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": "smollm2", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0}
    r = httpx2.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=600)
    r.raise_for_status()
    doc = r.json()
    text = doc["choices"][0]["message"]["content"]
    timeline = httpx2.get(f"{url}/v1/requests/{doc['id']}/timeline", headers=headers, timeout=30)
    prefill = timeline.json().get("prefill") if timeline.status_code == 200 else None
    codec = None if not prefill else prefill["kv_codec"]["codec"]
    return text, codec


_TOK: Any = None


def tokenizer() -> Any:
    global _TOK
    if _TOK is None:
        from actors.engine.fetch import resolve_model
        from actors.engine.tokenizer import Tokenizer

        _TOK = Tokenizer.load(resolve_model("smollm2"))
    return _TOK


def reference(texts: list[str], max_tokens: int) -> list[list[int]]:
    """transformers' float32 greedy continuation of each chat prompt, on the same GGUF."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actors.engine.fetch import resolve_model

    path = resolve_model("smollm2")
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32)
    out = []
    for i, text in enumerate(texts):
        ids = tokenizer().encode(tokenizer().apply_chat_template([{"role": "user", "content": text}]),
                                 add_special_tokens=False)
        with torch.inference_mode():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=tok.eos_token_id)
        out.append(gen[0, len(ids):].tolist())
        progress(f"fidelity: transformers {i + 1}/{len(texts)}")
    return out


def bench(args: argparse.Namespace) -> dict[str, Any]:
    texts = prompts(args.prompts)
    progress(f"fidelity: {len(texts)} prompts through {args.url}, all at once")
    with ThreadPoolExecutor(len(texts)) as pool:
        got = list(pool.map(lambda t: served(args.url, t, args.tokens, args.api_key), texts))
    want = reference(texts, args.tokens)
    rows = []
    for i, ((text, codec), ref) in enumerate(zip(got, want)):
        # texts compared (the app answers text): the reference's tokens decoded, and the longest run
        # of its leading tokens whose text the app's answer starts with
        same = text == tokenizer().decode(ref)
        shared = len(ref) if same else next(j for j in range(len(ref) + 1)
                                            if j == len(ref) or not text.startswith(tokenizer().decode(ref[: j + 1])))
        rows.append({"prompt": i, "identical": same, "shared_prefix": shared / len(ref),
                     "first_diff_at": None if same else shared, "kv_codec": codec})
    codecs: dict[str, int] = {}
    for r in rows:
        codecs[str(r["kv_codec"])] = codecs.get(str(r["kv_codec"]), 0) + 1
    return {"prompts": len(rows), "tokens": args.tokens, "identical": sum(r["identical"] for r in rows),
            "mean_shared_prefix": sum(r["shared_prefix"] for r in rows) / len(rows), "kv_codecs": codecs,
            "rows": rows}


def render(f: dict[str, Any]) -> str:
    rows = f["rows"]
    table = format_table(["prompt", "identical", "shared prefix", "first diff at", "kv codec"],
                         [[r["prompt"], r["identical"], f"{r['shared_prefix']:.0%}", r["first_diff_at"] or "-",
                           r["kv_codec"] or "(local prefill)"] for r in rows],
                         title=f"Served greedy vs transformers float32, {f['tokens']} tokens")
    return (f"{table}\n\n{f['identical']}/{len(rows)} identical, mean shared prefix {f['mean_shared_prefix']:.0%}, "
            f"codecs {f['kv_codecs']}")


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=64)
    run(bench, ap.parse_args(), render)


if __name__ == "__main__":
    main()
