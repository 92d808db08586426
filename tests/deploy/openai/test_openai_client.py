"""The official `openai` client against the running app: every answer is compared with a second
engine on the same tiny model, so text, token counts and logprobs are asserted exactly."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from actors.engine.config import EngineConfig
from actors.engine.engine import Engine
from actors.engine.output import RequestOutput
from actors.engine.sampling import SamplingParams
from tests.deploy.openai.conftest import MAX_MODEL_LEN, Served

PROMPT = "The ferry leaves the harbor"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is the ferry?"}]
NO_EOS = {"ignore_eos": True}  # random weights may end a text at once; exact lengths need this


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Engine:
    """A second engine on the same weights: what every answer must equal."""
    return Engine.from_pretrained(tiny_model_dir, EngineConfig(num_blocks=64))


@pytest.fixture(scope="module")
def client(served: Served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="key-a", max_retries=0, timeout=30) as c:
        yield c


def expect(reference: Engine, prompt: str | list[int], **params: object) -> RequestOutput:
    [out] = reference.generate([prompt], SamplingParams(ignore_eos=True, **params))  # type: ignore[arg-type]
    return out


def expect_logprobs(reference: Engine, prompt: str | list[int], **params: object) -> list[float]:
    """The chosen tokens' logprobs; outputs are per-step deltas, so step the engine by hand."""
    reference.add_request("ref", prompt, SamplingParams(ignore_eos=True, **params))  # type: ignore[arg-type]
    values: list[float] = []
    while reference.has_unfinished_requests():
        for out in reference.step():
            values += [lp.logprob for lp in out.logprobs if lp is not None]
    return values


def chat_ids(reference: Engine) -> list[int]:
    return reference.encode_chat(MESSAGES)


def test_completion_greedy(client: openai.OpenAI, reference: Engine) -> None:
    want = expect(reference, PROMPT, max_tokens=6, temperature=0)
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, extra_body=NO_EOS)
    assert got.id.startswith("cmpl-") and got.object == "text_completion" and got.model == "tiny"
    [choice] = got.choices
    assert (choice.index, choice.text, choice.finish_reason, choice.logprobs) == (0, want.text, "length", None)
    n_prompt = len(reference.tokenizer.encode(PROMPT))
    assert got.usage is not None
    assert (got.usage.prompt_tokens, got.usage.completion_tokens, got.usage.total_tokens) == (n_prompt, 6, n_prompt + 6)


def test_completion_stream_with_usage(client: openai.OpenAI, reference: Engine) -> None:
    want = expect(reference, PROMPT, max_tokens=6, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=NO_EOS))
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    *text_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == want.text
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * (len(text_chunks) - 1) + ["length"]
    assert all(c.usage is None for c in text_chunks)
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 6
    assert usage_chunk.usage.prompt_tokens == len(reference.tokenizer.encode(PROMPT))


def test_chat_matches_engine_stream_and_not(client: openai.OpenAI, reference: Engine) -> None:
    want = expect(reference, chat_ids(reference), max_tokens=5, temperature=0)
    got = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0,
                                         extra_body=NO_EOS)
    assert got.id.startswith("chatcmpl-") and got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == "length"
    assert got.usage is not None and got.usage.prompt_tokens == len(chat_ids(reference))

    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0,
                                                 stream=True, extra_body=NO_EOS))
    first, *rest = chunks
    assert (first.choices[0].delta.role, first.choices[0].delta.content) == ("assistant", "")
    assert "".join(c.choices[0].delta.content or "" for c in rest) == want.text
    assert rest[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None and len(c.choices) == 1 for c in chunks)  # no include_usage: no usage chunk


def test_max_completion_tokens_wins_and_default_fits_context(client: openai.OpenAI, served: Served) -> None:
    got = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, max_completion_tokens=3,
                                         temperature=0, extra_body=NO_EOS)
    assert got.usage is not None and got.usage.completion_tokens == 3
    got = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, extra_body=NO_EOS)
    assert got.usage is not None and got.usage.completion_tokens == served.cfg.default_max_tokens == 8
    # No limit given and 3 tokens of context left: the default shrinks to fit instead of failing.
    got = client.completions.create(model="tiny", prompt=[7] * (MAX_MODEL_LEN - 3), temperature=0, extra_body=NO_EOS)
    assert got.usage is not None and got.usage.completion_tokens == 3 and got.choices[0].finish_reason == "length"


def test_completion_logprobs(client: openai.OpenAI, reference: Engine) -> None:
    want = expect_logprobs(reference, PROMPT, max_tokens=5, temperature=0, logprobs=3)
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                    extra_body=NO_EOS)
    lp = got.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert lp.token_logprobs == pytest.approx(want, abs=1e-5) and len(want) == 5
    assert [len(top) for top in lp.top_logprobs] == [3] * 5
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == max(top.values()) == value  # greedy picks the most likely token
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]


def test_chat_logprobs_stream_equals_nonstream(client: openai.OpenAI, reference: Engine) -> None:
    want = expect_logprobs(reference, chat_ids(reference), max_tokens=4, temperature=0, logprobs=2)
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                  extra_body=NO_EOS)
    got = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    content = got.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(want, abs=1e-5) and len(want) == 4
    for c in content:
        assert [t.token for t in c.top_logprobs][0] == c.token and len(c.top_logprobs) == 2
        assert c.bytes is not None and c.top_logprobs[0].logprob == c.logprob
    streamed = [t for ch in client.chat.completions.create(stream=True, **kwargs)  # type: ignore[call-overload]
                if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [(t.token, t.logprob, t.bytes) for t in streamed] == [(t.token, t.logprob, t.bytes) for t in content]
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, temperature=0,
                                           logprobs=True, extra_body=NO_EOS)
    assert [c.top_logprobs for c in plain.choices[0].logprobs.content] == [[], []]


def test_stop_string_cuts_text(client: openai.OpenAI, reference: Engine) -> None:
    full = expect(reference, PROMPT, max_tokens=12, temperature=0).text
    stop = full[6:9]
    assert stop.strip() and full.find(stop) > 0
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop, "zzzz"],
                                    extra_body=NO_EOS)
    assert got.choices[0].text == full[: full.find(stop)] and got.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=stop,
                                              stream=True, extra_body=NO_EOS))
    assert "".join(c.choices[0].text for c in streamed) == full[: full.find(stop)]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_seed_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=seed,
                                        extra_body=NO_EOS)
        return got.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def test_prefix_cache_is_per_tenant(client: openai.OpenAI, served: Served) -> None:
    prompt = [11 + (i * 7) % 400 for i in range(50)]  # used by no other test: starts cold
    usage = [client.completions.create(model="tiny", prompt=prompt, max_tokens=1).usage for _ in range(2)]
    assert [u.prompt_tokens_details.cached_tokens for u in usage] == [0, 48]  # type: ignore[union-attr]
    with openai.OpenAI(base_url=f"{served.base_url}/v1", api_key="key-b", max_retries=0) as other:
        u = other.completions.create(model="tiny", prompt=prompt, max_tokens=1).usage
    assert u is not None and u.prompt_tokens_details.cached_tokens == 0  # same prompt, other tenant's salt


def test_models_and_alias(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["tiny", "tiny-alias"]
    got = client.completions.create(model="tiny-alias", prompt=PROMPT, max_tokens=1)
    assert got.model == "tiny-alias"


def test_text_parts_and_developer_role(client: openai.OpenAI, reference: Engine) -> None:
    # Text parts are joined by newlines; "developer" is rendered as the template's "system".
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is\nthe ferry?"}]
    want = expect(reference, reference.encode_chat(plain), max_tokens=3, temperature=0)
    got = client.chat.completions.create(
        model="tiny", max_tokens=3, temperature=0, extra_body=NO_EOS,
        messages=[{"role": "developer", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "text", "text": "Where is"},
                                               {"type": "text", "text": "the ferry?"}]}])
    assert got.choices[0].message.content == want.text
    assert got.usage is not None and got.usage.prompt_tokens == len(reference.encode_chat(plain))
