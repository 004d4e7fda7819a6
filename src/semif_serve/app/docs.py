"""The published API's routes: `/openapi.json` (generated once, with the bodies the routes parse
themselves), the Swagger UI page at `/docs` and its bundled assets, all with the playground's headers."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Sequence
from html.parser import HTMLParser
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel
from starlette.staticfiles import StaticFiles

from semif_serve.playground import security_headers

OPENAPI_PATH = "/openapi.json"
DOCS_PATH = "/docs"
DOCS_ASSETS = "/docs/assets"
DOCS_IMAGES = "'self' data:"  # swagger-ui.css draws its icons from data: URIs


def _swagger_assets() -> str:
    """The directory of the installed Swagger UI bundle (served locally: no CDN)."""
    from pathlib import Path

    import swagger_ui

    return str(Path(swagger_ui.__file__).parent / "static")


class _InlineScripts(HTMLParser):
    """Collects the text of every <script> without a `src` in a page."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[str] = []
        self._open: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "script" and "src" not in dict(attrs):
            self._open = []

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            self._open.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "script" and self._open is not None:
            self.scripts.append("".join(self._open))
            self._open = None


def script_hashes(html: str) -> str:
    """The CSP sources (`'sha256-...'`) that allow exactly the inline scripts of `html`."""
    parser = _InlineScripts()
    parser.feed(html)
    digests = (base64.b64encode(hashlib.sha256(s.encode()).digest()).decode() for s in parser.scripts)
    return " ".join(f"'sha256-{digest}'" for digest in digests)


def docs_page() -> HTMLResponse:
    """`GET /docs`: FastAPI's Swagger UI page over the bundled assets, with the playground's headers;
    its one inline script (the SwaggerUIBundle call) is allowed by its hash, nothing else inline."""
    page = get_swagger_ui_html(
        openapi_url=OPENAPI_PATH,
        title="semif-serve API",
        swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
        swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
        swagger_favicon_url=f"{DOCS_ASSETS}/favicon-32x32.png",
    )
    html = bytes(page.body).decode()
    scripts = f"'self' {script_hashes(html)}"
    return HTMLResponse(html, headers=security_headers(script_src=scripts, img_src=DOCS_IMAGES))


class DocsAssets(StaticFiles):
    """Swagger UI's bundled files, each with the docs page's headers."""

    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers.update(security_headers(img_src=DOCS_IMAGES))
        return response


def publish_schema(api: FastAPI, models: Sequence[type[BaseModel]]) -> None:
    """Generate `/openapi.json` once, with the request bodies the routes parse themselves."""

    def openapi() -> dict[str, Any]:
        if api.openapi_schema is None:
            schema = get_openapi(
                title=api.title, version=api.version, description=api.description, routes=api.routes
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                model_schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(model_schema.pop("$defs", {}))
                components[model.__name__] = model_schema
            api.openapi_schema = schema
        return api.openapi_schema

    api.openapi = openapi  # type: ignore[method-assign]


def add_docs(api: FastAPI, models: Sequence[type[BaseModel]]) -> None:
    """Publish `/openapi.json` (with `models`, the request bodies the routes parse themselves),
    `/docs` and its assets on `api`."""
    publish_schema(api, models)

    @api.get(OPENAPI_PATH, include_in_schema=False)
    async def openapi_json() -> JSONResponse:
        return JSONResponse(api.openapi(), headers=security_headers())

    page = docs_page()

    @api.get(DOCS_PATH, include_in_schema=False)
    async def docs() -> HTMLResponse:
        return page

    api.mount(DOCS_ASSETS, DocsAssets(directory=_swagger_assets()), name="docs-assets")
