"""Every failure the HTTP layer reports, as OpenAI-style JSON with the right status.

Mental model: whatever goes wrong ends as an `ApiError(status, message, type, param, code)`,
rendered as `{"error": {"message", "type", "param", "code"}}`. Three sources feed it: request
validation (pydantic errors from FastAPI: malformed JSON, wrong types, unknown fields -> 400),
the engine's named errors and backend refusals (`to_api_error`), and the gate (401, 413). Only
messages written for clients are ever sent: an unexpected exception becomes a bare 500 that names
the request id, and its traceback goes to the log.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from actors.errors import EngineDead, Refused
from actors.engine.errors import (
    ContextLengthExceeded,
    EmptyPrompt,
    InvalidRequest,
    InvalidSamplingParams,
    TokenOutOfVocab,
)
from actors.engine.tokenizer import ChatTemplateError, MissingChatTemplate

logger = logging.getLogger(__name__)

INVALID = "invalid_request_error"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = INVALID, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None,
                 extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.extra = extra or {}  # fields beyond OpenAI's four (a refusal's retry_after_s, predicted_wait_s)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code,
                          **self.extra}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def internal_error(request_id: str) -> ApiError:
    return ApiError(500, f"The server had an error processing your request (request id {request_id}).",
                    type="server_error", code="internal_error")


# ---- pydantic validation errors -----------------------------------------------------------------

# The union member a pydantic error went through ("str", "list[int]", "TextPart") is not a field.
_SCALARS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_union_tag(item: object) -> bool:
    return isinstance(item, str) and ("[" in item or item[:1].isupper() or item in _SCALARS)


def _field_path(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc[1:] if not _is_union_tag(p))


def from_validation_error(exc: RequestValidationError) -> ApiError:
    errors = list(exc.errors())
    if not errors:
        return ApiError(400, "Invalid request body.", code="invalid_body")
    first = errors[0]
    kind, loc = first.get("type", ""), tuple(first.get("loc", ()))
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return ApiError(400, f"We could not parse the JSON body of your request ({detail}). "
                             "Send a JSON object with Content-Type: application/json.", code="invalid_json")
    path = _field_path(loc)
    if not path:  # the body as a whole: missing, or not a JSON object
        return ApiError(400, "The request body must be a JSON object.", code="invalid_body")
    if kind == "extra_forbidden":
        return ApiError(400, f"Unrecognized request argument supplied: {path}", param=path,
                        code="unrecognized_argument")
    if kind == "missing":
        return ApiError(400, f"Missing required parameter: '{path}'.", param=path,
                        code="missing_required_parameter")
    # A value that fits no member of a union fails once per member: report the field once.
    same_field = [e for e in errors if _field_path(tuple(e.get("loc", ()))) == path]
    msg = first.get("msg", "invalid value")
    if len(same_field) > 1:
        msg = "; or ".join(dict.fromkeys(e.get("msg", "") for e in same_field))
    return ApiError(400, f"Invalid type for '{path}': {msg}.", param=path, code="invalid_type")


# ---- engine errors and refusals -----------------------------------------------------------------

def to_api_error(exc: BaseException, *, prompt_param: str, renames: dict[str, str] | None = None) -> ApiError | None:
    """The client-facing error for an exception from preparing or running a request; None when the
    exception is not one the client caused or should see (the caller turns that into a 500)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, Refused):
        return refusal_to_api_error(exc)
    if isinstance(exc, ContextLengthExceeded):
        return ApiError(400, str(exc), param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, InvalidSamplingParams):
        # The engine starts each message with the parameter's name ("temperature must be in ...").
        name = str(exc).split(" ", 1)[0]
        param = (renames or {}).get(name, name)
        return ApiError(400, f"Invalid value for '{param}': {exc}", param=param, code="invalid_value")
    if isinstance(exc, (EmptyPrompt, TokenOutOfVocab, MissingChatTemplate, ChatTemplateError)):
        return ApiError(400, str(exc), param=prompt_param, code="invalid_value")
    if isinstance(exc, InvalidRequest):
        return ApiError(400, str(exc), code="invalid_value")
    if isinstance(exc, EngineDead):
        return ApiError(503, "The model server is unavailable; it is being restarted.", type="server_error",
                        code="engine_unavailable")
    return None


def refusal_to_api_error(exc: Refused) -> ApiError:
    """The one mapping of a refusal to HTTP: its status; `Retry-After` (and `retry_after_s` in the
    body) when waiting can help; an SLO refusal's `predicted_wait_s`. 429 is a `rate_limit_error`,
    5xx a `server_error`, the rest `invalid_request_error`; `code` is the refusal's reason."""
    why = f": {exc.detail}" if exc.detail else ""
    headers: dict[str, str] = {}
    extra: dict[str, Any] = {}
    message = f"Request refused: {exc.reason}{why}."
    if exc.retry_after_s is not None:
        retry = max(0, math.ceil(exc.retry_after_s))
        headers["Retry-After"] = str(retry)
        extra["retry_after_s"] = round(exc.retry_after_s, 3)
        message += f" Retry after {retry} s."
    if exc.predicted_wait_s is not None:
        extra["predicted_wait_s"] = round(exc.predicted_wait_s, 3)
    kind = "rate_limit_error" if exc.status == 429 else "server_error" if exc.status >= 500 else "invalid_request_error"
    return ApiError(exc.status, message, type=kind, code=exc.reason, headers=headers, extra=extra)


# ---- FastAPI hooks ------------------------------------------------------------------------------

def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return exc.response()

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return from_validation_error(exc).response()

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        # Routing's own answers (unknown path 404, wrong method 405) in the same shape.
        assert isinstance(exc, StarletteHTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        err = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code,
                       headers=dict(exc.headers or {}))
        return err.response()

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
