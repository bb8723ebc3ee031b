"""OpenAI Responses API (`POST /v1/responses`), the protocol codex speaks: input items in,
output items (reasoning, message, function_call) out, as one object or as a stream of typed
events (response.created ... response.output_text.delta ... response.completed).

Nothing is stored: `previous_response_id` is refused; clients resend the conversation, which is
what the prompt cache is for.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from rewind.engine import SamplingParams, Usage
from rewind.server.body import parse_body
from rewind.server.chat_format import Message
from rewind.server.errors import bad_request
from rewind.server.openapi import json_body
from rewind.server.leases import use_model
from rewind.server.runtime import ModelRuntime
from rewind.server.schemas import (
    ResponsesCustomToolCallItem,
    ResponsesFunctionCallItem,
    ResponsesMessageItem,
    ResponsesNamedToolChoice,
    ResponsesPart,
    ResponsesRequest,
    ResponsesToolOutputItem,
)
from rewind.server.streaming import (
    KEEPALIVE_SECONDS,
    SSE_HEADERS,
    SSE_KEEPALIVE,
    Generation,
    sse_event,
)
from rewind.server.structured import request_grammar, responses_text_format
from rewind.server.tool_parsing import OutputSplitter, Piece, call_arguments

router = APIRouter()

_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _parts_text(content: str | list[ResponsesPart] | None, where: str,
                add_image: Callable[[Any], str] | None = None) -> str:
    """`add_image(url)` decodes an input_image part and returns its placeholder text."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type == "input_image" and add_image is not None:
            texts.append(add_image(part.image_url))
            continue
        if part.type not in _TEXT_PARTS:
            raise bad_request(f"{where}: content parts of type {part.type!r} are not supported by "
                              "this server (text and input_image only)", param="input")
        texts.append(part.text or "")
    return "".join(texts)


def neutral_messages(body: ResponsesRequest,
                     add_image: Callable[[Any], str] | None = None) -> list[Message]:
    out: list[Message] = []
    if body.instructions:
        out.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        out.append({"role": "user", "content": body.input})
        return out
    pending_reasoning = ""
    for position, item in enumerate(body.input):
        where = f"input[{position}]"
        if isinstance(item, ResponsesMessageItem):
            message: Message = {"role": item.role,
                                "content": _parts_text(item.content, where, add_image)}
            if item.role == "assistant" and pending_reasoning:
                message["reasoning_content"], pending_reasoning = pending_reasoning, ""
            out.append(message)
        elif isinstance(item, (ResponsesFunctionCallItem, ResponsesCustomToolCallItem)):
            if isinstance(item, ResponsesFunctionCallItem):
                arguments = call_arguments(item.arguments, where, "input")
            else:
                arguments = {"input": item.input}
            call = {"id": item.call_id or _new_id("call"), "type": "function",
                    "function": {"name": item.name, "arguments": arguments}}
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            elif out and out[-1]["role"] == "assistant":
                out[-1]["tool_calls"] = [call]
            else:
                message = {"role": "assistant", "content": "", "tool_calls": [call]}
                if pending_reasoning:
                    message["reasoning_content"], pending_reasoning = pending_reasoning, ""
                out.append(message)
        elif isinstance(item, ResponsesToolOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _parts_text(item.output, where)})
        else:  # reasoning
            pending_reasoning += _parts_text(item.content, where)
    return out


def _tools(body: ResponsesRequest) -> list[dict[str, Any]]:
    """Function tools in the chat-completions shape; hosted tools (web_search...) cannot run
    here and are left out."""
    tools = []
    for tool in body.tools or []:
        if tool.type == "function" and tool.name:
            tools.append({"type": "function", "function": {
                "name": tool.name, "description": tool.description or "",
                "parameters": tool.parameters or {"type": "object"}}})
    return tools


def _tool_choice(body: ResponsesRequest) -> str | None:
    choice = body.tool_choice
    if isinstance(choice, ResponsesNamedToolChoice):
        return choice.name
    return choice


def _dumped(value: Any) -> Any:
    """Echo a request field back as the client sent it (its own keys, nothing added)."""
    if isinstance(value, BaseModel):
        return value.model_dump(exclude_unset=True)
    return value


def usage_json(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


class _Output:
    """The response's output items as they are built, piece by piece."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the reasoning or message item being written

    def add(self, piece: Piece) -> list[tuple[str, dict[str, Any]]]:
        """Fold a piece in; return the stream events it causes (name, payload without
        sequence_number)."""
        events: list[tuple[str, dict[str, Any]]] = []
        kind = {"reasoning": "reasoning", "content": "message"}.get(piece.kind)
        if self.open is not None and (kind is None or self.open["type"] != kind):
            events += self.close()
        if piece.kind == "tool_call" and piece.tool_call is not None:
            call = piece.tool_call
            item = {"id": _new_id("fc"), "type": "function_call", "call_id": call.id,
                    "name": call.name, "arguments": "", "status": "in_progress"}
            index = len(self.items)
            self.items.append(item)
            events.append(("response.output_item.added", {"output_index": index, "item":
                                                          dict(item)}))
            events.append(("response.function_call_arguments.delta", {
                "item_id": item["id"], "output_index": index, "delta": call.arguments}))
            item.update(arguments=call.arguments, status="completed")
            events.append(("response.function_call_arguments.done", {
                "item_id": item["id"], "output_index": index, "name": call.name,
                "arguments": call.arguments}))
            events.append(("response.output_item.done", {"output_index": index, "item": item}))
            return events
        if self.open is None:
            events += self._open(kind or "message")
        item, index = self.open, len(self.items) - 1
        assert item is not None
        part = item["content"][0]
        part["text"] += piece.text
        name = ("response.reasoning_text.delta" if kind == "reasoning"
                else "response.output_text.delta")
        payload = {"item_id": item["id"], "output_index": index, "content_index": 0,
                   "delta": piece.text}
        if kind == "message":
            payload["logprobs"] = []
        events.append((name, payload))
        return events

    def _open(self, kind: str) -> list[tuple[str, dict[str, Any]]]:
        if kind == "reasoning":
            item = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": _new_id("msg"), "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        index = len(self.items)
        events = [("response.output_item.added", {"output_index": index, "item": dict(item)}),
                  ("response.content_part.added", {"item_id": item["id"], "output_index": index,
                                                   "content_index": 0, "part": dict(part)})]
        item["content"] = [part]
        self.items.append(item)
        self.open = item
        return events

    def close(self) -> list[tuple[str, dict[str, Any]]]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        part = item["content"][0]
        done = ("response.reasoning_text.done" if item["type"] == "reasoning"
                else "response.output_text.done")
        if item["type"] == "message":
            item["status"] = "completed"
        return [(done, {"item_id": item["id"], "output_index": index, "content_index": 0,
                        "text": part["text"]}),
                ("response.content_part.done", {"item_id": item["id"], "output_index": index,
                                                "content_index": 0, "part": part}),
                ("response.output_item.done", {"output_index": index, "item": item})]


@router.post("/v1/responses", openapi_extra=json_body(ResponsesRequest))
async def responses(request: Request) -> Any:
    body = await parse_body(request, ResponsesRequest, request.app.state.config)
    runtime = await use_model(request, body.model, body.keep_alive)
    if body.previous_response_id:
        raise bad_request("previous_response_id is not supported: this server stores no "
                          "responses; send the whole conversation as input (the prompt cache "
                          "makes that cheap)", param="previous_response_id")
    images = runtime.image_collector()
    messages = neutral_messages(body, lambda url: runtime.add_image(images, url=url, param="input"))
    if not messages or all(m["role"] == "system" for m in messages):
        raise bad_request("input must not be empty", param="input")
    tools = _tools(body)
    choice = _tool_choice(body)
    effort = body.reasoning.effort if body.reasoning is not None else None
    template_kwargs = {"enable_thinking": False} if effort == "none" else None
    prompt = await runtime.render(messages, tools or None, tool_choice=choice,
                                  template_kwargs=template_kwargs)
    prompt = runtime.with_images(prompt, images)
    max_tokens = runtime.max_new_tokens(len(prompt.tokens), body.max_output_tokens)
    params = SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                            top_p=1.0 if body.top_p is None else body.top_p,
                            max_tokens=max_tokens)
    splitter = OutputSplitter(runtime.output_format, parse_tools=bool(tools) and choice != "none",
                              start_in_reasoning=prompt.start_in_reasoning, tools=tools)
    if messages[-1]["role"] == "assistant":  # a prefill: its text sets the parser's state
        splitter.feed(messages[-1]["content"])
    grammar = request_grammar(runtime.output_format, runtime.added_tokens,
                              prompt.start_in_reasoning, tools, choice,
                              responses_text_format(body.text))
    handle = await runtime.submit_async(prompt.tokens, params, prompt.checkpoints,
                                        prompt.image_prompt, grammar=grammar,
                                        salt=runtime.cache_salt(request),
                                        speculative=body.speculative)
    generation = Generation(runtime, "responses", request, handle, splitter)
    response = {
        "id": _new_id("resp"), "object": "response", "created_at": int(time.time()),
        "model": body.model or runtime.model_id, "status": "in_progress", "error": None,
        "incomplete_details": None, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "output": [],
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": params.temperature, "top_p": params.top_p,
        "tool_choice": _dumped(body.tool_choice) or "auto",
        "tools": [_dumped(tool) for tool in body.tools or []],
        "text": body.text or {"format": {"type": "text"}}, "reasoning": _dumped(body.reasoning),
        "metadata": body.metadata or {}, "usage": None,
    }
    if body.stream:
        return StreamingResponse(_stream(generation, response), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    output = _Output()
    for piece in await generation.collect():
        output.add(piece)
    output.close()
    _finish(response, output, generation)
    return JSONResponse(response)


def _finish(response: dict[str, Any], output: _Output, generation: Generation) -> str:
    """Fill in the final state; return the name of the closing stream event."""
    response["output"] = output.items
    response["usage"] = usage_json(generation.usage)
    finish = generation.finish
    if finish is not None and finish.reason == "error":
        response["status"] = "failed"
        response["error"] = {"code": "server_error", "message": f"generation failed: "
                             f"{finish.error}"}
        return "response.failed"
    if finish is not None and finish.reason == "length":
        response["status"] = "incomplete"
        # The memory guard's cut is reported as the length cut it is, with its reason beside
        # (a field the schema does not name; OpenAI's SDK keeps it in model_extra).
        detail = {"detail": generation.cut_reason} if generation.cut_reason else {}
        response["incomplete_details"] = {"reason": "max_output_tokens", **detail}
        return "response.incomplete"
    response["status"] = "completed"
    return "response.completed"


async def _stream(generation: Generation, response: dict[str, Any]) -> AsyncIterator[str]:
    sequence = 0

    def event(name: str, payload: dict[str, Any]) -> str:
        nonlocal sequence
        sequence += 1
        return sse_event(name, {"type": name, "sequence_number": sequence - 1, **payload})

    yield event("response.created", {"response": dict(response)})
    yield event("response.in_progress", {"response": dict(response)})
    output = _Output()
    async for piece in generation.pieces(KEEPALIVE_SECONDS):
        if piece is None:
            yield SSE_KEEPALIVE
            continue
        for name, payload in output.add(piece):
            yield event(name, payload)
    for name, payload in output.close():
        yield event(name, payload)
    closing = _finish(response, output, generation)
    yield event(closing, {"response": response})
