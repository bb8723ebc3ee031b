"""One timed, streamed chat completion over HTTP with the `openai` client.

Time to first token is taken at the first streamed chunk that carries text (content or reasoning);
end-to-end at the end of the stream. Usage comes from `stream_options.include_usage`; servers that
do not send it (or do not report cached tokens) leave those fields None, and the workloads then
fall back to counts derived from timing.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from openai import OpenAI


@dataclass
class ChatTiming:
    ttft_s: float
    e2e_s: float
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens, when reported
    streamed_chunks: int  # chunks with text: a lower bound on tokens when usage is missing
    finish_reason: str | None
    text: str
    # Seconds between consecutive streamed chunks with text (a token each on Rewind,
    # llama-server and mlx-lm, but for text held back): how long a stream waits for its next.
    token_gaps_s: list[float] = field(default_factory=list)
    # usage.completion_tokens_details' predicted-output counts (Rewind's speculative decoding
    # reports its drafts there), when reported.
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_client(base_url: str, timeout: float = 900.0) -> OpenAI:
    # max_retries=0: a retry would hide a failure and double-count time.
    return OpenAI(base_url=f"{base_url}/v1", api_key="bench", timeout=timeout, max_retries=0)


def timed_chat(client: OpenAI, messages: list[dict[str, Any]], max_tokens: int | None,
               model: str = "default", seed: int = 0,
               extra_body: dict[str, Any] | None = None) -> ChatTiming:
    """Greedy (temperature 0), streamed. `max_tokens=None` lets the model stop naturally.
    `extra_body`: more request fields (a logit_bias, a server's own options)."""
    started = time.perf_counter()
    first_text_at: float | None = None
    first_chunk_at: float | None = None
    pieces: list[str] = []
    chunks_with_text = 0
    finish_reason: str | None = None
    usage: Any = None
    extra: dict[str, Any] = {}
    if max_tokens is not None:
        extra["max_tokens"] = max_tokens
    stream = client.chat.completions.create(
        model=model, messages=messages, temperature=0.0, seed=seed, stream=True,
        stream_options={"include_usage": True}, extra_body=extra_body, **extra)
    chunk_times: list[float] = []
    for chunk in stream:
        now = time.perf_counter()
        if first_chunk_at is None and chunk.choices:
            first_chunk_at = now
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            text = (delta.content or "") if delta is not None else ""
            reasoning = getattr(delta, "reasoning_content", None) or getattr(delta, "reasoning", None)
            if text or reasoning:
                chunks_with_text += 1
                chunk_times.append(now)
                if first_text_at is None:
                    first_text_at = now
                pieces.append(text)
            if choice.finish_reason:
                finish_reason = choice.finish_reason
    ended = time.perf_counter()
    # A model whose first tokens decode to nothing (tiny random models do) still produced a
    # token when the first choice chunk arrived.
    first = first_text_at or first_chunk_at or ended
    cached: int | None = None
    predicted: dict[str, int] = {}
    if usage is not None:
        details = getattr(usage, "prompt_tokens_details", None)
        if details is not None and getattr(details, "cached_tokens", None) is not None:
            cached = int(details.cached_tokens)
        completion = getattr(usage, "completion_tokens_details", None)
        for name in ("accepted_prediction_tokens", "rejected_prediction_tokens"):
            value = getattr(completion, name, None) if completion is not None else None
            if value is not None:
                predicted[name] = int(value)
    return ChatTiming(
        ttft_s=first - started,
        e2e_s=ended - started,
        prompt_tokens=int(usage.prompt_tokens) if usage is not None else None,
        completion_tokens=int(usage.completion_tokens) if usage is not None else None,
        cached_tokens=cached,
        streamed_chunks=chunks_with_text,
        finish_reason=finish_reason,
        text="".join(pieces),
        token_gaps_s=[b - a for a, b in zip(chunk_times, chunk_times[1:])],
        **predicted,
    )
