"""Client conversations as the server sees them, grouped without the client's help, for the web
page's sessions view: per turn, the prompt tokens served from RAM, from disk and recomputed.

A session is named by the prefix chain the prompt cache keys on (rewind.cache.blocks): its
anchor is the key of the prompt up to the end of its first turn's user message. A later request
whose prompt starts with that same prefix is a next turn of it; an edited first message starts a
new session (a branch), an edited later message or a regenerated answer stays in it. Where an
agent names its session in a header (Claude Code's `x-claude-code-session-id`), that wins.

The chain's root folds in the tenant (API key) and the model, so two tenants sending the same
conversation get two sessions, each visible only to its own key (and to an admin key). State is
bounded: at most `max_sessions`, least recently seen dropped first, and `max_turns` per session.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rewind.cache.blocks import BlockChain, root_key
from rewind.config import BLOCK_TOKENS
from rewind.engine import Usage

# Headers by which agents name their own session, best first.
SESSION_HEADERS = ("x-claude-code-session-id", "x-rewind-session-id")
MAX_TURNS = 64  # per session: the page shows a timeline, not an archive


@dataclass(frozen=True)
class Turn:
    """One finished request of a session."""

    at: float  # unix time it finished
    model: str
    api: str
    outcome: str  # the engine's finish reason, or "cancelled"
    prompt_tokens: int
    completion_tokens: int
    ram_tokens: int  # prompt tokens restored from the RAM tier
    disk_tokens: int  # ... from the disk tier
    recomputed_tokens: int
    ttft_seconds: float
    total_seconds: float
    checkpoints: tuple[int, ...]  # prompt positions the cache snapshots (block and turn ends)


@dataclass
class Session:
    id: str
    tenant: str
    source: str  # "prefix" (the cache's chain) or "header" (named by the client)
    model: str
    anchor_tokens: int  # length of the prefix that names it (0 for a header session)
    started: float
    last_seen: float
    turns: deque[Turn] = field(default_factory=lambda: deque(maxlen=MAX_TURNS))
    turn_count: int = 0  # every turn, also those the bounded timeline dropped
    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("prompt_tokens", "completion_tokens", "ram_tokens", "disk_tokens",
         "recomputed_tokens"), 0))


@dataclass(frozen=True)
class TurnStart:
    """What begin() hands the request, for its finish()."""

    session_id: str
    model: str
    api: str
    checkpoints: tuple[int, ...]


def _header_session(headers: Mapping[str, str]) -> str | None:
    for name in SESSION_HEADERS:
        value = headers.get(name, "").strip()
        if value:
            return value[:200]
    return None


class SessionBook:
    """The server's record of client sessions. Called on the event loop; a lock keeps it safe
    from the thread a test or a metrics scrape may read it on."""

    def __init__(self, max_sessions: int = 256, block_tokens: int = BLOCK_TOKENS) -> None:
        if max_sessions < 1:
            raise ValueError(f"max sessions must be at least 1, not {max_sessions}")
        self.max_sessions = max_sessions
        self.block_tokens = block_tokens
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently seen first
        # anchor length -> anchor key -> session id: a prompt is checked at each known length.
        self._anchors: dict[int, dict[bytes, str]] = {}
        self._anchor_of: dict[str, tuple[int, bytes]] = {}  # session id -> (length, key)
        self._lock = threading.Lock()

    def begin(self, *, tenant: str, salt: str, model: str, api: str, tokens: Sequence[int],
              checkpoints: Sequence[int], headers: Mapping[str, str]) -> TurnStart:
        """File a request that is about to run under its session (a new one if none matches)."""
        named = _header_session(headers)
        with self._lock:
            if named is not None:
                session_id = self._named(tenant, salt, model, named)
            else:
                session_id = self._by_prefix(tenant, salt, model, tokens, checkpoints)
            self._sessions[session_id].last_seen = time.time()
            self._sessions.move_to_end(session_id)
        # Where the engine snapshots this prompt: every block boundary, the positions the
        # request asked for, and the prompt's end (rewind.engine.request.GenerationRequest).
        points = sorted({*range(self.block_tokens, len(tokens) + 1, self.block_tokens),
                         *(p for p in checkpoints if 0 < p <= len(tokens)), len(tokens)})
        return TurnStart(session_id, model, api, tuple(points))

    def finish(self, start: TurnStart, outcome: str, usage: Usage) -> None:
        """Record a finished turn (its session may have been dropped meanwhile: then nothing)."""
        recomputed = max(0, usage.prompt_tokens - usage.cached_tokens)
        turn = Turn(at=time.time(), model=start.model, api=start.api, outcome=outcome,
                    prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                    ram_tokens=usage.cached_ram_tokens, disk_tokens=usage.cached_disk_tokens,
                    recomputed_tokens=recomputed, ttft_seconds=usage.ttft_seconds,
                    total_seconds=usage.total_seconds, checkpoints=start.checkpoints)
        with self._lock:
            session = self._sessions.get(start.session_id)
            if session is None:
                return
            session.turns.append(turn)
            session.turn_count += 1
            session.last_seen = turn.at
            for key in session.totals:
                session.totals[key] += getattr(turn, key)

    def visible(self, tenant: str, admin: bool) -> list[Session]:
        """The sessions a key may see (every one for an admin), most recently seen first."""
        with self._lock:
            return [_copy(s) for s in reversed(self._sessions.values())
                    if admin or s.tenant == tenant]

    # ---- identity ----------------------------------------------------------------------------

    def _named(self, tenant: str, salt: str, model: str, name: str) -> str:
        digest = hashlib.blake2b(digest_size=8)
        for part in ("header", tenant, salt, name):
            digest.update(len(part).to_bytes(4, "little") + part.encode())
        session_id = digest.hexdigest()
        if session_id not in self._sessions:
            self._add(Session(session_id, tenant, "header", model, 0, time.time(), time.time()))
        return session_id

    def _by_prefix(self, tenant: str, salt: str, model: str, tokens: Sequence[int],
                   checkpoints: Sequence[int]) -> str:
        # The tenant is in the root besides the cache salt: with --shared-cache the salt is the
        # same for every key, and sessions must still not be shared.
        chain = BlockChain(tokens, root_key(f"rewind-session\x00{model}", "", f"{tenant}\x00{salt}"),
                           None, self.block_tokens)
        for length in sorted((n for n in self._anchors if 0 < n <= len(tokens)), reverse=True):
            session_id = self._anchors[length].get(chain.at(length).key)
            if session_id is not None:
                return session_id
        # A new conversation: anchored where its (first) user message ends, the first checkpoint
        # the chat formatter asks for; a bare completion is anchored at its whole prompt.
        inside = [p for p in checkpoints if 0 < p <= len(tokens)]
        anchor = min(inside) if inside else len(tokens)
        key = chain.at(anchor).key
        session_id = key.hex()[:16]
        now = time.time()
        self._add(Session(session_id, tenant, "prefix", model, anchor, now, now))
        self._anchors.setdefault(anchor, {})[key] = session_id
        self._anchor_of[session_id] = (anchor, key)
        return session_id

    def _add(self, session: Session) -> None:
        self._sessions[session.id] = session
        while len(self._sessions) > self.max_sessions:
            old_id, _ = self._sessions.popitem(last=False)
            anchor = self._anchor_of.pop(old_id, None)
            if anchor is not None:
                length, key = anchor
                self._anchors[length].pop(key, None)
                if not self._anchors[length]:
                    del self._anchors[length]


def _copy(session: Session) -> Session:
    """A snapshot the caller may read outside the lock."""
    return Session(session.id, session.tenant, session.source, session.model,
                   session.anchor_tokens, session.started, session.last_seen,
                   deque(session.turns, maxlen=MAX_TURNS), session.turn_count,
                   dict(session.totals))
