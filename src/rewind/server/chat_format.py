"""Chat messages -> prompt token ids, with the positions worth a prompt-cache checkpoint.

Every API converts its own message shapes into one neutral form (Hugging Face chat-template
dicts: role, content text, tool_calls with `arguments` as a dict, tool_call_id, reasoning_content)
and calls `ChatFormatter.render`. Templates that know nothing of tools (Gemma 3's) get the tool
list as a system prompt in the `<tool_call>{json}</tool_call>` convention, and tool traffic as
plain text, so tool calling works with every model.

Checkpoints: the next turn of a conversation diverges from this prompt either at its end (the
assistant's answer is appended as sent) or at the end of the last user / tool message (when the
client drops or rewrites the reasoning, or the template re-renders the last assistant turn). Both
positions go to the engine, which snapshots the cache there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from rewind.server.errors import bad_request
from rewind.server.tool_parsing import OutputFormat

Message = dict[str, Any]


@dataclass
class ChatPrompt:
    tokens: list[int]
    checkpoints: list[int] = field(default_factory=list)
    start_in_reasoning: bool = False  # the generation prompt opened a think block
    # Image requests: rewind.vision.prompting.ImagePrompt (expanded tokens, image hashes, the
    # embedding function); `tokens` and `checkpoints` are then the expanded ones.
    image_prompt: Any = None


def tool_system_prompt(tools: list[dict[str, Any]], tool_choice: str | None) -> str:
    """The Hermes / Qwen convention, for templates that cannot render tools themselves."""
    lines = [json.dumps(tool.get("function", tool), ensure_ascii=False) for tool in tools]
    text = (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + "\n".join(lines)
        + "\n</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
    if tool_choice == "required":
        text += "\n\nYou must call at least one function."
    elif tool_choice and tool_choice not in ("auto", "none"):
        text += f"\n\nYou must call the function {tool_choice}."
    return text


def _as_plain_text(messages: list[Message]) -> list[Message]:
    """Tool calls and tool results as text, later system messages as user text, consecutive
    same-role messages merged (templates like Gemma's insist on one leading system prompt and
    alternating user / assistant turns)."""
    out: list[Message] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "system" and out and out[-1]["role"] != "system":
            role = "user"  # such templates take one system prompt, first (codex sends more)
        if role == "tool":
            role = "user"
            content = f"<tool_response>\n{content}\n</tool_response>"
        elif role == "assistant" and message.get("tool_calls"):
            calls = [
                "<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                              "arguments": c["function"]["arguments"]},
                                             ensure_ascii=False) + "\n</tool_call>"
                for c in message["tool_calls"]
            ]
            content = "\n".join(([content] if content else []) + calls)
        if out and out[-1]["role"] == role:
            out[-1]["content"] = f"{out[-1]['content']}\n\n{content}"
        else:
            out.append({"role": role, "content": content})
    return out


def _with_system_text(messages: list[Message], text: str) -> list[Message]:
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{text}".strip()
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class ChatFormatter:
    def __init__(self, tokenizer: Any, fmt: OutputFormat) -> None:
        self.tokenizer = tokenizer
        self.fmt = fmt

    def render(self, messages: list[Message], tools: list[dict[str, Any]] | None = None, *,
               tool_choice: str | None = None,
               template_kwargs: dict[str, Any] | None = None) -> ChatPrompt:
        """Messages (neutral form) and OpenAI-style tool definitions -> prompt tokens."""
        if not messages:
            raise bad_request("messages must not be empty", param="messages")
        messages = [dict(m, role="system" if m["role"] == "developer" else m["role"])
                    for m in messages]
        if tool_choice == "none":
            tools = None
        if not self.fmt.native_tools:
            messages = _as_plain_text(messages)
            if tools:
                messages = _with_system_text(messages, tool_system_prompt(tools, tool_choice))
                tools = None
        # A trailing assistant message is a prefill to continue, not a turn to answer.
        continue_final = messages[-1]["role"] == "assistant"
        kwargs = _checked_template_kwargs(template_kwargs)
        if tools:
            kwargs["tools"] = tools
        final_kwargs = {"continue_final_message": True} if continue_final else {}
        full_text = self._template(messages, add_generation_prompt=not continue_final,
                                   **final_kwargs, **kwargs)
        tokens = self.encode(full_text)
        checkpoints = [len(tokens)]
        turn_text = full_text
        if not continue_final:
            # Where the last user / tool message ends: the prompt without the generation prompt.
            turn_text = self._template(messages, add_generation_prompt=False, **kwargs)
            turn_end = _common_prefix(self.encode(turn_text), tokens)
            if 0 < turn_end < len(tokens):
                checkpoints.insert(0, turn_end)
        generation_prompt = full_text[len(turn_text):] if full_text.startswith(turn_text) else ""
        return ChatPrompt(tokens, checkpoints, self._opens_reasoning(generation_prompt))

    def encode(self, text: str) -> list[int]:
        # The template wrote the special tokens (BOS included) itself.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _template(self, messages: list[Message], **kwargs: Any) -> str:
        if not getattr(self.tokenizer, "has_chat_template", False):
            return _plain_transcript(messages, kwargs.get("add_generation_prompt", True))
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        except Exception as exc:  # jinja's raise_exception and TemplateError carry the reason
            raise bad_request(f"the model's chat template rejected the messages: {exc}",
                              param="messages") from exc

    def _opens_reasoning(self, generation_prompt: str) -> bool:
        start, end = self.fmt.think_start, self.fmt.think_end
        if not start or not end:
            return False
        return generation_prompt.rfind(start) > generation_prompt.rfind(end)


# Arguments of transformers' apply_chat_template (and the template's own `messages`): the server
# sets these itself, and a client's value would clash with it or change what comes back.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def _checked_template_kwargs(template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(template_kwargs or {}))
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}: the server "
                          "sets these itself", param="chat_template_kwargs")
    return dict(template_kwargs or {})


def _plain_transcript(messages: list[Message], add_generation_prompt: bool) -> str:
    """For models without a chat template: a simple role-prefixed transcript."""
    text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages)
    return text + ("assistant:" if add_generation_prompt else "")
