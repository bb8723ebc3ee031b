"""The memory budget at the HTTP door: a request waits here for room for its prompt's cache, or
is answered 429, 503 or 400, before the engine sees it. The accounting itself (what is
committed, tickets, loads, the RAM tier) is rewind.engine.memory_budget; the scheduler grows each
sequence's ticket before the step that makes its next token and ends it with finish_reason
"length" when the budget is crossed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from rewind.engine.memory_budget import GUARD_ACTIONS, MemoryBudget, NeverFits, Ticket, gib
from rewind.models.memory_estimate import KvShape
from rewind.server.errors import ApiError

__all__ = ["GUARD_ACTIONS", "MemoryBudget", "Ticket", "admit", "default_budget_bytes", "gib",
           "parse_budget"]

WAIT_POLL_SECONDS = 0.05
RETRY_AFTER_SECONDS = 2


async def admit(budget: MemoryBudget, kv: KvShape, tokens: int, model: str,
                client_gone: Callable[[], Awaitable[Any]] | None = None) -> Ticket:
    """A ticket for a new sequence of `tokens`, once its cache fits; waits while the running
    ones hold the room (at most budget.max_wait_seconds, then 503; given up at once when what
    `client_gone()` returns completes: the client hung up); 429 past budget.max_waiting; 400 for
    a prompt that cannot fit."""
    try:
        ticket = budget.reserve(kv, tokens, model)
    except NeverFits as exc:
        raise ApiError(400, "invalid_request", str(exc), param="messages",
                       code="insufficient_memory") from exc
    if ticket is not None:
        return ticket
    if budget.waiting >= budget.max_waiting:
        budget.actions["reject_429"] += 1
        raise ApiError(429, "rate_limit",
                       f"the memory budget ({gib(budget.total)}) is in use by running "
                       f"sequences and {budget.waiting} requests wait for room; retry later",
                       code="memory_budget_full",
                       headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    budget.actions["wait"] += 1
    loop = asyncio.get_running_loop()
    deadline = loop.time() + budget.max_wait_seconds
    gone = asyncio.ensure_future(client_gone()) if client_gone is not None else None
    with budget.waiting_for_room():
        try:
            while True:
                try:
                    ticket = budget.reserve(kv, tokens, model)
                except NeverFits as exc:  # a model loaded meanwhile took the room for good
                    raise ApiError(400, "invalid_request", str(exc), param="messages",
                                   code="insufficient_memory") from exc
                if ticket is not None:
                    return ticket
                if gone is not None and gone.done():
                    budget.actions["wait_abandoned"] += 1
                    # Nobody reads this answer; 499 (the client closed) only shows in logs.
                    raise ApiError(499, "invalid_request", "the client disconnected while "
                                   "waiting for room in the memory budget")
                if loop.time() >= deadline:
                    budget.actions["wait_timeout"] += 1
                    raise ApiError(503, "overloaded",
                                   f"no room in the memory budget ({gib(budget.total)}) for "
                                   f"{budget.max_wait_seconds:g} s: running sequences hold "
                                   "it; retry later", code="memory_budget_full",
                                   headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
                await asyncio.sleep(WAIT_POLL_SECONDS)
        finally:
            if gone is not None:
                gone.cancel()


def default_budget_bytes(fraction: float = 0.8) -> int:
    """80% of what the backend can use: RAM on the CPU, the recommended working set on Metal,
    device memory on CUDA."""
    import mlx.core as mx

    info: dict[str, Any] = {}
    try:
        info = dict(mx.device_info())
    except Exception:  # noqa: BLE001 - older MLX: fall back to RAM
        info = {}
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if mx.default_device() != mx.cpu and isinstance(info.get(key), int):
            return int(info[key] * fraction)
    import psutil

    return int(psutil.virtual_memory().total * fraction)


def parse_budget(text: str | None) -> int:
    """'80%' (of the backend's memory), '12GiB', '500MB' -> bytes; None -> 80%."""
    from rewind.config import parse_size

    if text is None:
        return default_budget_bytes()
    text = text.strip()
    if text.endswith("%"):
        fraction = float(text[:-1]) / 100
        if not 0 < fraction <= 1:
            raise ValueError(f"--memory-budget {text}: a percentage from 1% to 100%")
        return default_budget_bytes(fraction)
    return parse_size(text)
