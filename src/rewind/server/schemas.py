"""Request bodies of the three APIs, validated with pydantic.

Unknown fields are ignored (clients send many we have no use for); known fields are typed, so a
wrong type becomes a 400 in the API's own error shape. Responses are built as plain dicts by the
API modules: the clients parse them, and dicts keep the SSE path cheap.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------- OpenAI chat / completions


class ContentPart(_Lenient):
    type: str
    text: str | None = None
    image_url: Any = None


class FunctionCallIn(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Lenient):
    id: str | None = None
    type: str = "function"
    function: FunctionCallIn


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    # Reasoning a client sends back from an earlier turn (vLLM / llama.cpp spelling, and OpenRouter's).
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDef(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatTool(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: dict[str, str]


class StreamOptions(_Lenient):
    include_usage: bool = False


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class SamplingFields(_Lenient):
    """Knobs shared by chat and text completions."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    # -1 asks for a random seed, as llama.cpp's server takes it; MLX's keys are 64-bit.
    seed: int | None = Field(default=None, ge=-1, lt=1 << 64)
    # OpenAI's own range: past +-100 a bias only bans or forces a token.
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)
    user: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(default=16, ge=1)  # the legacy API's own default
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


# ---------------------------------------------------------------- OpenAI Responses


class ResponsesRequest(_Lenient):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


# ---------------------------------------------------------------- Anthropic Messages


class AnthropicBlock(_Lenient):
    """One content block; which fields matter depends on `type`."""

    type: str
    text: str | None = None
    # tool_use
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    # tool_result
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    # thinking
    thinking: str | None = None
    signature: str | None = None
    # image: {"type": "base64", "media_type": ..., "data": ...} or {"type": "url", "url": ...}
    source: dict[str, Any] | None = None


class AnthropicMessage(_Lenient):
    role: Literal["user", "assistant"]
    content: str | list[AnthropicBlock]


class AnthropicTool(_Lenient):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # server tools (web_search_...) carry a type; custom ones do not


class AnthropicThinking(_Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class AnthropicToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(_Lenient):
    model: str | None = None
    messages: list[AnthropicMessage]
    system: str | list[AnthropicBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None
