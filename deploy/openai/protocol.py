"""Request bodies of `/v1/completions` and `/v1/chat/completions`, as the server really accepts them.

Mental model: one pydantic model per endpoint is the single source of truth for three things: what
a body may contain (unknown fields -> 400 naming the field, `extra="forbid"`), what types it may
have (`strict`: "0.7" is not a temperature, 1.5 is not a max_tokens), and what `/openapi.json`
documents (FastAPI renders these models). Every optional field also takes `null`, because clients
send explicit nulls for "not set". Rules that tie fields together (n, echo, top_logprobs without
logprobs, stream_options without stream) and value ranges live in `prepare.py`, which turns a body
into the engine's `SamplingParams` and answers 400 with the offending field.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool | None = Field(
        None, description="Send one more chunk before [DONE] with `usage` and empty `choices`.")


class GenerationFields(_Body):
    """Fields both endpoints share: the model, sampling, stopping and streaming."""

    model: str = Field(description="One of the names `GET /v1/models` lists.")
    max_tokens: int | None = Field(
        None, description="Most tokens to generate. Default: the server's default_max_tokens, "
                          "lowered to what fits the context after the prompt.")
    temperature: float | None = Field(None, description="0 = greedy; default 1.")
    top_p: float | None = Field(None, description="Nucleus sampling mass in (0, 1]; default 1.")
    top_k: int | None = Field(None, description="Sample from the k most likely tokens; 0 or null = off.")
    min_p: float | None = Field(None, description="Drop tokens below min_p x the top probability.")
    presence_penalty: float | None = Field(None, description="In [-2, 2], OpenAI semantics.")
    frequency_penalty: float | None = Field(None, description="In [-2, 2], OpenAI semantics.")
    repetition_penalty: float | None = Field(None, description="HF semantics over prompt + output; 1 = off.")
    seed: int | None = Field(None, description="Same seed, prompt and parameters -> same tokens.")
    stop: str | list[str] | None = Field(
        None, description="Up to 16 strings; the text ends before the first one generated.")
    stream: bool | None = Field(None, description="Answer with server-sent events, ending in `data: [DONE]`.")
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, description="Choices per request; only 1 is served.")
    user: str | None = Field(None, description="End-user id, for the caller's own tracking.")
    ignore_eos: bool | None = Field(None, description="Keep generating past end-of-sequence tokens.")
    min_tokens: int | None = Field(None, description="Generate at least this many tokens before stopping.")


class CompletionRequest(GenerationFields):
    """`POST /v1/completions`: continue a prompt."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="Text, a list of one text, token ids, or a list of one list of token ids.")
    logprobs: int | None = Field(
        None, description="Return the chosen token's logprob and this many alternatives (0-20).")
    echo: bool | None = Field(None, description="Only false: the prompt is never echoed.")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] = Field(description="Text, or a list of text parts (joined by newlines).")
    name: str | None = None


class ChatCompletionRequest(GenerationFields):
    """`POST /v1/chat/completions`: answer a conversation, rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(description="The conversation so far, oldest first.")
    max_completion_tokens: int | None = Field(
        None, description="Same as max_tokens; wins when both are given.")
    logprobs: bool | None = Field(None, description="Return the logprob of each generated token.")
    top_logprobs: int | None = Field(
        None, description="With logprobs: this many most likely alternatives per token (0-20).")
