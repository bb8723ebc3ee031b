"""Deterministic, seeded agentic text: nothing is fetched, the same seed gives the same bytes.

An agent's conversation, as a coding agent produces it: a long system prompt listing tools
(~2k tokens), a user task, then turns of an assistant answer (whose reasoning the client drops
before the next turn) followed by a tool result of a few hundred tokens. Sizes are aimed in
tokens through a characters-per-token estimate; the servers report the exact counts.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

CHARS_PER_TOKEN = 4.0  # English + code through a SentencePiece/BPE vocabulary, roughly

_NOUNS = ("file", "module", "function", "test", "cache", "request", "server", "config", "record",
          "buffer", "thread", "queue", "handler", "schema", "token", "index", "block", "layer",
          "session", "parser", "store", "writer", "client", "response", "field", "error", "path",
          "commit", "branch", "build", "package", "import", "argument", "value", "result", "loop")
_VERBS = ("reads", "writes", "checks", "returns", "parses", "updates", "restores", "evicts",
          "opens", "closes", "formats", "validates", "sends", "receives", "splits", "merges",
          "caches", "logs", "raises", "retries", "measures", "compares", "renders", "loads")
_ADJECTIVES = ("first", "last", "empty", "stale", "fresh", "large", "small", "missing", "shared",
               "local", "remote", "hot", "cold", "partial", "full", "pending", "cached", "broken")
_TOOL_NAMES = ("read_file", "write_file", "list_directory", "search_code", "run_tests",
               "run_command", "git_diff", "git_log", "open_url", "apply_patch", "grep",
               "find_symbol", "format_code", "lint", "build_project", "ask_user")
_PARAM_TYPES = ("string", "integer", "boolean", "array")
_EXTENSIONS = (".py", ".rs", ".ts", ".md", ".toml", ".json", ".go", ".c")


@dataclass(frozen=True)
class Turn:
    """One agent step: what the model 'said' (reasoning + answer) and the tool's reply."""

    reasoning: str
    answer: str
    tool_result: str


class AgenticText:
    """All text for one seed. Two instances with the same seed produce identical text."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    # --- small pieces -------------------------------------------------------------------------
    def _sentence(self) -> str:
        rng = self.rng
        words = [rng.choice(("The", "A", "Each", "This", "That")), rng.choice(_ADJECTIVES),
                 rng.choice(_NOUNS), rng.choice(_VERBS), "the", rng.choice(_ADJECTIVES),
                 rng.choice(_NOUNS)]
        if rng.random() < 0.5:
            words += ["before", "the", rng.choice(_NOUNS), rng.choice(_VERBS)]
        return " ".join(words) + "."

    def _paragraph(self, target_tokens: int) -> str:
        sentences: list[str] = []
        while sum(len(s) + 1 for s in sentences) < target_tokens * CHARS_PER_TOKEN:
            sentences.append(self._sentence())
        return " ".join(sentences)

    def _path(self) -> str:
        rng = self.rng
        parts = [rng.choice(("src", "lib", "tests", "docs")), rng.choice(_NOUNS),
                 rng.choice(_NOUNS) + "_" + rng.choice(_NOUNS) + rng.choice(_EXTENSIONS)]
        return "/".join(parts)

    def _code_line(self) -> str:
        rng = self.rng
        name = f"{rng.choice(_NOUNS)}_{rng.choice(_NOUNS)}"
        kind = rng.randrange(4)
        if kind == 0:
            return f"def {rng.choice(_VERBS)}_{name}(self, {rng.choice(_NOUNS)}: int) -> bool:"
        if kind == 1:
            return f"    {name} = self.{rng.choice(_NOUNS)}.{rng.choice(_VERBS)}({rng.randrange(4096)})"
        if kind == 2:
            return f"    if not {name}:  # {self._sentence().lower()}"
        return f"        return {rng.choice(('None', 'True', 'False', name))}"

    # --- the parts of a conversation --------------------------------------------------------
    def tool_definitions(self, count: int) -> list[dict]:
        rng = self.rng
        tools = []
        for index in range(count):
            name = _TOOL_NAMES[index % len(_TOOL_NAMES)] + ("" if index < len(_TOOL_NAMES)
                                                             else f"_{index}")
            params = {}
            for _ in range(rng.randrange(2, 5)):
                params[f"{rng.choice(_ADJECTIVES)}_{rng.choice(_NOUNS)}"] = {
                    "type": rng.choice(_PARAM_TYPES), "description": self._sentence()}
            tools.append({"type": "function", "function": {
                "name": name, "description": self._paragraph(40),
                "parameters": {"type": "object", "properties": params,
                               "required": sorted(params)[:1]}}})
        return tools

    def system_prompt(self, target_tokens: int = 2000) -> str:
        """Agent instructions followed by tool definitions, until about target_tokens."""
        lines = ["You are a coding agent working in a software repository. Think step by step, "
                 "call one tool at a time, and explain what you changed.",
                 self._paragraph(target_tokens // 8), "", "# Tools", ""]
        text = "\n".join(lines)
        tool_count = 1
        while len(text) < target_tokens * CHARS_PER_TOKEN:
            tool = self.tool_definitions(1)[0]
            tool["function"]["name"] = f"{_TOOL_NAMES[tool_count % len(_TOOL_NAMES)]}_{tool_count}"
            text += json.dumps(tool, separators=(",", ":")) + "\n"
            tool_count += 1
        return text

    def user_task(self, target_tokens: int = 60) -> str:
        return f"Task: in {self._path()}, " + self._paragraph(target_tokens)

    def assistant_answer(self, target_tokens: int = 120) -> tuple[str, str]:
        """(reasoning, answer): the answer ends with a tool call written as JSON."""
        reasoning = self._paragraph(target_tokens)
        call = {"name": self.rng.choice(_TOOL_NAMES), "arguments": {"path": self._path()}}
        answer = self._paragraph(target_tokens // 3) + "\n" + json.dumps({"tool_call": call})
        return reasoning, answer

    def tool_result(self, target_tokens: int = 400) -> str:
        """A file excerpt, a test log or a search listing, about target_tokens long."""
        rng = self.rng
        kind = rng.randrange(3)
        lines: list[str] = []
        limit = target_tokens * CHARS_PER_TOKEN
        while sum(len(line) + 1 for line in lines) < limit:
            if kind == 0:
                lines.append(self._code_line())
            elif kind == 1:
                status = rng.choice(("PASSED", "PASSED", "PASSED", "FAILED", "SKIPPED"))
                lines.append(f"{self._path()}::test_{rng.choice(_VERBS)}_{rng.choice(_NOUNS)} "
                             f"{status} [{rng.randrange(100)}%]")
            else:
                lines.append(f"{self._path()}:{rng.randrange(1, 900)}: {self._sentence()}")
        return "\n".join(lines)

    def turn(self, answer_tokens: int = 120, tool_tokens: int = 400) -> Turn:
        reasoning, answer = self.assistant_answer(answer_tokens)
        return Turn(reasoning=reasoning, answer=answer, tool_result=self.tool_result(tool_tokens))

    def question(self, target_tokens: int = 80) -> str:
        """A follow-up question for the multi-round QA workload."""
        return self._paragraph(target_tokens) + " Can you explain why, in a few sentences?"

    def long_document(self, target_tokens: int) -> str:
        """Mixed prose and code, for long single prompts."""
        parts: list[str] = []
        while sum(len(p) + 1 for p in parts) < target_tokens * CHARS_PER_TOKEN:
            parts.append(self._paragraph(60) if self.rng.random() < 0.5 else
                         "\n".join(self._code_line() for _ in range(8)))
        return "\n".join(parts)


def agent_messages(system: str, task: str, turns: list[Turn]) -> list[dict]:
    """The conversation as the client sends it after len(turns) steps: reasoning dropped, each
    answer followed by its tool result (as a user message: every chat template accepts that)."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
    for turn in turns:
        messages.append({"role": "assistant", "content": turn.answer})
        messages.append({"role": "user", "content": f"Tool result:\n{turn.tool_result}"})
    return messages
