"""POST /v1/models/pull: `rewind pull` through the server, its progress as server-sent events.

The download is the one `rewind pull` runs (rewind.models.hf_cache.pull, huggingface_hub into
the hub cache), on a worker thread so the event loop keeps serving. The stream is a series of
`event: NAME` / `data: JSON` pairs, each JSON carrying `type` = NAME too (for readers that
only look at data lines):
- `progress`: {"model", "files": [{"name", "done", "total"}], "done", "total"} in bytes, at
  most every PROGRESS_SECONDS, and once more when every file is in;
- then exactly one of `done`: {"model", "path", "form", "size_bytes", "context_length"} (the
  model is in /v1/models from then on) or `error`: {"error": {"message", "type"}}.
A body that cannot start a pull (no ORG/NAME, a key that may not pull) gets a plain error
answer instead, before any stream. A client that goes away cancels the download at its next
chunk; what was fetched stays in the cache as an .incomplete file and a later pull resumes it.

Who may pull: pulling writes to the server's disk, so with --api-key-file only the --admin-key
may; with a single --api-key, that key may (it is the server's one user); without keys, anyone
who can reach the loopback port.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from rewind.models.hf_cache import PullError, check_repo_id, pull
from rewind.models.pull_progress import PullProgress
from rewind.server.auth import request_operator
from rewind.server.body import parse_body
from rewind.server.errors import ApiError, bad_request
from rewind.server.openapi import json_body
from rewind.server.schemas import PullRequest
from rewind.server.streaming import KEEPALIVE_SECONDS, SSE_HEADERS

log = logging.getLogger(__name__)
router = APIRouter()

# Often enough for a progress bar to move smoothly, rarely enough that a many-file repo does
# not become thousands of events.
PROGRESS_SECONDS = 0.25

_STREAM_DOC = {
    "200": {"description": "server-sent events: `progress` (bytes per file and overall), then "
                           "`done` (the model is servable) or `error`",
            "content": {"text/event-stream": {"schema": {"type": "string"}}}},
    "400": {"description": "the body names no ORG/NAME repo, or this server serves one "
                           "model only"},
    "403": {"description": "this key may not pull (with --api-key-file only the --admin-key "
                           "may)"},
}


def sse(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


@router.post("/v1/models/pull",
             openapi_extra={**json_body(PullRequest, served_model=False),
                            "responses": _STREAM_DOC})
async def pull_model(request: Request) -> StreamingResponse:
    """Download a model from the Hugging Face Hub (as `rewind pull` does), streaming progress;
    once done it is listed in /v1/models and served by name."""
    if not request_operator(request.scope):
        raise ApiError(403, "permission", "pulling a model writes to the server's disk: with "
                       "--api-key-file only the --admin-key may pull", code="pull_not_allowed")
    body = await parse_body(request, PullRequest, request.app.state.config)
    try:
        check_repo_id(body.model)
    except PullError as exc:
        raise bad_request(str(exc), param="model") from None
    pool = request.app.state.pool
    if pool.catalog.is_fixed:
        raise bad_request("this server serves the one model it was started with; run "
                          "`rewind serve` with --model to serve pulled models", param="model")
    return StreamingResponse(pull_events(pool, body.model, body.revision),
                             media_type="text/event-stream", headers=SSE_HEADERS)


async def pull_events(pool: Any, repo: str, revision: str | None) -> AsyncIterator[str]:
    loop = asyncio.get_running_loop()
    changed = asyncio.Event()

    def on_change() -> None:  # on a download thread
        try:
            loop.call_soon_threadsafe(changed.set)
        except RuntimeError:
            pass  # the loop is closed: the server is stopping, nobody reads the stream

    progress = PullProgress(on_change)
    task = asyncio.ensure_future(asyncio.to_thread(pull, repo, revision, False, progress))
    # A cancelled pull's PullCancelled is expected: retrieve it so asyncio does not log it.
    task.add_done_callback(lambda done: done.cancelled() or done.exception())
    try:
        last = 0.0
        while not task.done():
            waiter = asyncio.ensure_future(changed.wait())
            await asyncio.wait({task, waiter}, timeout=KEEPALIVE_SECONDS,
                               return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            if not changed.is_set():
                if not task.done():
                    yield ": keep-alive\n\n"
                continue
            wait = last + PROGRESS_SECONDS - time.monotonic()
            if wait > 0 and not task.done():
                await asyncio.wait({task}, timeout=wait)
            changed.clear()
            last = time.monotonic()
            yield sse("progress", {"model": repo, **progress.snapshot()})
        try:
            path = task.result()
        except PullError as exc:
            yield sse("error", {"model": repo, "error": {"message": str(exc),
                                                          "type": "invalid_request_error"}})
            return
        except Exception as exc:  # noqa: BLE001 - any failure ends the stream with its reason
            log.exception("pull of %s failed", repo)
            yield sse("error", {"model": repo, "error": {"message": f"the pull of {repo!r} "
                                                          f"failed: {exc}",
                                                          "type": "server_error"}})
            return
        yield sse("progress", {"model": repo, **progress.snapshot()})
        # On the loop, not the download thread: requests read the catalog here.
        pool.catalog.refresh()
        entry = pool.catalog.lookup(repo)
        yield sse("done", {"model": entry.name, "path": str(path), "form": entry.form,
                           "size_bytes": entry.size_bytes,
                           "context_length": entry.context_length})
    finally:
        if not task.done():
            progress.cancel()  # the client went away: stop at the next chunk
            log.info("pull of %s cancelled: the client went away", repo)

