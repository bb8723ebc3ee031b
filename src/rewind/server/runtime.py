"""What every endpoint needs of one model: the loaded model, its engine, the chat formatter, the
limits; plus the checks that turn engine, context and memory limits into API errors. One per
loaded model (rewind.server.model_pool owns them); the metrics are the server's, shared."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from fastapi import Request

from rewind.cache.blocks import BlockExtras
from rewind.config import ServerConfig
from rewind.engine import (
    EngineStoppedError,
    GenerationRequest,
    InvalidRequestError,
    QueueFullError,
    RequestHandle,
    SamplingParams,
)
from rewind.server.auth import request_cache_salt
from rewind.server.chat_format import ChatFormatter, ChatPrompt
from rewind.server.errors import ApiError, bad_request
from rewind.models.catalog import context_length
from rewind.models.memory_estimate import KvShape
from rewind.server.memory_budget import MemoryBudget, admit
from rewind.server.metrics import ServerMetrics
from rewind.server.request_context import client_disconnected, track_ticket
from rewind.server.tool_parsing import OutputFormat
from rewind.vision.images import ImageCollector, ImageError, ImageLimits

log = logging.getLogger(__name__)


def _vision_adapter(loaded: Any) -> tuple[Any, str | None]:
    """(adapter, None) for a vision model folder; (None, why) when images cannot be served."""
    config = getattr(loaded, "config", None) or {}
    if not isinstance(config.get("vision_config"), dict):
        return None, f"the model {getattr(loaded, 'name', '')!r} does not accept images"
    try:
        from rewind.vision.vlm import adapter_for

        return adapter_for(loaded), None
    except Exception as exc:  # mlx-vlm missing, an unsupported family: text still works
        log.warning("images are disabled for this model: %s", exc)
        return None, f"this server cannot take images for this model: {exc}"


def _added_tokens(tokenizer: Any) -> dict[str, int]:
    """Text of each added (special) token -> its id: tags such as </think> or <tool_call> that
    a grammar must name as tokens."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    decoder = getattr(hf, "added_tokens_decoder", None) or {}
    return {str(getattr(token, "content", token)): int(index)
            for index, token in decoder.items()}


class ModelRuntime:
    def __init__(self, loaded: Any, engine: Any, config: ServerConfig, metrics: ServerMetrics,
                 prompt_cache: Any = None, budget: MemoryBudget | None = None,
                 kv: KvShape | None = None) -> None:
        self.loaded = loaded
        self.engine = engine
        self.config = config
        self.prompt_cache = prompt_cache
        self.tokenizer = loaded.tokenizer
        self.output_format = OutputFormat.from_tokenizer(loaded.tokenizer)
        self.formatter = ChatFormatter(loaded.tokenizer, self.output_format)
        self.added_tokens = _added_tokens(loaded.tokenizer)
        self.context_length = context_length(loaded.config)
        self.model_id = str(loaded.name)
        self.created = int(time.time())
        self.vision, self.vision_unavailable = _vision_adapter(loaded)
        self.image_limits = ImageLimits(allow_urls=config.allow_image_urls,
                                        max_images=config.max_images)
        self.metrics = metrics
        self.budget = budget
        self.kv = kv  # per-sequence cache bytes, for the memory budget (None: not accounted)
        self.fallback_note: str | None = None  # set on a lease served by a smaller form
        if hasattr(engine, "add_sample_listener"):
            engine.add_sample_listener(self.metrics.on_engine_sample)

    def check_prompt_length(self, prompt_tokens: int) -> None:
        limit = self.config.max_prompt_tokens
        if limit is not None and prompt_tokens > limit:
            raise bad_request(f"the prompt has {prompt_tokens} tokens; this server takes at most "
                              f"{limit} (--max-prompt-tokens)", param="messages",
                              code="prompt_too_long")

    @staticmethod
    def cache_salt(request: Request, client_salt: str | None = None) -> str:
        """The tenant's salt (from its API key), and the client's own `cache_salt` (vLLM's
        field) on top: either keeps these cached prefixes from everyone else's."""
        tenant = request_cache_salt(request.scope)
        return f"{tenant}\x00{client_salt}" if client_salt else tenant

    def max_new_tokens(self, prompt_tokens: int, requested: int | None) -> int:
        """How many tokens a request may generate: what it asks for (the server's --max-tokens
        when it asks for nothing: agents such as codex send no limit), at most --max-tokens and
        what is left of the context. Agents ask for more than small models hold (Claude Code asks
        for 32k), so that is a cut, answered with finish_reason "length", as llama.cpp's and
        Ollama's servers do; a prompt that leaves no room at all is a 400 with the counts."""
        ceiling = self.config.max_tokens
        wanted = min(requested or ceiling, ceiling)
        limit = self.context_length
        if limit is None:
            return wanted
        if prompt_tokens >= limit:
            raise bad_request(f"this model's maximum context length is {limit} tokens, but the "
                              f"prompt has {prompt_tokens} tokens", param="messages",
                              code="context_length_exceeded")
        return min(wanted, limit - prompt_tokens)

    def token_ids(self, logit_bias: dict[str, float] | None) -> dict[int, float] | None:
        """OpenAI's logit_bias has token ids as JSON string keys."""
        if not logit_bias:
            return None
        try:
            return {int(token): float(bias) for token, bias in logit_bias.items()}
        except ValueError as exc:
            raise bad_request("logit_bias keys must be token ids", param="logit_bias") from exc

    # ---- images (rewind.vision) ---------------------------------------------------------------

    def image_collector(self) -> ImageCollector:
        # Bytes of an image whose tower output is kept are hashed, not decoded again.
        known = self.vision.known_image if self.vision is not None else None
        return ImageCollector(self.image_limits, known)

    def add_image(self, collector: ImageCollector, *, url: Any = None,
                  base64_data: Any = None, param: str = "messages") -> str:
        """Decode one request image into `collector`; returns the placeholder text that marks
        its place in the prompt. Any problem is a 400 naming it."""
        if self.vision is None:
            raise bad_request(self.vision_unavailable or "this model does not accept images",
                              param=param, code="images_not_supported")
        try:
            if base64_data is not None:
                if not isinstance(base64_data, str):
                    raise ImageError("the image's base64 data must be a string")
                collector.add_base64(base64_data)
            else:
                collector.add_url(url)
        except ImageError as exc:
            raise bad_request(f"invalid image: {exc}", param=param, code="invalid_image") from exc
        return self.tokenizer.convert_ids_to_tokens(self.vision.placeholder_id)

    def with_images(self, prompt: ChatPrompt, collector: ImageCollector | None) -> ChatPrompt:
        """The prompt with each image placeholder expanded into its image tokens (unchanged for
        a request without images: text requests keep the text path)."""
        if collector is None or not collector.images:
            return prompt
        from rewind.vision.prompting import prepare_image_prompt

        try:
            image_prompt = prepare_image_prompt(self.vision, self.loaded.model, prompt.tokens,
                                                collector.images, prompt.checkpoints)
        except ImageError as exc:
            raise bad_request(f"invalid image: {exc}", param="messages",
                              code="invalid_image") from exc
        return dataclasses.replace(prompt, tokens=image_prompt.tokens,
                                   checkpoints=image_prompt.checkpoints, image_prompt=image_prompt)

    def submit(self, tokens: list[int], params: SamplingParams,
               checkpoints: list[int] | None = None, image_prompt: Any = None,
               salt: str = "", grammar: str | None = None,
               speculative: bool | None = None, memory_ticket: Any = None) -> RequestHandle:
        """Queue a generation; `salt` keeps its cached prefixes apart from other tenants';
        `grammar` constrains its answer (rewind.server.structured); `speculative=False` keeps it
        out of speculative decoding; `memory_ticket` is its prompt's room in the memory budget
        (submit_async), which the engine grows and gives back."""
        self.check_prompt_length(len(tokens))
        request = GenerationRequest(prompt_tokens=tokens, params=params,
                                    checkpoints=sorted(set(checkpoints or [])), grammar=grammar,
                                    speculative=speculative is not False)
        if image_prompt is not None:
            image_prompt.into(request)
        if salt:
            extras = request.extras or BlockExtras()
            request.extras = dataclasses.replace(extras, salt=salt)
        try:
            handle = self.engine.submit(request, memory_ticket=memory_ticket)
        except QueueFullError as exc:
            retry = max(1, round(exc.retry_after_seconds))
            raise ApiError(429, "rate_limit", str(exc), code="queue_full",
                           headers={"Retry-After": str(retry)}) from exc
        except InvalidRequestError as exc:
            raise bad_request(str(exc)) from exc
        except EngineStoppedError as exc:  # a failed engine, until the pool restarts it
            raise ApiError(503, "overloaded", str(exc), code="engine_stopped",
                           headers={"Retry-After": "1"}) from exc
        handle.submitted = request  # type: ignore[attr-defined]  # read by Generation's session
        return handle

    async def render(self, messages: Any, tools: Any = None, **kwargs: Any) -> Any:
        """The formatter's render off the event loop: templating and tokenizing a long
        conversation take tens of milliseconds (25-40 ms at 10k tokens on 2 cores), during
        which every other stream's tokens would wait to be sent."""
        return await asyncio.to_thread(self.formatter.render, messages, tools, **kwargs)

    async def submit_async(self, tokens: list[int], *args: Any, **kwargs: Any) -> RequestHandle:
        """submit() for the event loop, after the memory budget admits the prompt's cache (it
        may wait for room, or answer 429). A request with a grammar compiles it first, which
        takes milliseconds, or seconds the first time (llguidance reads the model's vocabulary:
        ~4 s and ~240 MB for Gemma's 262k tokens), and must not stall every other stream."""
        self.check_prompt_length(len(tokens))
        ticket = None
        if self.budget is not None and self.kv is not None:
            ticket = await admit(self.budget, self.kv, len(tokens) + 1, self.model_id,
                                 client_disconnected)

            track_ticket(ticket)
        try:
            kwargs["memory_ticket"] = ticket
            if kwargs.get("grammar") is None:
                handle = self.submit(tokens, *args, **kwargs)
            else:
                handle = await asyncio.to_thread(self.submit, tokens, *args, **kwargs)
        except BaseException:
            if ticket is not None:
                ticket.release()
            raise
        return handle

    def healthy(self) -> bool:
        alive = getattr(self.engine, "alive", True)
        return bool(alive)
