"""A greedy probe before any system is measured: does it answer a plain question with words?

A peer that loaded the model wrong (a bad build, wrong flags, a chat template on a raw prompt)
can be fast because it answers garbage. Before its first rate the harness asks each system one
greedy completion of a fixed prompt and keeps the answer, so the results show what every system
said; a system that does not answer, or answers without words, is reported as skipped with that
answer instead of being measured.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import httpx2

PROBE_PROMPT = "The capital of France is"
PROBE_TOKENS = 12
_WORD = re.compile(r"[^\W\d_]{2,}")  # two or more letters of any script


@dataclass(frozen=True, slots=True)
class ProbeAnswer:
    text: str  # what the system answered (or why there was no answer)
    sensible: bool
    why: str = ""  # when not sensible

    def to_dict(self) -> dict[str, object]:
        return {"prompt": PROBE_PROMPT, "max_tokens": PROBE_TOKENS, "text": self.text, "sensible": self.sensible,
                "why": self.why}


def judge(text: str) -> ProbeAnswer:
    """Sensible: at least two words, and words make up most of the answer (not bytes, digits or
    one symbol repeated)."""
    words = _WORD.findall(text)
    if len(words) < 2:
        return ProbeAnswer(text, False, f"{len(words)} words in the answer")
    worded = sum(len(w) for w in words)
    if worded < 0.5 * len(text.strip()):
        return ProbeAnswer(text, False, f"only {worded} of {len(text.strip())} characters are words")
    return ProbeAnswer(text, True)


def probe(url: str, model: str, api_key: str | None = None, timeout_s: float = 120.0) -> ProbeAnswer:
    """One greedy, non-streamed completion of `PROBE_PROMPT`, judged."""
    base = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": model, "prompt": PROBE_PROMPT, "max_tokens": PROBE_TOKENS, "temperature": 0.0}
    try:
        r = httpx2.post(f"{base}/v1/completions", json=body, headers=headers, timeout=timeout_s, trust_env=False)
    except httpx2.HTTPError as e:
        return ProbeAnswer(f"{type(e).__name__}: {e}", False, "no answer")
    if r.status_code != 200:
        return ProbeAnswer(r.text[:200], False, f"HTTP {r.status_code}")
    try:
        text = r.json()["choices"][0]["text"]
    except (ValueError, KeyError, IndexError, TypeError):
        return ProbeAnswer(r.text[:200], False, "not an OpenAI completion")
    return judge(str(text))
