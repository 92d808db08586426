"""Text <-> token ids, chat templates and streaming detokenization, built on `tokenizers`.

Mental model: a `Tokenizer` is a `tokenizers.Tokenizer` (the fast Rust BPE, `backend`) plus the few
facts the engine needs around it: which ids are bos/eos/end-of-generation, whether encode prepends bos,
and the model's jinja chat template. It is built either from a GGUF file's metadata (vocab, merges,
token types and llama.cpp's name for the pre-tokenizer regex) or from a Hugging Face folder's
tokenizer.json; both paths must give exactly the ids transformers gives for the same model.

Streaming: byte-level BPE splits one character across tokens (an emoji is often 2-4 tokens), so
decoding token by token would emit U+FFFD. `IncrementalDetokenizer` decodes only the window
`ids[prefix_offset:]`, compares it with `ids[prefix_offset:read_offset]` (text already emitted) and
emits the difference once it ends on a complete character; the window then slides forward, so each
push costs O(1) however long the output grows.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from actors.engine.errors import InvalidRequest, ModelNotFound, UnsupportedModel

logger = logging.getLogger(__name__)

# llama.cpp token types (gguf.TokenType): CONTROL tokens are special (skipped when decoding),
# USER_DEFINED ones are added tokens matched whole in the text but kept when decoding (e.g. <think>).
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# llama.cpp pre-tokenizer names whose regex is a single Split followed by the byte-level mapping.
_SPLIT_PRE = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
              "qwen2": _QWEN2_SPLIT}
# These split every digit on its own first, then apply the GPT-2 regex (llama-vocab.cpp groups them).
_DIGITS_PRE = {"smollm", "starcoder", "refact"}
_GPT2_PRE = {"gpt2", "default"}

# Texts llama.cpp treats as end-of-generation when a vocab has them; an instruct model that emits
# <|endoftext|> instead of <|im_end|> has finished, and sampling past it only produces noise.
_EOG_TEXTS = frozenset({"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",
                        "<|endoftext|>", "<EOT>"})


class MissingChatTemplate(InvalidRequest):
    """A chat request for a model that ships no chat template."""


class ChatTemplateError(InvalidRequest):
    """The chat template refused the messages (e.g. roles that do not alternate)."""


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_PRE:
        return byte_level
    if pre in _DIGITS_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _SPLIT_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    known = sorted(_GPT2_PRE | _DIGITS_PRE | set(_SPLIT_PRE))
    raise UnsupportedModel(f"GGUF pre-tokenizer {pre!r} is not supported; known: {known}")


def _template_processing(backend: BackendTokenizer, bos: str | None, eos: str | None,
                         add_bos: bool, add_eos: bool) -> processors.TemplateProcessing:
    # Same shape transformers builds from add_bos_token/add_eos_token, so ids match it exactly.
    specials = [(t, backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on and t]

    def seq(name: str, type_id: int) -> str:
        return " ".join(([f"{bos}:{type_id}"] if add_bos and bos else []) + [f"${name}:{type_id}"]
                        + ([f"{eos}:{type_id}"] if add_eos and eos else []))

    return processors.TemplateProcessing(single=seq("A", 0), pair=f"{seq('A', 0)} {seq('B', 1)}",
                                         special_tokens=specials)


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json spells special tokens as a string or as a serialized AddedToken dict.
    return value.get("content") if isinstance(value, dict) else value


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


class Tokenizer:
    """A loaded tokenizer: encode/decode, special ids and the chat template of one model."""

    def __init__(self, backend: BackendTokenizer, *, bos_token_id: int | None, eos_token_id: int | None,
                 extra_eos_ids: Sequence[int] = (), chat_template: str | None = None) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        specials = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self.all_special_ids: frozenset[int] = frozenset(specials)
        eog = {i for i in specials if self.id_to_token(i) in _EOG_TEXTS}
        self.eos_token_ids: frozenset[int] = frozenset(
            {i for i in (eos_token_id, *extra_eos_ids) if i is not None} | eog)

    # ---- loading ------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if path.is_file() and path.suffix == ".gguf":
            return cls.from_gguf(path)
        if path.is_dir():
            return cls.from_hf_dir(path)
        raise ModelNotFound(f"no tokenizer at {path}: expected a .gguf file or a folder with tokenizer.json")

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        import gguf  # heavy import; only GGUF loading needs it

        if not Path(path).is_file():
            raise ModelNotFound(f"GGUF file not found: {path}")
        fields = gguf.GGUFReader(path).fields

        def get(key: str, default: Any = None) -> Any:
            return fields[key].contents() if key in fields else default

        model = get("tokenizer.ggml.model")
        if model != "gpt2":
            raise UnsupportedModel(f"{path}: tokenizer model {model!r} is not supported (only byte-level "
                                   f"BPE, tokenizer.ggml.model='gpt2')")
        pre = get("tokenizer.ggml.pre", "default")
        tokens: list[str] = get("tokenizer.ggml.tokens")
        types: list[int] = get("tokenizer.ggml.token_type") or [1] * len(tokens)
        vocab = {tok: i for i, tok in enumerate(tokens)}
        if len(vocab) != len(tokens):
            logger.warning("%s: %d duplicate token strings; later ids win", path, len(tokens) - len(vocab))
        merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges", [])]
        # llama.cpp skips merges for llama3-style vocabs when a whole pre-token is in the vocab.
        backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _SPLIT_PRE))
        backend.pre_tokenizer = _pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
        # Control/user-defined token strings are stored raw, so they are already vocab keys and keep
        # their ids; registering them makes "<|im_start|>" in the text encode to one id.
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, k in zip(tokens, types) if k == _CONTROL])
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t, k in zip(tokens, types) if k == _USER_DEFINED])
        bos_id, eos_id = get("tokenizer.ggml.bos_token_id"), get("tokenizer.ggml.eos_token_id")
        # llama.cpp and transformers both default add_bos to False for byte-level BPE vocabs.
        bos, eos = (tokens[i] if i is not None else None for i in (bos_id, eos_id))
        backend.post_processor = _template_processing(
            backend, bos, eos, bool(get("tokenizer.ggml.add_bos_token", False)),
            bool(get("tokenizer.ggml.add_eos_token", False)))
        extra = [get(k) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in fields]
        return cls(backend, bos_token_id=bos_id, eos_token_id=eos_id, extra_eos_ids=extra,
                   chat_template=get("tokenizer.chat_template"))

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ModelNotFound(f"{path} has no tokenizer.json (slow sentencepiece-only folders are unsupported)")
        backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
        cfg = _read_json(path / "tokenizer_config.json")
        model_cfg = _read_json(path / "config.json")
        bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
        bos_id = backend.token_to_id(bos) if bos else model_cfg.get("bos_token_id")
        # tokenizer.json's post-processor alone decides whether encode adds bos/eos: transformers 5
        # drops the config's add_bos_token/add_eos_token whenever tokenizer.json exists, and so do we.
        declared: list[int] = []
        for source in (model_cfg, _read_json(path / "generation_config.json")):
            ids = source.get("eos_token_id")
            declared += ids if isinstance(ids, list) else [ids] if ids is not None else []
        eos_id = backend.token_to_id(eos) if eos else (declared[0] if declared else None)
        template = cfg.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        elif isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(backend, bos_token_id=bos_id, eos_token_id=eos_id, extra_eos_ids=declared,
                   chat_template=template)

    # ---- text <-> ids -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def _token_text_of(self, token_id: int | None) -> str | None:
        return self.id_to_token(token_id) if token_id is not None else None

    # ---- chat ---------------------------------------------------------------------------------

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if not self.chat_template:
            raise MissingChatTemplate("this model has no chat template; send a plain completion prompt")
        # The same environment transformers renders with, so the prompt string is byte-identical.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])

        def raise_exception(message: str) -> None:
            raise ChatTemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
                   separators: Any = None, sort_keys: bool = False) -> str:
            # jinja's own tojson HTML-escapes quotes and <>, which would change the prompt.
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            *, tools: list[dict[str, Any]] | None = None) -> str:
        specials = {"bos_token": self._token_text_of(self.bos_token_id),
                    "eos_token": self._token_text_of(self.eos_token_id)}
        # An absent token must stay undefined (renders ""), not become the string "None".
        specials = {k: v for k, v in specials.items() if v is not None}
        try:
            return self._compiled_template.render(
                messages=[dict(m) for m in messages], tools=tools, documents=None,
                add_generation_prompt=add_generation_prompt, **specials)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e


# Prompt tokens kept as left context, so the first output token decodes as it would mid-text.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids or [])[-_CONTEXT_TOKENS:]  # context + outputs
        self._prefix_offset = 0  # window start: text from here to _read_offset was already emitted
        self._read_offset = len(self._ids)  # first id whose text is not emitted yet
        self.token_ids: list[int] = []  # output ids only
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._chunks)

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes ("" while a character is unfinished)."""
        self.token_ids.append(token_id)
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset], self._skip_special_tokens)
        new_text = decode(self._ids[self._prefix_offset:], self._skip_special_tokens)
        # A trailing U+FFFD means the last bytes are the start of a character still being generated.
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._chunks.append(delta)
        return delta
