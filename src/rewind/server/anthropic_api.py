"""Anthropic-compatible endpoints: POST /v1/messages (plain and streaming) and
/v1/messages/count_tokens. Claude Code talks to this through ANTHROPIC_BASE_URL."""

from __future__ import annotations

import asyncio

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from rewind.engine import SamplingParams, Usage
from rewind.server.body import parse_body
from rewind.server.chat_format import ChatPrompt, Message
from rewind.server.errors import ApiError, bad_request, error_body
from rewind.server.normalize import is_request_metadata
from rewind.server.openapi import json_body
from rewind.server.leases import use_model
from rewind.server.runtime import ModelRuntime
from rewind.server.schemas import AnthropicBlock, CountTokensRequest, MessagesRequest
from rewind.server.streaming import KEEPALIVE_SECONDS, SSE_HEADERS, Generation, sse_event
from rewind.server.structured import request_grammar
from rewind.server.tool_parsing import OutputSplitter, Piece, merge_pieces

router = APIRouter()

# Thinking blocks must carry a signature for clients that send them back; ours signs nothing.
THINKING_SIGNATURE = "rewind-local"


def _block_text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for block in content:
        if block.get("type") == "text":
            texts.append(str(block.get("text", "")))
        else:
            raise bad_request(f"tool_result content of type {block.get('type')!r} is not "
                              "supported (text only)", param="messages")
    return "\n".join(texts)


def _system_text(system: str | list[AnthropicBlock] | None) -> str:
    """The text of system blocks, less the request metadata agents send as blocks."""
    if system is None:
        return ""
    blocks = [AnthropicBlock(type="text", text=system)] if isinstance(system, str) else system
    return "\n\n".join(block.text or "" for block in blocks
                       if block.type == "text" and not is_request_metadata(block.text or ""))


def _merge_user_turns(messages: list[Message]) -> list[Message]:
    """Templates want user and assistant turns to alternate: adjacent user texts become one."""
    merged: list[Message] = []
    for message in messages:
        previous = merged[-1] if merged else None
        if (previous is not None and message["role"] == previous["role"] == "user"
                and isinstance(previous["content"], str)):
            merged[-1] = {**previous, "content": previous["content"] + "\n\n" + message["content"]}
        else:
            merged.append(message)
    return merged


def _image_source(block: AnthropicBlock) -> dict[str, Any]:
    source = block.source
    if not isinstance(source, dict):
        raise bad_request("an image block needs a source object", param="messages")
    return source


def neutral_messages(body: CountTokensRequest,
                     add_image: Callable[[dict[str, Any]], str] | None = None) -> list[Message]:
    """`add_image(source)` takes an image block's source and returns its placeholder text."""
    out: list[Message] = []
    system_texts = [text for text in [_system_text(body.system)] if text]
    for message in body.messages:
        if message.role == "system":
            # Into the system prompt, wherever it stands: Claude Code sends [user prompt,
            # system environment block] and, when it retries, rewrites that user message; a
            # user turn made of the block after it would make every retry recompute the block.
            # The block is the same on every turn, so the prefix stays put.
            text = _system_text(message.content)
            if text:
                system_texts.append(text)
            continue
        blocks = ([AnthropicBlock(type="text", text=message.content)]
                  if isinstance(message.content, str) else message.content)
        if message.role == "assistant":
            texts, reasoning, calls = [], [], []
            for block in blocks:
                if block.type == "text":
                    texts.append(block.text or "")
                elif block.type == "thinking":
                    reasoning.append(block.thinking or "")
                elif block.type == "tool_use":
                    calls.append({"id": block.id or f"toolu_{uuid.uuid4().hex[:24]}",
                                  "type": "function",
                                  "function": {"name": block.name or "",
                                               "arguments": block.input or {}}})
                elif block.type != "redacted_thinking":
                    raise bad_request(f"assistant content blocks of type {block.type!r} are not "
                                      "supported", param="messages")
            neutral: Message = {"role": "assistant", "content": "".join(texts)}
            if reasoning:
                neutral["reasoning_content"] = "\n".join(reasoning)
            if calls:
                neutral["tool_calls"] = calls
            out.append(neutral)
            continue
        texts = []
        for block in blocks:
            if block.type == "text":
                texts.append(block.text or "")
            elif block.type == "image" and add_image is not None:
                texts.append(add_image(_image_source(block)))
            elif block.type == "tool_result":
                result = _block_text(block.content)
                if block.is_error:
                    result = f"Error: {result}"
                out.append({"role": "tool", "tool_call_id": block.tool_use_id or "",
                            "content": result})
            else:
                raise bad_request(f"user content blocks of type {block.type!r} are not "
                                  "supported by this server (text, image and tool_result "
                                  "only)",
                                  param="messages")
        if texts:
            out.append({"role": "user", "content": "\n".join(texts)})
    if system_texts:
        out.insert(0, {"role": "system", "content": "\n\n".join(system_texts)})
    return _merge_user_turns(out)


def _tools(body: CountTokensRequest) -> list[dict[str, Any]]:
    """Client tools in OpenAI's shape (the chat templates' lingua franca); Anthropic server
    tools (web search and friends, which carry a versioned type) cannot run here and are left out."""
    return [
        {"type": "function", "function": {"name": tool.name, "description": tool.description or "",
                                          "parameters": tool.input_schema or {"type": "object"}}}
        for tool in body.tools or []
        if tool.type in (None, "custom")
    ]


def _tool_choice(body: CountTokensRequest) -> str | None:
    choice = body.tool_choice
    if choice is None:
        return None
    return {"auto": "auto", "any": "required", "none": "none"}.get(choice.type, choice.name)


# output_config.effort levels that mean "do not think" when `thinking` does not say.
_NO_THINKING_EFFORTS = ("none", "minimal", "low")


def _template_kwargs(body: CountTokensRequest) -> dict[str, Any] | None:
    """The template's reasoning switch: `thinking` (enabled and adaptive turn it on), else
    output_config.effort (Claude Code's /effort), else the template's default."""
    if body.thinking is not None:
        return {"enable_thinking": body.thinking.type != "disabled"}
    effort = body.output_config.effort if body.output_config is not None else None
    if effort is None:
        return None
    return {"enable_thinking": effort.lower() not in _NO_THINKING_EFFORTS}


def render(runtime: ModelRuntime, body: CountTokensRequest) -> tuple[list[Message], ChatPrompt]:
    images = runtime.image_collector()
    messages = neutral_messages(body, lambda source: _add_image(runtime, images, source))
    prompt = runtime.formatter.render(messages, _tools(body) or None,
                                      tool_choice=_tool_choice(body),
                                      template_kwargs=_template_kwargs(body))
    return messages, runtime.with_images(prompt, images)


def _add_image(runtime: ModelRuntime, images: Any, source: dict[str, Any]) -> str:
    """Anthropic image sources: {"type": "base64", "media_type", "data"} or {"type": "url"}."""
    kind = source.get("type")
    if kind == "base64":
        return runtime.add_image(images, base64_data=source.get("data"))
    if kind == "url":
        return runtime.add_image(images, url=source.get("url"))
    raise bad_request(f"image source type {kind!r} is not supported (base64 or url)",
                      param="messages")


def usage_json(usage: Usage) -> dict[str, Any]:
    # Anthropic counts input tokens read from the cache apart from the others.
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens,
            "cache_creation_input_tokens": 0}


def _stop(generation: Generation) -> tuple[str, str | None]:
    finish = generation.finish
    if generation.saw_tool_call:
        return "tool_use", None
    if finish is not None and finish.reason == "length":
        return "max_tokens", None
    if finish is not None and finish.stop_string:
        return "stop_sequence", finish.stop_string
    return "end_turn", None


def _stop_detail(generation: Generation) -> dict[str, str]:
    """Why a "max_tokens" stop came early: the memory guard's reason. Anthropic's schema has no
    field for it; its SDKs keep unknown fields (`message.model_extra`), as they do OpenAI's
    `finish_detail` that Rewind's chat responses carry."""
    return {"stop_detail": generation.cut_reason} if generation.cut_reason else {}


def _block(piece: Piece) -> dict[str, Any]:
    if piece.kind == "reasoning":
        return {"type": "thinking", "thinking": piece.text, "signature": THINKING_SIGNATURE}
    if piece.kind == "tool_call" and piece.tool_call is not None:
        call = piece.tool_call
        return {"type": "tool_use", "id": call.id, "name": call.name,
                "input": call.arguments_dict()}
    return {"type": "text", "text": piece.text}


@router.post("/v1/messages/count_tokens", openapi_extra=json_body(CountTokensRequest))
async def count_tokens(request: Request) -> Any:
    body = await parse_body(request, CountTokensRequest, request.app.state.config)
    runtime = await use_model(request, body.model, body.keep_alive)
    _, prompt = render(runtime, body)
    return {"input_tokens": len(prompt.tokens)}


@router.post("/v1/messages", openapi_extra=json_body(MessagesRequest))
async def messages(request: Request) -> Any:
    body = await parse_body(request, MessagesRequest, request.app.state.config)
    runtime = await use_model(request, body.model, body.keep_alive)
    # Off the event loop: templating and tokenizing a long conversation take tens of ms,
    # during which every other stream's tokens would wait.
    messages_, prompt = await asyncio.to_thread(render, runtime, body)
    max_tokens = runtime.max_new_tokens(len(prompt.tokens), body.max_tokens)
    params = SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                            top_p=1.0 if body.top_p is None else body.top_p,
                            top_k=body.top_k or 0, stop=list(body.stop_sequences or []),
                            max_tokens=max_tokens)
    tools = _tools(body)
    splitter = OutputSplitter(runtime.output_format,
                              parse_tools=bool(tools) and _tool_choice(body) != "none",
                              start_in_reasoning=prompt.start_in_reasoning, tools=tools,
                              id_prefix="toolu_")
    if messages_[-1]["role"] == "assistant":  # a prefill: its text sets the parser's state
        splitter.feed(messages_[-1]["content"])
    grammar = request_grammar(runtime.output_format, runtime.added_tokens,
                              prompt.start_in_reasoning, tools,
                              _tool_choice(body))
    handle = await runtime.submit_async(prompt.tokens, params, prompt.checkpoints,
                                        prompt.image_prompt, grammar=grammar,
                                        salt=runtime.cache_salt(request),
                                        speculative=body.speculative)
    generation = Generation(runtime, "messages", request, handle, splitter)
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    model = body.model or runtime.model_id
    if body.stream:
        stream = _message_stream(generation, message_id, model, len(prompt.tokens))
        return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)

    pieces = await generation.collect()
    stop_reason, stop_sequence = _stop(generation)
    return JSONResponse({
        "id": message_id, "type": "message", "role": "assistant", "model": model,
        "content": [_block(piece) for piece in merge_pieces(pieces)],
        "stop_reason": stop_reason, "stop_sequence": stop_sequence,
        **_stop_detail(generation), "usage": usage_json(generation.usage),
    })


async def _message_stream(generation: Generation, message_id: str, model: str,
                          prompt_tokens: int) -> AsyncIterator[str]:
    # Anthropic's API reports input and cache figures in message_start, and clients (Claude
    # Code) read them there: wait (briefly) for the restore, which comes before any prefill.
    cached = await generation.cached_tokens_at_admission(KEEPALIVE_SECONDS) or 0
    yield sse_event("message_start", {"type": "message_start", "message": {
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": usage_json(Usage(prompt_tokens=prompt_tokens, cached_tokens=cached))}})
    yield sse_event("ping", {"type": "ping"})
    index = -1
    open_kind: str | None = None  # kind of the open text / thinking block, if any

    def close() -> list[str]:
        events = []
        if open_kind == "reasoning":
            events.append(sse_event("content_block_delta", {
                "type": "content_block_delta", "index": index,
                "delta": {"type": "signature_delta", "signature": THINKING_SIGNATURE}}))
        events.append(sse_event("content_block_stop", {"type": "content_block_stop",
                                                       "index": index}))
        return events

    async for piece in generation.pieces(KEEPALIVE_SECONDS):
        if piece is None:
            yield sse_event("ping", {"type": "ping"})
            continue
        if piece.kind != open_kind or piece.kind == "tool_call":
            if open_kind is not None:
                for event in close():
                    yield event
            index += 1
            open_kind = piece.kind if piece.kind != "tool_call" else None
            start = _block(piece)
            if piece.kind == "reasoning":
                start["thinking"] = ""
            elif piece.kind == "content":
                start["text"] = ""
            else:
                start["input"] = {}
            yield sse_event("content_block_start", {"type": "content_block_start",
                                                    "index": index, "content_block": start})
            if piece.kind == "tool_call" and piece.tool_call is not None:
                yield sse_event("content_block_delta", {
                    "type": "content_block_delta", "index": index,
                    "delta": {"type": "input_json_delta",
                              "partial_json": json.dumps(piece.tool_call.arguments_dict())}})
                yield sse_event("content_block_stop", {"type": "content_block_stop",
                                                       "index": index})
                continue
        delta = ({"type": "thinking_delta", "thinking": piece.text} if piece.kind == "reasoning"
                 else {"type": "text_delta", "text": piece.text})
        yield sse_event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                "delta": delta})
    if open_kind is not None:
        for event in close():
            yield event
    finish = generation.finish
    if finish is not None and finish.reason == "error":
        error = ApiError(500, "server", f"generation failed: {finish.error}")
        yield sse_event("error", error_body(error, "anthropic"))
        return
    stop_reason, stop_sequence = _stop(generation)
    yield sse_event("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": stop_reason,
                                                "stop_sequence": stop_sequence,
                                                **_stop_detail(generation)},
                                      "usage": usage_json(generation.usage)})
    yield sse_event("message_stop", {"type": "message_stop"})
