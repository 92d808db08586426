"""`build_api(backend, cfg)`: the OpenAI-compatible FastAPI app, testable without Ray.

Mental model: a request passes three layers. The `Gate` (ASGI) names it, checks the key and the
body size, and resolves its `RequestPolicy` (policy.py) from its tenant and headers; FastAPI parses the body into the pydantic model of its endpoint (the same models
generate `/openapi.json`, so the docs are what the server accepts); the handler prepares the prompt
and sampling parameters (`prepare.py`), asks the backend for a stream of outputs, and renders them
as one JSON answer or as server-sent events (`stream.py`, `render.py`). Errors at any layer leave as
OpenAI-style JSON (`errors.py`). Outside the Gate, `DrainGate` (drain.py) counts the requests in
flight and, once `app.state.drain.drain()` is called before a stop, refuses new ones with 503 while
those finish. The Ray Serve ingress mounts this app and supplies a backend wired to the cluster;
tests supply `EngineBackend` over a tiny model.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Security
from fastapi.responses import JSONResponse, Response
from fastapi.openapi.utils import get_openapi
from fastapi.security import HTTPBearer
from pydantic import BaseModel

from actors.messages import RequestPolicy
from deploy.openai import expert_budget
from deploy.openai.backend import Backend
from deploy.openai.config import ApiConfig
from deploy.openai.drain import DrainGate, DrainState
from actors.errors import Refused
from deploy.openai.errors import ApiError, ErrorResponse, install_error_handlers, to_api_error
from deploy.openai.gate import Gate
from deploy.openai.hooks import AppHooks
from deploy.openai.policy import PolicyBook
from deploy.openai.logprobs import TokenStrings
from deploy.openai.prepare import Prepared, prepare_chat, prepare_completion
from deploy.openai.protocol import ChatCompletionRequest, CompletionRequest
from deploy.openai.render import ChatRenderer, CompletionRenderer, Renderer
from deploy.openai.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from deploy.openai.stream import ClientGone, EventStream, first_output, run_to_end, sse_body
from deploy.semantic import SemanticGlue, semantic_text

logger = logging.getLogger(__name__)

_ERRORS_DOC: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Malformed JSON, wrong types, unknown fields, bad values, "
                                                 "or a prompt over the context (`context_length_exceeded`)."},
    401: {"model": ErrorResponse, "description": "Missing or unknown API key."},
    404: {"model": ErrorResponse, "description": "Unknown model (`model_not_found`)."},
    413: {"model": ErrorResponse, "description": "Request body over the configured size limit."},
    429: {"model": ErrorResponse, "description": "Refused for now; see the Retry-After header."},
    500: {"model": ErrorResponse, "description": "Internal error; the message names the request id."},
}


def _streaming_doc(chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    sse = {"schema": {"$ref": f"#/components/schemas/{chunk.__name__}"}}
    text = (f"The answer as JSON; with `stream: true`, server-sent events instead: `data: <{chunk.__name__}>` "
            "per chunk, then `data: [DONE]`.")
    return {**_ERRORS_DOC, 200: {"description": text, "content": {"text/event-stream": sse}}}


def _install_openapi(app: FastAPI) -> None:
    """FastAPI documents a 422 on every endpoint with a body, but this app answers bad bodies with
    400 (errors.py): drop it. Add the streamed chunk models the SSE responses refer to."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            for operations in schema["paths"].values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            components = schema["components"]["schemas"]
            for unused in ("HTTPValidationError", "ValidationError"):
                components.pop(unused, None)
            for model in (ChatCompletionChunk, CompletionResponse):
                js = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
                for name, sub in js.pop("$defs", {}).items():
                    components.setdefault(name, sub)
                components.setdefault(model.__name__, js)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _name(request: Request, prefix: str) -> str:
    request.state.request_id = f"{prefix}-{request.state.request_hex}"  # also the x-request-id header
    return request.state.request_id


def _close_at_shutdown(app: FastAPI, close: Callable[[], Awaitable[None]]) -> None:
    """Runs `close()` when the app's lifespan ends (uvicorn with lifespan on, Serve's replicas)."""
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        async with inner(a) as state:
            yield state
        await close()

    app.router.lifespan_context = lifespan


def build_api(backend: Backend, cfg: ApiConfig, *, semantic: SemanticGlue | None = None,
              policies: PolicyBook | None = None) -> FastAPI:
    """`policies`: each tenant's rules for its requests' `RequestPolicy` (None: the defaults)."""
    served = list(cfg.served_model_names) or [backend.model_name]
    strings = TokenStrings(backend.tokenizer)
    started_at = int(time.time())
    app = FastAPI(title="ferry", version="1.0",
                  summary="OpenAI-compatible completions and chat completions over ferry's serving cluster.")
    install_error_handlers(app)
    _install_openapi(app)
    app.add_middleware(Gate, cfg=cfg, policies=policies)
    app.state.drain = DrainState()  # `await app.state.drain.drain(timeout_s)` before a stop
    app.state.hooks = hooks = AppHooks()  # request observers and /health parts (deploy/openai/hooks.py)
    app.add_middleware(DrainGate, state=app.state.drain)
    # Documents the bearer scheme in /openapi.json; the Gate has already checked the key.
    secured = [Security(HTTPBearer(auto_error=False, description="API key; it selects the tenant."))]
    if semantic is None and cfg.semantic_cache is not None:
        semantic = SemanticGlue.from_settings(cfg.semantic_cache)  # loads the embedding model once
    app.state.semantic = semantic
    if semantic is not None:
        _close_at_shutdown(app, semantic.close)  # a clean stop saves the cache

    async def serve(request: Request, prep: Prepared, renderer: Renderer, text: str | None = None) -> Response:
        policy: RequestPolicy = request.state.policy
        # The caller's x-ferry-expert-budget against the model's experts (when the backend knows them).
        unfit = expert_budget.over_model(policy.expert_budget, getattr(backend, "num_experts", None))
        if unfit is not None:
            raise ApiError(400, unfit, param=expert_budget.HEADER, code="invalid_header")
        # Semantic cache (deploy/semantic.py), before admission: a hit replaces the backend's stream
        # and the engine never sees the request; a miss is recorded and inserted when it finishes.
        consulted = None
        if semantic is not None:
            consulted = await semantic.consult(
                request, endpoint="chat" if isinstance(renderer, ChatRenderer) else "completion", model=prep.model,
                text=text, params=prep.params, num_prompt_tokens=len(prep.prompt_token_ids))
        if consulted is not None and consulted.stream is not None:
            stream = consulted.stream
        else:
            stream = hooks.observed(backend.generate(renderer.request_id, prep.prompt_token_ids, prep.params,
                                                     policy=policy), renderer.request_id, getattr(backend, "timeline", None))
            if consulted is not None and semantic is not None:
                stream = semantic.record(consulted, stream)
        try:
            if prep.stream:
                first = await first_output(request, stream)
                return SemanticGlue.mark(EventStream(sse_body(renderer, first, stream, include_usage=prep.include_usage,
                                                              prompt_param=prep.prompt_param)), consulted)
            final, logprobs = await run_to_end(request, stream)
        except ClientGone:
            logger.info("%s: client left before the answer; request aborted", renderer.request_id)
            return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
        except Exception as e:
            if isinstance(e, Refused):
                hooks.refused(policy.tenant, e)
            err = to_api_error(e, prompt_param=prep.prompt_param)
            if err is None:
                raise  # the Gate turns it into a 500 without details
            raise err from None
        body = renderer.response(final, logprobs).model_dump_json()
        return SemanticGlue.mark(Response(content=body, media_type="application/json"), consulted)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_streaming_doc(CompletionResponse),
              dependencies=secured, tags=["openai"])
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        request_id = _name(request, "cmpl")
        prep = await asyncio.to_thread(prepare_completion, body, backend, served, cfg.default_max_tokens)
        renderer = CompletionRenderer(request_id, prep.model, strings, want_logprobs=body.logprobs is not None)
        return await serve(request, prep, renderer, semantic_text(body))

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses=_streaming_doc(ChatCompletionChunk), dependencies=secured, tags=["openai"])
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        request_id = _name(request, "chatcmpl")
        prep = await asyncio.to_thread(prepare_chat, body, backend, served, cfg.default_max_tokens)
        renderer = ChatRenderer(request_id, prep.model, strings, want_logprobs=bool(body.logprobs))
        return await serve(request, prep, renderer, semantic_text(body))

    @app.get("/v1/models", response_model=ModelList, dependencies=secured, tags=["openai"])
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, created=started_at, max_model_len=backend.max_model_len)
                               for name in served])

    @app.get("/v1/requests/{request_id}/timeline", response_model=dict[str, Any], dependencies=secured,
             responses={404: {"model": ErrorResponse, "description": "Unknown (or someone else's) request."}},
             tags=["ferry"])
    async def request_timeline(request_id: str, request: Request) -> dict[str, Any]:
        timeline = getattr(backend, "timeline", None)
        found = timeline(request_id) if timeline is not None else None
        # Another tenant's request is reported exactly like one that never existed.
        if found is None or found.get("tenant") != request.state.tenant:
            raise ApiError(404, f"No timeline for request '{request_id}'.", param="request_id",
                           code="request_not_found")
        return found

    async def _full_health() -> dict[str, Any]:
        return await hooks.health(await backend.health())

    @app.get("/health", tags=["ferry"], responses={503: {"description": "The backend is unhealthy."}})
    async def health() -> JSONResponse:
        try:
            report = await asyncio.wait_for(_full_health(), timeout=cfg.health_timeout_s)
        except Exception as e:  # a health check that fails is an unhealthy backend, not a 500
            logger.warning("health check failed: %r", e)
            return JSONResponse({"healthy": False, "error": type(e).__name__}, status_code=503)
        return JSONResponse(report, status_code=200 if report.get("healthy") else 503)

    return app
