"""Request body -> prompt token ids + `SamplingParams`: every rule between two fields lives here.

Mental model: after pydantic has checked shapes and types, one pure function per endpoint decides
whether the request can be served and with what: the model name must be served (404), `n` must be
1 and `echo` false, logprob options must be coherent, the prompt is rendered (chat template) and
tokenized, and the token budget is settled against the context:
- `max_completion_tokens` wins over `max_tokens` (chat); an explicit limit that does not fit after
  the prompt is a 400 `context_length_exceeded`, never silently cut;
- with no limit, the request gets `default_max_tokens` or what is left of the context, whichever is
  smaller; a prompt that leaves no room at all is the same 400.
Value ranges are the engine's own (`SamplingParams` validates on construction); its message names
the field, which becomes the error's `param`. Tokenizing is CPU work: the app runs these in a thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from actors.engine.errors import InvalidSamplingParams
from actors.engine.sampling import SamplingParams
from deploy.openai.backend import Backend
from deploy.openai.errors import ApiError, to_api_error
from deploy.openai.protocol import ChatCompletionRequest, CompletionRequest, GenerationFields


@dataclass(frozen=True)
class Prepared:
    prompt_token_ids: list[int]
    params: SamplingParams
    model: str
    stream: bool
    include_usage: bool
    prompt_param: str  # "prompt" or "messages": where errors about the prompt point


def _check_common(body: GenerationFields, served: list[str]) -> None:
    if body.model not in served:
        raise ApiError(404, f"The model '{body.model}' does not exist or you do not have access to it.",
                       param="model", code="model_not_found")
    if body.n not in (None, 1):
        raise ApiError(400, f"Invalid value for 'n': ferry returns one choice per request, got {body.n}.",
                       param="n", code="invalid_value")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true.", param="stream_options",
                       code="invalid_value")


@dataclass(frozen=True)
class _Shape:
    """What differs between the two endpoints when a body becomes an engine request."""

    prompt_param: str  # "prompt" or "messages"
    limit: int | None  # the token limit the client gave, if any
    limit_param: str  # the field it came from
    logprobs: int | None  # alternatives per token for the engine; None = no logprobs
    renames: dict[str, str]  # engine parameter name -> request field name, for error params


def _budget(num_prompt: int, shape: _Shape, max_model_len: int, default_max_tokens: int) -> int:
    room, limit = max_model_len - num_prompt, shape.limit
    if limit is None and room >= 1:
        return min(default_max_tokens, room)
    if limit is not None and (limit < 1 or num_prompt + limit <= max_model_len):
        return limit  # a limit < 1 is the engine's range error, reported on the field
    where = shape.prompt_param
    wanted = (f"{num_prompt + limit} tokens ({num_prompt} in the {where}, {limit} in the completion)"
              if limit is not None else f"{num_prompt} tokens in the {where} and at least 1 to generate")
    # Point at what must change: the prompt when it alone fills the context, else the limit.
    param = where if limit is None or room < 1 else shape.limit_param
    raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                        f"requested {wanted}. Please reduce the length of the {where} or completion.",
                   param=param, code="context_length_exceeded")


def _params(body: GenerationFields, max_tokens: int, shape: _Shape) -> SamplingParams:
    given: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty,
        "seed": body.seed,
        "stop": body.stop,
        "ignore_eos": body.ignore_eos,
        "logprobs": shape.logprobs,
        "min_tokens": body.min_tokens,
    }
    # null means "not set": the engine's defaults are OpenAI's (temperature 1, top_p 1, ...).
    kwargs = {k: v for k, v in given.items() if v is not None}
    try:
        return SamplingParams(**kwargs)
    except InvalidSamplingParams as e:
        err = to_api_error(e, prompt_param=shape.prompt_param, renames=shape.renames)
        assert err is not None
        raise err from None


def _prepared(body: GenerationFields, ids: list[int], shape: _Shape, backend: Backend,
              default_max_tokens: int) -> Prepared:
    if not ids:
        raise ApiError(400, f"The {shape.prompt_param} is empty.", param=shape.prompt_param, code="invalid_value")
    max_tokens = _budget(len(ids), shape, backend.max_model_len, default_max_tokens)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return Prepared(ids, _params(body, max_tokens, shape), body.model, bool(body.stream), include_usage,
                    shape.prompt_param)


def prepare_completion(body: CompletionRequest, backend: Backend, served: list[str],
                       default_max_tokens: int) -> Prepared:
    _check_common(body, served)
    if body.echo:
        raise ApiError(400, "Invalid value for 'echo': only false is supported.", param="echo", code="invalid_value")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, f"Invalid value for 'prompt': ferry serves one prompt per request, got {len(prompt)}.",
                           param="prompt", code="invalid_value")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = backend.tokenizer.encode(prompt) if prompt else []
    else:
        ids = list(prompt)  # type: ignore[arg-type]  # token ids; the engine checks the vocabulary
    shape = _Shape("prompt", body.max_tokens, "max_tokens", body.logprobs, {})
    return _prepared(body, ids, shape, backend, default_max_tokens)


def chat_prompt_ids(body: ChatCompletionRequest, backend: Backend) -> list[int]:
    if not body.messages:
        raise ApiError(400, "Invalid value for 'messages': at least one message is required.",
                       param="messages", code="invalid_value")
    messages: list[dict[str, Any]] = []
    for m in body.messages:
        text = m.content if isinstance(m.content, str) else "\n".join(p.text for p in m.content)
        # Chat templates know system/user/assistant; OpenAI's "developer" is the newer "system".
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": text}
        if m.name is not None:
            message["name"] = m.name
        messages.append(message)
    tokenizer = backend.tokenizer
    try:
        return tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    except Exception as e:
        err = to_api_error(e, prompt_param="messages")
        if err is None:
            raise
        raise err from None


def prepare_chat(body: ChatCompletionRequest, backend: Backend, served: list[str],
                 default_max_tokens: int) -> Prepared:
    _check_common(body, served)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs set to true.", param="top_logprobs", code="invalid_value")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    limit, limit_param = body.max_tokens, "max_tokens"
    if body.max_completion_tokens is not None:
        limit, limit_param = body.max_completion_tokens, "max_completion_tokens"
    shape = _Shape("messages", limit, limit_param, logprobs, {"logprobs": "top_logprobs", "max_tokens": limit_param})
    return _prepared(body, chat_prompt_ids(body, backend), shape, backend, default_max_tokens)
