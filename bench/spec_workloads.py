"""Prompts for bench/spec.py, built from real files on this machine: where speculation pays, and where not.

Mental model: three workloads of chat prompts, each a list of `Prompt`s in the model's own chat
template, every prompt a source text (or none) followed by an instruction:
- code_edit: a Python module of the venv's site-packages (pinned by the lock file; 800-1,300 tokens
  of SmolLM2's tokenizer each) + "rename function X to Y, output the whole file". The answer mostly
  copies the prompt, so prompt-lookup (n-gram) drafts are right most of the time.
- summarize: a "## " section of the repo's README.md or docs/*.md (at least 400 tokens) + a
  request for a summary: the answer reuses some phrases of the text.
- chat: open questions with no source text: nothing to copy, where speculation should not pay.
Each source serves several prompts (different instructions after the same text, in the order
source 0, 1, 2, 3, 0, 1, ...), so the first few prompts cover every source and the prompts of one
source share its text as a prefix (the prefix cache keeps the bench's prefill short). A source over
`max_source_tokens` is clipped at a line end before that many tokens (a module clipped before its
first function starts at that function instead).
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
NUM_SOURCES = 4  # sources per workload; the prompts cycle through them
MIN_SECTION_TOKENS = 400  # summarize: shorter doc sections are not worth summarizing

# code_edit: site-packages modules of 800-1,300 tokens with several functions (first NUM_SOURCES found)
CODE_MODULES = ("jinja2.visitor", "jinja2.meta", "attr.converters", "h11._util", "iniconfig._parse",
                "jinja2.async_utils")
# where code_edit falls back to when those packages are missing: the repo's own engine modules
CODE_FALLBACK_GLOB = "actors/engine/*.py"
DOC_FILES = ("README.md", "docs/*.md")

SUMMARY_INSTRUCTIONS = (
    "Summarize this section in three sentences.",
    "List the main points of this text as a short bullet list.",
    "Write a one-paragraph summary of this text for an engineer who is new to the project.",
    "Summarize what this text says the system does, and why.",
)
CHAT_QUESTIONS = (
    "What are some good habits for staying healthy while working from home?",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "What should I pack for a week-long hiking trip in the mountains?",
    "Give me three ideas for a birthday party for my grandmother.",
    "How do I make a good cup of tea?",
    "What are the pros and cons of living in a big city?",
    "Write a poem about the ocean at night.",
    "How can I get better at public speaking?",
    "Describe a perfect weekend in the countryside.",
    "What is the difference between a virus and a bacterium?",
    "Suggest a weekly meal plan for a vegetarian student on a budget.",
    "Why do leaves change color in autumn?",
    "Write a friendly email inviting my neighbors to a garden party.",
    "What are good ways to learn a new language as an adult?",
    "Tell me about the history of the bicycle.",
)
WORKLOADS = ("code_edit", "summarize", "chat")
_DEF = re.compile(r"^[ \t]*(?:async[ \t]+)?def[ \t]+([A-Za-z_]\w*)", re.MULTILINE)

Encode = Callable[[str], list[int]]  # text -> token ids, no special tokens
Decode = Callable[[list[int]], str]
EncodeChat = Callable[[list[dict[str, str]]], list[int]]  # messages -> the chat template's token ids


@dataclass(frozen=True)
class Source:
    name: str  # a path (relative to site-packages or the repo) and, for a doc section, its heading
    text: str  # as given to the model: clipped to max_source_tokens
    num_tokens: int  # of `text`
    num_tokens_full: int  # before clipping


@dataclass(frozen=True)
class Prompt:
    source: str  # Source.name, or "" for chat
    instruction: str
    token_ids: list[int]  # the whole chat prompt (template included)


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    sources: list[Source]
    prompts: list[Prompt]


class TokenText:
    """The model's tokenizer as the workloads need it: count tokens, clip a text, apply the chat template."""

    def __init__(self, encode: Encode, decode: Decode, encode_chat: EncodeChat) -> None:
        self.encode, self.decode, self.encode_chat = encode, decode, encode_chat

    def source(self, name: str, text: str, max_tokens: int) -> Source:
        ids = self.encode(text)
        clipped = text
        if len(ids) > max_tokens:
            head = self.decode(ids[:max_tokens])
            cut = head.rfind("\n")
            clipped = head[:cut + 1] if cut > 0 else head  # whole lines, unless the first line is too long
        return Source(name, clipped, len(self.encode(clipped)), len(ids))

    def prompt(self, source: str, text: str, instruction: str) -> Prompt:
        return Prompt(source, instruction, self.encode_chat([{"role": "user", "content": text}]))


def module_file(module: str) -> Path | None:
    """The file of an importable module, without importing it (None when it is not installed)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin and spec.origin.endswith(".py") else None


def function_names(source: str) -> list[str]:
    """Names of the functions and methods a (possibly clipped) Python source defines, in order,
    once each, dunders left out."""
    seen: dict[str, None] = {}
    for name in _DEF.findall(source):
        if not (name.startswith("__") and name.endswith("__")):
            seen.setdefault(name, None)
    return list(seen)


def _cycled(sources: list[Source], instructions: list[list[str]], count: int) -> list[tuple[Source, str]]:
    """(source, instruction) pairs: sources 0, 1, ..., n-1, 0, 1, ..., each time with that source's next instruction."""
    pairs = []
    for i in range(count):
        j = i % len(sources)
        options = instructions[j]
        pairs.append((sources[j], options[(i // len(sources)) % len(options)]))
    return pairs


def code_edit(tok: TokenText, count: int, max_source_tokens: int) -> Workload:
    paths: list[tuple[str, Path]] = []
    for module in CODE_MODULES:
        path = module_file(module)
        if path is not None:
            paths.append((f"site-packages/{module.replace('.', '/')}.py", path))
    if len(paths) < NUM_SOURCES:
        paths += [(str(p.relative_to(REPO_ROOT)), p) for p in sorted(REPO_ROOT.glob(CODE_FALLBACK_GLOB))]
    sources: list[Source] = []
    renames: list[list[str]] = []
    for name, path in paths:
        text = path.read_text(encoding="utf-8")
        src = tok.source(name, text, max_source_tokens)
        first_def = next((m for m in _DEF.finditer(text) if function_names(m.group(0))), None)
        if not function_names(src.text) and first_def is not None:  # clipped before any function: start at one
            line = text.count("\n", 0, first_def.start())
            src = tok.source(f"{name}:{line + 1}-", text[first_def.start():], max_source_tokens)
        functions = function_names(src.text)
        if functions:  # the renamed function must be in what the model sees
            sources.append(src)
            renames.append([f"Rewrite this file with the function `{f}` renamed to `{f}_v2`, everywhere it "
                            "appears. Output the whole file and nothing else." for f in functions])
        if len(sources) == NUM_SOURCES:
            break
    if not sources:
        raise RuntimeError(f"no Python source with a function found among {CODE_MODULES} or {CODE_FALLBACK_GLOB}")
    prompts = [tok.prompt(s.name, f"Here is a Python file:\n\n```python\n{s.text}```\n\n{instr}", instr)
               for s, instr in _cycled(sources, renames, count)]
    return Workload("code_edit", "a site-packages module + rename a function, output the whole file",
                    sources, prompts)


def doc_sections(text: str) -> list[tuple[str, str]]:
    """(heading, section text) of each "## " section of a markdown text (its heading line included)."""
    parts = re.split(r"(?m)^(?=## )", text)
    return [(p.splitlines()[0][3:].strip(), p.strip() + "\n") for p in parts if p.startswith("## ")]


def summarize(tok: TokenText, count: int, max_source_tokens: int) -> Workload:
    sources: list[Source] = []
    for pattern in DOC_FILES:
        for path in sorted(REPO_ROOT.glob(pattern)):
            for heading, section in doc_sections(path.read_text(encoding="utf-8")):
                src = tok.source(f"{path.relative_to(REPO_ROOT)}#{heading}", section, max_source_tokens)
                if src.num_tokens_full >= MIN_SECTION_TOKENS and len(sources) < NUM_SOURCES:
                    sources.append(src)
    if not sources:
        raise RuntimeError(f"no section of >= {MIN_SECTION_TOKENS} tokens in {DOC_FILES} under {REPO_ROOT}")
    prompts = [tok.prompt(s.name, f"Here is a section of a project's documentation:\n\n{s.text}\n{instr}", instr)
               for s, instr in _cycled(sources, [list(SUMMARY_INSTRUCTIONS)] * len(sources), count)]
    return Workload("summarize", "a README/docs section + a request for a summary", sources, prompts)


def chat(tok: TokenText, count: int) -> Workload:
    prompts = [tok.prompt("", q, q) for q in (CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)] for i in range(count))]
    return Workload("chat", "open questions, no source text to copy", [], prompts)


def build_workloads(tok: TokenText, names: list[str], count: int, max_source_tokens: int) -> list[Workload]:
    """`count` prompts for each named workload (names from `WORKLOADS`)."""
    builders: dict[str, Callable[[], Workload]] = {
        "code_edit": lambda: code_edit(tok, count, max_source_tokens),
        "summarize": lambda: summarize(tok, count, max_source_tokens),
        "chat": lambda: chat(tok, count),
    }
    unknown = [n for n in names if n not in builders]
    if unknown:
        raise ValueError(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    return [builders[n]() for n in names]
