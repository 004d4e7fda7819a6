"""`GET /playground`: a page that sends System One requests to this service with the token the user
types, and shows each answer's distribution, its orderings' readings and how the batch ran.

Open like `/docs`: the page holds no secret. Its files are this package's data, served from a fixed
list (nothing else under the directory is reachable), each with a Content-Security-Policy that
allows only this origin: the page works offline and can talk to nothing else.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, Response

PLAYGROUND_PATH = "/playground"
ASSETS = Path(__file__).parent
# The page's own files (name -> media type); any other name is a 404.
FILES = {
    "playground.js": "text/javascript; charset=utf-8",
    "snippets.js": "text/javascript; charset=utf-8",
    "playground.css": "text/css; charset=utf-8",
    "templates.json": "application/json",
    "favicon.svg": "image/svg+xml",
}
# This origin only, nothing inline, never framed; a page may widen a directive (security_headers).
SELF_ONLY = {
    "default-src": "'none'",
    "script-src": "'self'",
    "style-src": "'self'",
    "connect-src": "'self'",
    "img-src": "'self'",
    "base-uri": "'none'",
    "form-action": "'none'",
    "frame-ancestors": "'none'",
}


def security_headers(**widened: str) -> dict[str, str]:
    """The headers of every page and file the service shows a browser: a Content-Security-Policy of
    SELF_ONLY with the `widened` directives (`img_src="'self' data:"`), nosniff, no referrer."""
    directives = {**SELF_ONLY, **{name.replace("_", "-"): value for name, value in widened.items()}}
    return {
        "Content-Security-Policy": "; ".join(f"{name} {value}" for name, value in directives.items()),
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-cache",
    }


HEADERS = security_headers()


def _file(name: str, media_type: str) -> Response:
    return FileResponse(ASSETS / name, media_type=media_type, headers=HEADERS)


def _serve(name: str, media_type: str) -> Callable[[], Awaitable[Response]]:
    async def endpoint() -> Response:
        return _file(name, media_type)

    return endpoint


def playground_router() -> APIRouter:
    """The page at `/playground` and its files at `/playground/<name>`."""
    router = APIRouter(include_in_schema=False)

    @router.get(PLAYGROUND_PATH)
    async def page() -> Response:
        return _file("index.html", "text/html; charset=utf-8")

    for name, media_type in FILES.items():
        router.add_api_route(f"{PLAYGROUND_PATH}/{name}", _serve(name, media_type), methods=["GET"])
    return router
