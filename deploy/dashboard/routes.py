"""`mount_dashboard(app, provider)`: the dashboard's two routes on the ingress's FastAPI app.

Mental model: `GET /dashboard` is a constant HTML page (page.py); `GET /dashboard/data` asks the
provider for the figures and returns them as JSON. Both sit outside `/v1/`, so the API gate lets
them through without a tenant key; a deployment that exposes the ingress beyond loopback passes
`access_key`, and then both routes want it as `?key=...` (the page forwards its own query string
to the data route) or as `Authorization: Bearer ...`. The content security policy allows nothing
but this origin, so the page cannot pull anything from a CDN even by accident.
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from deploy.dashboard.model import DashboardProvider
from deploy.dashboard.page import PAGE_HTML
from deploy.openai.errors import ApiError

_HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
}


def mount_dashboard(app: FastAPI, provider: DashboardProvider, *, path: str = "/dashboard",
                    access_key: str | None = None) -> None:
    if not path.startswith("/") or path.endswith("/"):
        raise ValueError(f"dashboard path must start with '/' and not end with one, got {path!r}")
    if access_key is not None and not access_key.strip():
        raise ValueError("access_key must be non-empty (or None for an open dashboard)")

    def refused(request: Request) -> Response | None:
        """The 401 to answer, or None when the caller may look. Answered here rather than raised:
        the routes work on any FastAPI app, not only on one with the OpenAI error handlers."""
        if access_key is None:
            return None
        scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
        given = request.query_params.get("key") or (bearer.strip() if scheme.lower() == "bearer" else "")
        if hmac.compare_digest(given.encode(), access_key.encode()):
            return None
        return ApiError(401, f"The dashboard needs its access key: open it as {path}?key=<key>.",
                        type="authentication_error", code="invalid_api_key").response()

    @app.get(path, response_class=HTMLResponse, include_in_schema=False)
    async def dashboard_page(request: Request) -> Response:
        return refused(request) or HTMLResponse(PAGE_HTML, headers=_HEADERS)

    @app.get(path + "/data", include_in_schema=False)
    async def dashboard_data(request: Request) -> Response:
        if (denied := refused(request)) is not None:
            return denied
        data = await provider.dashboard_data()
        return JSONResponse(data.to_json(), headers=_HEADERS)
