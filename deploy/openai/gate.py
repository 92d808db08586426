"""The ASGI gate in front of the FastAPI app: request id, API key -> tenant and policy, body size, last resort.

Mental model: some answers must come before FastAPI parses anything. A caller without a valid key
gets 401 before its body is read; a body over `max_body_bytes` gets 413 from its Content-Length
alone, or as soon as the bytes actually received pass the limit (a chunked upload declares no
length and can still be huge), and is never parsed. The accepted body is buffered (it is at most
the limit) and replayed to the app; later `receive()` calls go straight to the server, so the app
still sees the client's disconnect. Bodies are read as JSON whatever their Content-Type. Every
response gets `x-request-id`; an exception nobody handled becomes a 500 that names that id and
leaks nothing.

Scope state written here: `request_hex` (the id's random part; endpoints name their requests
`cmpl-<hex>` / `chatcmpl-<hex>` and store that in `request_id`), `request_id`, `tenant`, and
`policy`: the request's `RequestPolicy`, resolved here once from the tenant's rules and the
`x-ferry-*` headers (policy.py; an invalid header is a 400).
"""

from __future__ import annotations

import hmac
import logging
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deploy.openai.config import ApiConfig
from actors.messages import RequestPolicy
from deploy.openai.errors import ApiError, internal_error
from deploy.openai.policy import PolicyBook

logger = logging.getLogger(__name__)

_BODY_METHODS = {"POST", "PUT", "PATCH"}


class _ClientGone(Exception):
    """The client disconnected while its body was still arriving: nobody to answer."""


class Gate:
    def __init__(self, app: ASGIApp, cfg: ApiConfig, policies: PolicyBook | None = None) -> None:
        self.app = app
        self.cfg = cfg
        self.policies = policies or PolicyBook()
        # Bytes, so non-ASCII keys compare correctly with hmac.compare_digest.
        self._keys = [(key.encode(), tenant) for key, tenant in cfg.api_keys.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        hex_id = uuid.uuid4().hex
        state["request_hex"] = hex_id
        state["request_id"] = f"req-{hex_id}"
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                MutableHeaders(scope=message)["x-request-id"] = state["request_id"]
            await send(message)

        try:
            headers = Headers(scope=scope)
            is_api = route_path(scope).startswith("/v1/")  # docs and /health stay public
            state["tenant"] = tenant = self._tenant(headers) if is_api else self.cfg.default_tenant
            state["policy"] = self.policies.resolve(tenant, headers) if is_api else RequestPolicy(tenant=tenant)
            if scope["method"] in _BODY_METHODS:
                receive = await self._buffered(headers, receive)
                scope["headers"] = _as_json(scope["headers"])
            await self.app(scope, receive, send_with_id)
        except _ClientGone:
            return
        except ApiError as e:
            if not started:
                await e.response()(scope, receive, send_with_id)
        except Exception:
            logger.exception("unhandled error in %s %s (%s)", scope["method"], scope["path"], state["request_id"])
            if not started:
                await internal_error(state["request_id"]).response()(scope, receive, send_with_id)

    def _tenant(self, headers: Headers) -> str:
        scheme, _, key = headers.get("authorization", "").partition(" ")
        key = key.strip() if scheme.lower() == "bearer" else ""
        if key:
            given = key.encode()
            # Compare against every key in constant time per key: no early exit on a match.
            found = [tenant for k, tenant in self._keys if hmac.compare_digest(k, given)]
            if found:
                return found[0]
        if not self.cfg.auth_required:
            return self.cfg.default_tenant
        challenge = {"WWW-Authenticate": "Bearer"}
        if not key:
            raise ApiError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
                           type="authentication_error", code="missing_api_key", headers=challenge)
        shown = f"{key[:3]}...{key[-2:]}" if len(key) > 8 else "***"
        raise ApiError(401, f"Incorrect API key provided: {shown}.", type="authentication_error",
                       code="invalid_api_key", headers=challenge)

    async def _buffered(self, headers: Headers, receive: Receive) -> Receive:
        limit = self.cfg.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(f"{int(declared)} bytes", limit)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone()
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                raise _too_large(f"more than {limit} bytes", limit)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay


def route_path(scope: Scope) -> str:
    # Mounted under a prefix (a Serve route prefix, a Starlette Mount), `path` starts with it.
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _as_json(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Every body this API takes is JSON: parse it as JSON whatever Content-Type says (curl -d sends
    form-urlencoded), so a bad body is reported as bad JSON, not as a missing object."""
    return [(k, v) for k, v in raw if k.lower() != b"content-type"] + [(b"content-type", b"application/json")]


def _too_large(size: str, limit: int) -> ApiError:
    return ApiError(413, f"Request body is {size}; this server accepts at most {limit} bytes.",
                    code="request_too_large")
