"""OpenAI-compatible endpoints: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations


import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from rewind.engine import SamplingParams, TokenEvent, Usage
from rewind.server.body import parse_body
from rewind.server.chat_format import Message
from rewind.server.errors import ApiError, bad_request, error_body
from rewind.server.openapi import json_body
from rewind.server.leases import use_model
from rewind.server.runtime import ModelRuntime
from rewind.server.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ContentPart,
    NamedToolChoice,
    SamplingFields,
)
from rewind.server.streaming import (
    KEEPALIVE_SECONDS,
    SSE_HEADERS,
    SSE_KEEPALIVE,
    Generation,
    sse_data,
)
from rewind.server.structured import request_grammar
from rewind.server.tool_parsing import (
    OutputFormat,
    OutputSplitter,
    Piece,
    ToolCall,
    call_arguments,
    collect,
)

router = APIRouter()


# ---------------------------------------------------------------- request -> prompt


# An image part's URL -> the placeholder text that marks its place (ModelRuntime.add_image).
AddImage = Callable[[Any], str]


def _image_url(part: ContentPart) -> Any:
    """OpenAI sends {"url": ..., "detail": ...}; a bare string is accepted too."""
    value = part.image_url
    return value.get("url") if isinstance(value, dict) else value


def _text_of(message: ChatMessage, add_image: AddImage | None = None) -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type in ("text", "input_text", "output_text") and part.text is not None:
            texts.append(part.text)
        elif part.type == "image_url" and add_image is not None:
            texts.append(add_image(_image_url(part)))
        else:
            raise bad_request(f"content parts of type {part.type!r} are not supported by this "
                              "server (text and image_url only)", param="messages")
    return "".join(texts)


def neutral_messages(messages: list[ChatMessage],
                     add_image: AddImage | None = None) -> list[Message]:
    out: list[Message] = []
    for message in messages:
        neutral: Message = {"role": "tool" if message.role == "function" else message.role,
                            "content": _text_of(message, add_image)}
        if message.tool_calls:
            neutral["tool_calls"] = [
                {"id": call.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": call.function.name,
                              "arguments": call_arguments(call.function.arguments,
                                                          "tool call", "messages")}}
                for call in message.tool_calls
            ]
        if message.tool_call_id:
            neutral["tool_call_id"] = message.tool_call_id
        if message.name:
            neutral["name"] = message.name
        reasoning = message.reasoning_content or message.reasoning
        if reasoning:
            neutral["reasoning_content"] = reasoning
        out.append(neutral)
    return out


def _tool_choice_name(choice: Any) -> str | None:
    if isinstance(choice, NamedToolChoice):
        return choice.function.get("name")
    return choice


def sampling_params(body: SamplingFields, max_tokens: int, *, logprobs: bool = False,
                    top_logprobs: int = 0, runtime: ModelRuntime) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        seed=None if body.seed == -1 else body.seed,
        logit_bias=runtime.token_ids(body.logit_bias),
        stop=stop,
        max_tokens=max_tokens,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )


def usage_json(usage: Usage) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    if usage.drafted_tokens:
        # OpenAI's fields for predicted outputs, which speculative decoding is: drafted tokens
        # the answer kept, and those it did not.
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": usage.accepted_tokens,
            "rejected_prediction_tokens": usage.drafted_tokens - usage.accepted_tokens}
    return out


def _finish_reason(generation: Generation) -> str:
    reason = generation.finish.reason if generation.finish else "stop"
    if generation.saw_tool_call and reason == "stop":
        return "tool_calls"
    return "length" if reason == "length" else "stop"


def _finish_detail(generation: Generation) -> dict[str, str]:
    """Why the memory guard ended the answer (finish_reason "length"), when it did."""
    return {"finish_detail": generation.cut_reason} if generation.cut_reason else {}


def _tool_call_json(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": call.id, "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}}
    if index is not None:
        out["index"] = index
    return out


def _logprobs_json(runtime: ModelRuntime, events: list[TokenEvent]) -> dict[str, Any]:
    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = runtime.tokenizer.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for event in events:
        item = entry(event.token, event.logprob if event.logprob is not None else 0.0)
        item["top_logprobs"] = [entry(t, lp) for t, lp in (event.top_logprobs or [])]
        content.append(item)
    return {"content": content}


# ---------------------------------------------------------------- /v1/chat/completions


@router.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest))
async def chat_completions(request: Request) -> Any:
    body = await parse_body(request, ChatCompletionRequest, request.app.state.config)
    runtime = await use_model(request, body.model, body.keep_alive)
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
    choice = _tool_choice_name(body.tool_choice)
    images = runtime.image_collector()
    messages = neutral_messages(body.messages, lambda url: runtime.add_image(images, url=url))
    prompt = await runtime.render(messages, tools or None, tool_choice=choice,
                                  template_kwargs=body.chat_template_kwargs)
    prompt = runtime.with_images(prompt, images)
    max_tokens = runtime.max_new_tokens(len(prompt.tokens),
                                        body.max_completion_tokens or body.max_tokens)
    params = sampling_params(body, max_tokens, logprobs=body.logprobs,
                             top_logprobs=body.top_logprobs or 0, runtime=runtime)
    splitter = OutputSplitter(runtime.output_format, parse_tools=bool(tools) and choice != "none",
                              start_in_reasoning=prompt.start_in_reasoning, tools=tools)
    if messages[-1]["role"] == "assistant":  # a prefill: its text sets the parser's state
        splitter.feed(messages[-1]["content"])
    response_format = (None if body.response_format is None else
                       (body.response_format.type, body.response_format.json_schema,
                        "response_format"))
    grammar = request_grammar(runtime.output_format, runtime.added_tokens,
                              prompt.start_in_reasoning, tools, choice,
                              response_format)
    handle = await runtime.submit_async(prompt.tokens, params, prompt.checkpoints,
                                        prompt.image_prompt, grammar=grammar,
                                        salt=runtime.cache_salt(request, body.cache_salt),
                                        speculative=body.speculative)
    generation = Generation(runtime, "chat", request, handle, splitter, keep_tokens=body.logprobs)
    completion_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    model = body.model or runtime.model_id
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = _chat_stream(runtime, generation, completion_id, model, include_usage)
        return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)

    pieces = await generation.collect()
    content, reasoning, calls = collect(pieces)
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [_tool_call_json(call) for call in calls]
    return JSONResponse({
        "id": completion_id, "object": "chat.completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": _finish_reason(generation),
                     "logprobs": _logprobs_json(runtime, generation.token_events)
                     if body.logprobs else None, **_finish_detail(generation)}],
        "usage": usage_json(generation.usage),
    })


async def _chat_stream(runtime: ModelRuntime, generation: Generation, completion_id: str,
                       model: str, include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish_reason: str | None = None,
              logprobs: Any = None) -> str:
        return sse_data({"id": completion_id, "object": "chat.completion.chunk",
                         "created": created, "model": model,
                         "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                      "finish_reason": finish_reason}]})

    yield chunk({"role": "assistant", "content": ""})
    tool_index = 0
    logged = 0
    async for piece in generation.pieces(KEEPALIVE_SECONDS):
        if piece is None:
            yield SSE_KEEPALIVE
            continue
        logprobs = None
        if generation.keep_tokens and len(generation.token_events) > logged:
            logprobs = _logprobs_json(runtime, generation.token_events[logged:])
            logged = len(generation.token_events)
        yield chunk(_delta(piece, tool_index), logprobs=logprobs)
        if piece.kind == "tool_call":
            tool_index += 1
    finish = generation.finish
    if finish is not None and finish.reason == "error":
        error = ApiError(500, "server", f"generation failed: {finish.error}")
        yield sse_data(error_body(error, "openai"))
    else:
        final = json.loads(chunk({}, _finish_reason(generation))[len("data: "):])
        final["choices"][0].update(_finish_detail(generation))
        yield sse_data(final)
    if include_usage:
        yield sse_data({"id": completion_id, "object": "chat.completion.chunk",
                        "created": created, "model": model, "choices": [],
                        "usage": usage_json(generation.usage)})
    yield sse_data("[DONE]")


def _delta(piece: Piece, tool_index: int) -> dict[str, Any]:
    if piece.kind == "reasoning":
        return {"reasoning_content": piece.text}
    if piece.kind == "tool_call" and piece.tool_call is not None:
        return {"tool_calls": [_tool_call_json(piece.tool_call, tool_index)]}
    return {"content": piece.text}


# ---------------------------------------------------------------- /v1/completions


def _prompt_tokens(runtime: ModelRuntime, prompt: str | list[str] | list[int]) -> list[int]:
    # The schema lets through one text, a list of one text, or a non-empty list of ids.
    if isinstance(prompt, list) and isinstance(prompt[0], int):
        return list(prompt)  # type: ignore[arg-type]
    text = prompt if isinstance(prompt, str) else prompt[0]
    if not text:
        raise bad_request("the prompt is empty", param="prompt")
    return list(runtime.tokenizer.encode(text))


@router.post("/v1/completions", openapi_extra=json_body(CompletionRequest))
async def completions(request: Request) -> Any:
    body = await parse_body(request, CompletionRequest, request.app.state.config)
    runtime = await use_model(request, body.model, body.keep_alive)
    tokens = _prompt_tokens(runtime, body.prompt)
    max_tokens = runtime.max_new_tokens(len(tokens), body.max_tokens)
    params = sampling_params(body, max_tokens, logprobs=body.logprobs is not None,
                             top_logprobs=body.logprobs or 0, runtime=runtime)
    plain = OutputSplitter(OutputFormat(think_start=None, think_end=None), parse_tools=False)
    handle = await runtime.submit_async(tokens, params, [len(tokens)],
                                        salt=runtime.cache_salt(request, body.cache_salt),
                                        speculative=body.speculative)
    generation = Generation(runtime, "completions", request, handle, plain,
                            keep_tokens=body.logprobs is not None)
    completion_id = f"cmpl-{uuid.uuid4().hex[:24]}"
    model = body.model or runtime.model_id
    echo = body.prompt if body.echo and isinstance(body.prompt, str) else ""
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        stream = _completion_stream(runtime, generation, completion_id, model, include_usage,
                                    echo)
        return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)
    pieces = await generation.collect()
    text = echo + "".join(piece.text for piece in pieces)
    return JSONResponse({
        "id": completion_id, "object": "text_completion", "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text,
                     "logprobs": _legacy_logprobs(runtime, generation.token_events)
                     if body.logprobs is not None else None,
                     "finish_reason": _finish_reason(generation)}],
        "usage": usage_json(generation.usage),
    })


def _legacy_logprobs(runtime: ModelRuntime, events: list[TokenEvent]) -> dict[str, Any]:
    """The legacy completions shape: parallel lists, top alternatives as {token: logprob}."""
    def text(token: int) -> str:
        return runtime.tokenizer.decode([token])

    return {"tokens": [text(e.token) for e in events],
            "token_logprobs": [e.logprob for e in events],
            "top_logprobs": [{text(t): lp for t, lp in e.top_logprobs or []} for e in events],
            "text_offset": []}


async def _completion_stream(runtime: ModelRuntime, generation: Generation, completion_id: str,
                             model: str, include_usage: bool, echo: str) -> AsyncIterator[str]:
    created = int(time.time())
    logged = 0

    def chunk(text: str, finish_reason: str | None = None) -> str:
        nonlocal logged
        logprobs = None
        if generation.keep_tokens and len(generation.token_events) > logged:
            logprobs = _legacy_logprobs(runtime, generation.token_events[logged:])
            logged = len(generation.token_events)
        return sse_data({"id": completion_id, "object": "text_completion", "created": created,
                         "model": model, "choices": [{"index": 0, "text": text,
                                                      "logprobs": logprobs,
                                                      "finish_reason": finish_reason}]})

    if echo:
        yield chunk(echo)
    async for piece in generation.pieces(KEEPALIVE_SECONDS):
        yield SSE_KEEPALIVE if piece is None else chunk(piece.text)
    finish = generation.finish
    if finish is not None and finish.reason == "error":
        yield sse_data(error_body(ApiError(500, "server", f"generation failed: {finish.error}"),
                                  "openai"))
    else:
        yield chunk("", _finish_reason(generation))
    if include_usage:
        yield sse_data({"id": completion_id, "object": "text_completion", "created": created,
                        "model": model, "choices": [], "usage": usage_json(generation.usage)})
    yield sse_data("[DONE]")
