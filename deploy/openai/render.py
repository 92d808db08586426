"""Engine outputs -> OpenAI response objects, one renderer per endpoint.

Mental model: a renderer is made per request and knows its id, model name and creation time; it
turns the whole run into one response (`response`) or each emitted step into a chunk (`opening`,
`chunk`, `usage_chunk`). Streams keep one renderer, so every chunk shares `id` and `created`, and
completion `text_offset`s keep counting across chunks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from pydantic import BaseModel

from actors.engine.output import RequestOutput
from actors.engine.sampling import TokenLogprobs
from deploy.openai.logprobs import TokenStrings, chat_logprobs, completion_logprobs
from deploy.openai.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionResponse,
    PromptTokensDetails,
    Usage,
)


def usage_of(out: RequestOutput) -> Usage:
    completion = len(out.token_ids)
    return Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=completion,
                 total_tokens=out.num_prompt_tokens + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=out.num_cached_tokens))


class Renderer:
    def __init__(self, request_id: str, model: str, strings: TokenStrings, want_logprobs: bool) -> None:
        self.request_id = request_id
        self.model = model
        self.strings = strings
        self.want_logprobs = want_logprobs
        self.created = int(time.time())

    def opening(self) -> list[BaseModel]:
        return []

    def chunk(self, out: RequestOutput, logprobs: Sequence[TokenLogprobs | None]) -> BaseModel:
        raise NotImplementedError

    def usage_chunk(self, usage: Usage) -> BaseModel:
        raise NotImplementedError

    def response(self, final: RequestOutput, logprobs: Sequence[TokenLogprobs | None]) -> BaseModel:
        raise NotImplementedError


class CompletionRenderer(Renderer):
    def __init__(self, request_id: str, model: str, strings: TokenStrings, want_logprobs: bool) -> None:
        super().__init__(request_id, model, strings, want_logprobs)
        self._offset = 0  # text_offset of the next token, across chunks

    def _choice(self, text: str, logprobs: Sequence[TokenLogprobs | None],
                finish_reason: str | None) -> CompletionChoice:
        lp = None
        if self.want_logprobs:
            lp, self._offset = completion_logprobs(self.strings, logprobs, self._offset)
        return CompletionChoice(index=0, text=text, logprobs=lp, finish_reason=finish_reason)

    def _wrap(self, choices: list[CompletionChoice], usage: Usage | None) -> CompletionResponse:
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                  usage=usage)

    def chunk(self, out: RequestOutput, logprobs: Sequence[TokenLogprobs | None]) -> BaseModel:
        return self._wrap([self._choice(out.new_text, logprobs, out.finish_reason)], None)

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._wrap([], usage)

    def response(self, final: RequestOutput, logprobs: Sequence[TokenLogprobs | None]) -> BaseModel:
        return self._wrap([self._choice(final.text, logprobs, final.finish_reason)], usage_of(final))


class ChatRenderer(Renderer):
    def _logprobs(self, logprobs: Sequence[TokenLogprobs | None]) -> ChatLogprobs | None:
        if not self.want_logprobs:
            return None
        return ChatLogprobs(content=chat_logprobs(self.strings, logprobs))

    def _wrap(self, choices: list[ChatChunkChoice], usage: Usage | None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                   usage=usage)

    def opening(self) -> list[BaseModel]:
        # OpenAI's first chunk names the role and carries no text yet.
        delta = ChatDelta(role="assistant", content="")
        return [self._wrap([ChatChunkChoice(index=0, delta=delta, logprobs=None, finish_reason=None)], None)]

    def chunk(self, out: RequestOutput, logprobs: Sequence[TokenLogprobs | None]) -> BaseModel:
        delta = ChatDelta(content=out.new_text or None)
        choice = ChatChunkChoice(index=0, delta=delta, logprobs=self._logprobs(logprobs),
                                 finish_reason=out.finish_reason)
        return self._wrap([choice], None)

    def usage_chunk(self, usage: Usage) -> BaseModel:
        return self._wrap([], usage)

    def response(self, final: RequestOutput, logprobs: Sequence[TokenLogprobs | None]) -> BaseModel:
        choice = ChatChoice(index=0, message=AssistantMessage(content=final.text),
                            logprobs=self._logprobs(logprobs), finish_reason=final.finish_reason)
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model,
                                      choices=[choice], usage=usage_of(final))
