"""Token ids -> the strings and bytes OpenAI's logprobs show, and the two endpoints' logprob shapes.

Mental model: a token's string is its own decoded text. Byte-level BPE cuts multi-byte characters
across tokens, and such a token alone decodes to U+FFFD; its real bytes are recovered from its
vocabulary entry (GPT-2's byte <-> unicode map, or a `<0xNN>` byte-fallback piece) and it is shown
as `bytes:\\xNN...` (vLLM's convention), so two different partial tokens never collapse into one
key of a completions `top_logprobs` dict. Chat logprobs also carry the raw `bytes`, as OpenAI's do.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

from actors.engine.sampling import TokenLogprobs
from actors.engine.tokenizer import Tokenizer
from deploy.openai.responses import CompletionLogprobs, TokenLogprob, TopLogprob

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable bytes map to themselves, the other 68 bytes
    to code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


class TokenStrings:
    """Cached (display string, raw bytes) per token id of one tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int] | None]] = {}

    def get(self, token_id: int) -> tuple[str, list[int] | None]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._resolve(token_id)
        return hit

    def _resolve(self, token_id: int) -> tuple[str, list[int] | None]:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text, list(text.encode("utf-8"))
        raw = self._raw_bytes(token_id)
        if raw is None:
            return text, None
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw

    def _raw_bytes(self, token_id: int) -> list[int] | None:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return None
        if m := _BYTE_FALLBACK.fullmatch(piece):
            return [int(m.group(1), 16)]
        table = _unicode_to_byte()
        if all(ch in table for ch in piece):
            return [table[ch] for ch in piece]
        return None


def completion_logprobs(strings: TokenStrings, logprobs: Sequence[TokenLogprobs | None],
                        text_offset: int) -> tuple[CompletionLogprobs, int]:
    """Legacy completions shape for these tokens; returns it and the offset after the last token."""
    tokens: list[str] = []
    values: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    for lp in logprobs:
        if lp is None:
            continue
        text, _ = strings.get(lp.token_id)
        tokens.append(text)
        values.append(lp.logprob)
        tops.append({strings.get(t)[0]: v for t, v in lp.top})
        offsets.append(text_offset)
        text_offset += len(text)
    return CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops,
                              text_offset=offsets), text_offset


def chat_logprobs(strings: TokenStrings, logprobs: Sequence[TokenLogprobs | None]) -> list[TokenLogprob]:
    """Chat shape: one object per generated token, its alternatives most likely first."""
    content: list[TokenLogprob] = []
    for lp in logprobs:
        if lp is None:
            continue
        text, raw = strings.get(lp.token_id)
        top = [TopLogprob(token=s, logprob=v, bytes=b) for t, v in lp.top for s, b in [strings.get(t)]]
        content.append(TokenLogprob(token=text, logprob=lp.logprob, bytes=raw, top_logprobs=top))
    return content
