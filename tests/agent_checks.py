"""What the agent tests check on the wire: the order of streamed events each client expects, usage
figures, and a tiny model the size of an agent's prompt. Shared by tests/test_agents_e2e.py (the
real agents) and its replay of tests/data/agent_traffic.json."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
# The name the tests serve the model under (its folder's name, which the server accepts).
MODEL_NAME = "rewind-tiny-agent"
AGENT_VOCAB = 8192


def build_agent_model(out_dir: Path) -> Path:
    """A tiny random llama sized for agents' prompts: a 128k context, one layer, and a byte-level
    BPE of 8192 tokens trained on this repository's README and Python sources. Claude Code's
    first request (system prompt, environment block, 12 tools) is ~50 KB of text: 31k tokens
    with the 512-token vocabulary of the other tiny models, 15k with this one; with one layer
    instead of four its prefill takes ~10 s on 2 cores instead of ~100 s."""
    import glob

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from rewind.testing.tiny_models import SPECIAL_TOKENS, build_tiny_model

    folder = out_dir / MODEL_NAME
    build_tiny_model("llama", folder, overrides={"max_position_embeddings": 131072,
                                                 "vocab_size": AGENT_VOCAB,
                                                 "num_hidden_layers": 1})
    sources = [ROOT / "README.md",
               *sorted(Path(p) for p in glob.glob(str(ROOT / "src/rewind/**/*.py"),
                                                  recursive=True))]
    lines = [line for path in sources for line in path.read_text().splitlines(keepends=True)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=AGENT_VOCAB, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(lines, trainer=trainer)
    small = Tokenizer.from_file(str(folder / "tokenizer.json"))
    # Special tokens come first in both, so config.json's bos/eos/pad ids stay right.
    for token in SPECIAL_TOKENS:
        assert tokenizer.token_to_id(token) == small.token_to_id(token), token
    tokenizer.post_processor = small.post_processor
    tokenizer.save(str(folder / "tokenizer.json"))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["model_max_length"] = 131072
    config_path.write_text(json.dumps(config, indent=2))
    return folder


def metric_totals(base_url: str) -> dict[str, float]:
    """A server's /metrics summed over labels, by sample name (e.g. rewind_requests_total)."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if match:
            totals[match[1]] = totals.get(match[1], 0.0) + float(match[3])
    return totals


def anthropic_stream_problems(events: list[tuple[str | None, Any]]) -> list[str]:
    """Where a Messages API stream departs from the order the SDKs expect: message_start, then
    blocks (start, deltas of the block's kind, stop) one after another with indices 0, 1, ...,
    one message_delta with a stop_reason, message_stop last; pings anywhere."""
    problems: list[str] = []
    kinds = [(data.get("type") if isinstance(data, dict) else None) for _, data in events]
    for (name, data), kind in zip(events, kinds):
        if name is not None and name != kind:
            problems.append(f"event name {name!r} carries data of type {kind!r}")
    seq = [(kind, data) for kind, (_, data) in zip(kinds, events) if kind != "ping"]
    if not seq or seq[0][0] != "message_start":
        return problems + [f"the stream starts with {seq[0][0] if seq else None!r}"]
    if seq[-1][0] != "message_stop":
        problems.append(f"the stream ends with {seq[-1][0]!r}, not message_stop")
    allowed = {"text": {"text_delta"}, "thinking": {"thinking_delta", "signature_delta"},
               "redacted_thinking": set(), "tool_use": {"input_json_delta"}}
    open_block: tuple[int, str] | None = None
    next_index, deltas = 0, 0
    for kind, data in seq[1:-1]:
        if kind == "content_block_start":
            block = data.get("content_block") or {}
            if open_block is not None:
                problems.append(f"block {data.get('index')} starts inside block {open_block[0]}")
            if data.get("index") != next_index:
                problems.append(f"block index {data.get('index')}, expected {next_index}")
            if block.get("type") not in allowed:
                problems.append(f"unknown block type {block.get('type')!r}")
            open_block = (data.get("index"), block.get("type"))
            next_index += 1
        elif kind == "content_block_delta":
            delta_type = (data.get("delta") or {}).get("type")
            if open_block is None or data.get("index") != open_block[0]:
                problems.append(f"a delta for block {data.get('index')} outside it")
            elif delta_type not in allowed.get(open_block[1], set()):
                problems.append(f"a {delta_type} in a {open_block[1]} block")
        elif kind == "content_block_stop":
            if open_block is None or data.get("index") != open_block[0]:
                problems.append(f"stop of block {data.get('index')} that is not open")
            open_block = None
        elif kind == "message_delta":
            deltas += 1
            if open_block is not None:
                problems.append("message_delta while a block is open")
            if not (data.get("delta") or {}).get("stop_reason"):
                problems.append("message_delta without a stop_reason")
        else:
            problems.append(f"unexpected event {kind!r}")
    if deltas != 1:
        problems.append(f"{deltas} message_delta events")
    return problems


RESPONSES_TERMINAL = {"response.completed", "response.incomplete", "response.failed"}


def responses_stream_problems(events: list[tuple[str | None, Any]]) -> list[str]:
    """Where a Responses API stream departs from the order codex and the SDKs expect:
    response.created, response.in_progress, then items (output_item.added ... output_item.done)
    one after another with output_index 0, 1, ..., their parts and deltas inside them, and one
    terminal event (completed / incomplete / failed) last; sequence_number counts up from 0."""
    problems: list[str] = []
    datas = [data for _, data in events if isinstance(data, dict)]
    if len(datas) != len(events):
        problems.append("an event whose data is not a JSON object")
    kinds = [data.get("type") for data in datas]
    for (name, _), kind in zip(events, kinds):
        if name is not None and name != kind:
            problems.append(f"event name {name!r} carries data of type {kind!r}")
    numbers = [data.get("sequence_number") for data in datas]
    if numbers != list(range(len(datas))):
        problems.append(f"sequence numbers {numbers[:5]}... do not count up from 0")
    if kinds[:2] != ["response.created", "response.in_progress"]:
        problems.append(f"the stream starts with {kinds[:2]}")
    if not kinds or kinds[-1] not in RESPONSES_TERMINAL:
        problems.append(f"the stream ends with {kinds[-1] if kinds else None!r}")
    if sum(kind in RESPONSES_TERMINAL for kind in kinds) != 1:
        problems.append("not exactly one terminal event")
    open_item: int | None = None
    open_part: tuple[int, int] | None = None
    next_index = 0
    for data, kind in zip(datas[2:-1], kinds[2:-1]):
        index = data.get("output_index")
        if kind == "response.output_item.added":
            if open_item is not None:
                problems.append(f"item {index} added inside item {open_item}")
            if index != next_index:
                problems.append(f"output_index {index}, expected {next_index}")
            open_item, next_index = index, next_index + 1
        elif kind == "response.output_item.done":
            if index != open_item or open_part is not None:
                problems.append(f"item {index} done while {open_item} / part {open_part} open")
            open_item = None
        elif kind == "response.content_part.added":
            if index != open_item or open_part is not None:
                problems.append(f"a part of item {index} added out of place")
            open_part = (index, data.get("content_index"))
        elif kind == "response.content_part.done":
            if open_part != (index, data.get("content_index")):
                problems.append(f"part {(index, data.get('content_index'))} done, not open")
            open_part = None
        elif kind.endswith((".delta", ".done")):
            if index != open_item:
                problems.append(f"{kind} for item {index} outside it")
        else:
            problems.append(f"unexpected event {kind!r}")
    if open_item is not None:
        problems.append(f"item {open_item} never done")
    return problems


def anthropic_usage(events: list[tuple[str | None, Any]]) -> tuple[dict, dict]:
    """(usage in message_start, usage in message_delta)."""
    start = next(d["message"]["usage"] for _, d in events
                 if isinstance(d, dict) and d.get("type") == "message_start")
    end = next(d["usage"] for _, d in events
               if isinstance(d, dict) and d.get("type") == "message_delta")
    return start, end


def responses_usage(events: list[tuple[str | None, Any]]) -> dict:
    return next(d["response"]["usage"] for _, d in events
                if isinstance(d, dict) and d.get("type") in RESPONSES_TERMINAL)


def cached_fraction_anthropic(usage: dict) -> float:
    cached = usage.get("cache_read_input_tokens") or 0
    return cached / max(1, cached + usage["input_tokens"])


def cached_fraction_responses(usage: dict) -> float:
    cached = (usage.get("input_tokens_details") or {}).get("cached_tokens") or 0
    return cached / max(1, usage["input_tokens"])


def _sse(events: list[dict[str, Any]]) -> bytes:
    return "".join(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
                   for event in events).encode()


def canned_anthropic_tool_use(name: str, arguments: dict[str, Any], model: str) -> bytes:
    """A Messages API stream whose answer is one tool call (what the tiny model never writes)."""
    usage = {"input_tokens": 1, "output_tokens": 1, "cache_read_input_tokens": 0,
             "cache_creation_input_tokens": 0}
    return _sse([
        {"type": "message_start", "message": {
            "id": "msg_canned", "type": "message", "role": "assistant", "model": model,
            "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}},
        {"type": "content_block_start", "index": 0, "content_block": {
            "type": "tool_use", "id": "toolu_canned_0001", "name": name, "input": {}}},
        {"type": "content_block_delta", "index": 0,
         "delta": {"type": "input_json_delta", "partial_json": json.dumps(arguments)}},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
         "usage": {**usage, "output_tokens": 20}},
        {"type": "message_stop"}])


def canned_responses_function_call(name: str, arguments: dict[str, Any], model: str) -> bytes:
    """A Responses API stream whose answer is one function call."""
    item = {"id": "fc_canned_0001", "type": "function_call", "call_id": "call_canned_0001",
            "name": name, "arguments": json.dumps(arguments), "status": "completed"}
    response = {"id": "resp_canned", "object": "response", "created_at": 0, "model": model,
                "status": "in_progress", "output": [], "usage": None}
    done = {**response, "status": "completed", "output": [item],
            "usage": {"input_tokens": 1, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": 20, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": 21}}
    events = [
        {"type": "response.created", "response": response},
        {"type": "response.in_progress", "response": response},
        {"type": "response.output_item.added", "output_index": 0,
         "item": {**item, "arguments": "", "status": "in_progress"}},
        {"type": "response.function_call_arguments.delta", "item_id": item["id"],
         "output_index": 0, "delta": item["arguments"]},
        {"type": "response.function_call_arguments.done", "item_id": item["id"],
         "output_index": 0, "arguments": item["arguments"]},
        {"type": "response.output_item.done", "output_index": 0, "item": item},
        {"type": "response.completed", "response": done}]
    return _sse([{**event, "sequence_number": n} for n, event in enumerate(events)])
