"""Request bodies of the three APIs, validated with pydantic.

Unknown fields are ignored (clients send many we have no use for); known fields are typed, so a
wrong type becomes a 400 in the API's own error shape. Responses are built as plain dicts by the
API modules: the clients parse them, and dicts keep the SSE path cheap.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag


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
    n: int = Field(default=1, ge=1, le=1)  # one choice a request
    user: str | None = None
    # vLLM's field: prefixes cached under one salt are never a hit under another.
    cache_salt: str | None = None
    # Ollama's: how long the model stays loaded after this request (30s, 15m, 0, -1 forever).
    keep_alive: str | float | None = None
    # Rewind's own: false keeps this request out of speculative decoding (the same answer, one
    # token a step).
    speculative: bool | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
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
    # One prompt: text, or token ids (a list of several prompts is refused).
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[str], Field(
        min_length=1, max_length=1)] | Annotated[list[int], Field(min_length=1)]
    max_tokens: int | None = Field(default=16, ge=1)  # the legacy API's own default
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


# ---------------------------------------------------------------- OpenAI Responses


class ResponsesPart(_Lenient):
    """A content part: input_text / output_text / summary_text / reasoning_text, or
    input_image (image_url: a data: URL, or http(s) where the server allows it)."""

    type: str
    text: str | None = None
    image_url: str | None = None


class ResponsesMessageItem(_Lenient):
    type: Literal["message"] = "message"  # clients' "easy input messages" carry no type
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ResponsesPart]


class ResponsesFunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: str | None = None
    name: str
    # A JSON object in a string, as the API sends it; some clients send the object itself.
    arguments: str | dict[str, Any] = "{}"


class ResponsesCustomToolCallItem(_Lenient):
    type: Literal["custom_tool_call"]
    call_id: str | None = None
    name: str
    input: str = ""


class ResponsesToolOutputItem(_Lenient):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str = ""
    output: str | list[ResponsesPart]


class ResponsesReasoningItem(_Lenient):
    type: Literal["reasoning"]
    content: list[ResponsesPart] | None = None
    summary: list[ResponsesPart] | None = None


def _item_type(item: Any) -> str | None:
    if isinstance(item, dict):
        kind = item.get("type", "message")
        return "tool_output" if kind in ("function_call_output", "custom_tool_call_output") \
            else kind
    return getattr(item, "type", None)


# Chosen by `type`, so a bad item's errors name only what its own type needs.
ResponsesItem = Annotated[
    Annotated[ResponsesMessageItem, Tag("message")]
    | Annotated[ResponsesFunctionCallItem, Tag("function_call")]
    | Annotated[ResponsesCustomToolCallItem, Tag("custom_tool_call")]
    | Annotated[ResponsesToolOutputItem, Tag("tool_output")]
    | Annotated[ResponsesReasoningItem, Tag("reasoning")],
    Discriminator(_item_type)]


class ResponsesTool(_Lenient):
    type: str  # "function" runs here; hosted tools (web_search, ...) are accepted and left out
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ResponsesNamedToolChoice(_Lenient):
    type: str = "function"
    name: str | None = None


class ResponsesReasoningConfig(_Lenient):
    effort: str | None = None  # "none" turns the template's thinking off
    summary: str | None = None


class ResponsesRequest(_Lenient):
    model: str | None = None
    keep_alive: str | float | None = None
    # Rewind's own: false keeps this request out of speculative decoding (the same answer, one
    # token a step).
    speculative: bool | None = None
    input: str | list[ResponsesItem]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = False  # null is false: some clients send unset fields as null
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    reasoning: ResponsesReasoningConfig | None = None
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
    # "system" is no role of Anthropic's API, but Claude Code 2.1 sends its environment block
    # as one (and retries without it when refused): placed where templates take it.
    role: Literal["user", "assistant", "system"]
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


class AnthropicOutputConfig(_Lenient):
    # low (or none) turns the template's thinking off, medium and above on, when `thinking`
    # does not say.
    effort: str | None = None


class CountTokensRequest(_Lenient):
    model: str | None = None
    keep_alive: str | float | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[AnthropicBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None
    output_config: AnthropicOutputConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    # Rewind's own: false keeps this request out of speculative decoding (the same answer, one
    # token a step).
    speculative: bool | None = None
    stream: bool = False
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    # Accepted and ignored: user ids mean nothing here, and this server keeps no tool results
    # to clear (context_management); cache_control on blocks is ignored too, since every
    # prefix is cached anyway.
    metadata: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None


class ModelActionRequest(_Lenient):
    """POST /v1/models/load and /v1/models/unload."""

    model: str = Field(min_length=1)
    keep_alive: str | float | None = None


class PullRequest(_Lenient):
    """POST /v1/models/pull: a Hugging Face repo to download into the hub cache."""

    # Any repo id, not only the names this server serves already (describe_bodies leaves it
    # open: see rewind.server.openapi.json_body).
    model: str = Field(min_length=1, max_length=200, description="ORG/NAME on the Hugging Face Hub")
    revision: str | None = Field(default=None, min_length=1, max_length=200,
                                 description="branch, tag or commit (default: main)")
