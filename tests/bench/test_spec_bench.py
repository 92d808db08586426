"""bench/spec.py: its workloads come from real files (the renamed function is in the file the model
sees, sources cycle, clipping holds), mismatched greedy outputs are found and located, and a quick
run on a tiny random model reports every figure with greedy outputs identical to no speculation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.sampling import SamplingParams
from actors.engine.tiny_model import write_tiny_model
from actors.engine.tokenizer import Tokenizer
from bench import spec
from bench.spec_workloads import (
    MIN_SECTION_TOKENS,
    NUM_SOURCES,
    Prompt,
    TokenText,
    build_workloads,
    doc_sections,
    function_names,
)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-spec"), seed=0)


@pytest.fixture(scope="module")
def token_text(tiny_model_dir: Path) -> TokenText:
    tok = Tokenizer.load(tiny_model_dir)
    return TokenText(lambda t: tok.encode(t, add_special_tokens=False), tok.decode,
                     lambda m: tok.encode(tok.apply_chat_template(m), add_special_tokens=False))


def test_function_names_in_order_once_without_dunders() -> None:
    src = ("def a(x):\n    def inner():\n        pass\nclass C:\n    def __init__(self): ...\n"
           "    async  def b(self): ...\ndef a(y): ...\nx = 'def'\n")
    assert function_names(src) == ["a", "inner", "b"]


def test_doc_sections_split_at_level_two_headings() -> None:
    text = "# Title\nintro\n## One\nfirst\n### Sub\nmore\n## Two\nsecond\n"
    assert doc_sections(text) == [("One", "## One\nfirst\n### Sub\nmore\n"), ("Two", "## Two\nsecond\n")]


def test_workloads_from_files_on_this_machine(token_text: TokenText) -> None:
    code, docs, chat = build_workloads(token_text, ["code_edit", "summarize", "chat"], 10, 300)
    for wl in (code, docs):
        assert len(wl.prompts) == 10 and 1 <= len(wl.sources) <= NUM_SOURCES
        by_name = {s.name: s for s in wl.sources}
        assert [p.source for p in wl.prompts] == [wl.sources[i % len(wl.sources)].name for i in range(10)]
        for s in wl.sources:
            assert 0 < s.num_tokens <= 300 and s.num_tokens <= s.num_tokens_full
            assert s.num_tokens == len(token_text.encode(s.text))
        for p in wl.prompts:
            text = token_text.decode(p.token_ids)
            assert by_name[p.source].text.strip() in text and text.rstrip().endswith("assistant")
    for s in docs.sources:  # README.md / docs sections, long enough to be worth summarizing
        assert s.name.split("#")[0].endswith(".md") and s.num_tokens_full >= MIN_SECTION_TOKENS
    for p in code.prompts:  # the function to rename is defined in what the model sees
        name = p.instruction.split("`")[1]
        assert p.instruction.split("`")[3] == f"{name}_v2"
        assert name in function_names(next(s.text for s in code.sources if s.name == p.source))
    assert len({p.instruction for p in code.prompts}) > len(code.sources)  # several renames per file
    assert chat.sources == [] and all(p.source == "" for p in chat.prompts) and len(chat.prompts) == 10
    with pytest.raises(ValueError, match="unknown workload"):
        build_workloads(token_text, ["poetry"], 1, 300)


def test_mismatches_name_the_prompt_and_first_differing_position() -> None:
    prompts = [Prompt("a.py", "i", [1]), Prompt("b.py", "i", [2]), Prompt("c.py", "i", [3])]

    def done(*ids: int) -> spec.Finished:
        return spec.Finished(ids, 0.0, 1.0, 0, 0)

    base = [done(5, 6, 7), done(5, 6, 7), done(5, 6, 7)]
    got = [done(5, 6, 7), done(5, 9, 7), done(5, 6)]
    assert spec.mismatches(got, base, prompts) == [
        {"prompt": 1, "source": "b.py", "position": 1, "tokens": 3, "baseline_tokens": 3},
        {"prompt": 2, "source": "c.py", "position": 2, "tokens": 2, "baseline_tokens": 3},
    ]
    assert spec.mismatches(base, base, prompts) == []
    assert done(5, 6, 7).tpot_s == 0.5 and done(5).tpot_s is None
    assert [spec.num_requests(b, 2) for b in (1, 4, 16)] == [2, 4, 16] and spec.num_requests(4, 6) == 8


def test_baseline_margin_is_the_top2_gap_at_the_position(tiny_model_dir: Path, token_text: TokenText) -> None:
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(device="cpu", dtype="float32"))
    prompt = build_workloads(token_text, ["chat"], 1, 100)[0].prompts[0]
    (out,) = engine.generate([prompt.token_ids], SamplingParams(max_tokens=4, temperature=0.0, logprobs=2,
                                                                 ignore_eos=True))
    top = sorted((v for _, v in out.logprobs[-1].top), reverse=True)  # the 4th token's (one per step)
    assert spec.baseline_margin(engine, prompt, 3, "m") == pytest.approx(top[0] - top[1], abs=1e-6)
    assert top[0] - top[1] >= 0


@pytest.mark.slow
def test_quick_run_on_the_tiny_model(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = spec.main(["--model", str(tiny_model_dir), "--device", "cpu", "--quick", "--batches", "1,16", "--repeats", "2",
                   "--json"])
    figures = json.loads(capsys.readouterr().out)
    assert rc == 0 and figures["greedy_identical"] is True and figures["mismatches"] == 0
    assert figures["config"]["repeats"] == 2 and figures["config"]["max_tokens"] == spec.QUICK["max_tokens"]
    assert set(figures["workloads"]) == {"code_edit", "summarize", "chat"}
    drafted: dict[str, int] = {"ngram": 0, "early_exit": 0}
    for name, wl in figures["workloads"].items():
        assert wl["num_prompts"] == 16 and wl["prompt_tokens"]["min"] > 0
        assert 1 <= wl["output_tokens"]["min"] <= wl["output_tokens"]["max"] <= spec.QUICK["max_tokens"]
        assert (wl["sources"] == []) == (name == "chat")
        for b, n in (("b1", 1), ("b16", 16)):
            assert wl["off"][b]["requests"] == n and wl["off"][b]["decode_tok_s"] > 0
        assert set(wl["methods"]) == {"ngram", "early_exit"}
        for m, fig in wl["methods"].items():
            assert {"speedup_b1", "speedup_b16", "acceptance", "mismatches"} <= set(fig)
            assert fig["speedup_b1"] > 0 and fig["speedup_b16"] > 0 and fig["mismatches"] == 0
            for cell in fig["batches"].values():
                assert 0 <= cell["accepted_tokens"] <= cell["draft_tokens"] and cell["mismatch_list"] == []
                assert cell["acceptance"] == (cell["accepted_tokens"] / cell["draft_tokens"]
                                              if cell["draft_tokens"] else None)
                assert cell["tpot_mean_ms"] > 0 and cell["tpot_p99_ms"] >= cell["tpot_mean_ms"] * (1 - 1e-9)
                drafted[m] += cell["draft_tokens"]
    for m, total in drafted.items():  # the requests' totals are the engine's (warm-up included)
        stats = figures["engine_stats"][m]
        assert stats["spec_method"] == m and total <= stats["draft_tokens"]
    assert figures["engine_stats"]["off"]["draft_tokens"] == 0
    table = spec.render(figures)
    assert "greedy outputs identical to off: yes" in table and "code_edit" in table
