"""The web page at `/`: three static files from the package (rewind/web), no build step.

The page holds no secret: the API key, when the server wants one, is typed into the page and
kept in the browser's sessionStorage, and every API call sends it. Its responses carry a
Content-Security-Policy that runs only this origin's script files (no inline script, no other
origin), so text a model or a user writes cannot become code on the page.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from rewind.server.errors import ApiError

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # A new wheel's page is picked up at once; the files are a few KiB.
    "Cache-Control": "no-cache",
}
ASSETS = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
          "app.css": "text/css; charset=utf-8"}

router = APIRouter(include_in_schema=False)


def _asset(name: str) -> bytes:
    return resources.files("rewind").joinpath("web", name).read_bytes()


def _page_response(name: str) -> Response:
    return Response(_asset(name), media_type=ASSETS[name], headers=PAGE_HEADERS)


@router.get("/")
async def page() -> Response:
    return _page_response("index.html")


@router.get("/ui/settings.json")
async def settings(request: Request) -> JSONResponse:
    """Whether the page must ask for a key before its first API call (a 401 tells as much)."""
    config = request.app.state.config
    required = bool(config.api_key or config.api_key_file or config.admin_key)
    return JSONResponse({"auth_required": required}, headers=PAGE_HEADERS)


@router.get("/ui/{name}")
async def asset(name: str) -> Response:
    if name not in ASSETS:
        raise ApiError(404, "not_found", f"no page file {name!r}")
    return _page_response(name)
