"""Build a Hugging Face tokenizer folder (tokenizer.json, tokenizer_config.json) from a GGUF vocabulary.

We reuse transformers' torch-free GGUF tokenizer builders (`integrations.gguf.gguf_tokenizer_mapping`):
they know Gemma's quirks (merges rebuilt from vocabulary order, multi-space tokens). Their own
metadata reader imports torch, so we hand them the vocabulary from our own GGUF reader instead.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rewind.models.gguf_file import GgufError, GgufFile

# Gemma's turn format; a base GGUF ships none. System text goes at the top of the first user turn
# (Gemma has no system role); `tool` results are shown to the model as a user turn.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}{%- set system_text = messages[0]['content'] -%}"
    "{%- else -%}{%- set system_text = messages[0]['content'] | selectattr('type', 'equalto', 'text') "
    "| map(attribute='text') | join('\\n') -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set system_text = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}"
    "{{ '<start_of_turn>' + role + '\\n' }}"
    "{%- if loop.first and system_text -%}{{ system_text | trim + '\\n\\n' }}{%- endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

_SPECIAL_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def tokenizer_dict(gguf: GgufFile) -> dict[str, Any]:
    """The vocabulary in the shape transformers' GGUF tokenizer builders take."""
    meta = gguf.metadata
    if "tokenizer.ggml.tokens" not in meta or "tokenizer.ggml.model" not in meta:
        raise GgufError(f"{gguf.path}: no tokenizer in the GGUF metadata (tokenizer.ggml.tokens/model)")
    result: dict[str, Any] = {
        "tokenizer_type": meta["tokenizer.ggml.model"],
        "pre_tokenizer_type": meta.get("tokenizer.ggml.pre"),
        "tokens": list(meta["tokenizer.ggml.tokens"]),
    }
    for key, name in (("scores", "scores"), ("token_type", "token_type")):
        if f"tokenizer.ggml.{key}" in meta:
            result[name] = meta[f"tokenizer.ggml.{key}"].tolist()
    if "tokenizer.ggml.merges" in meta:
        result["merges"] = list(meta["tokenizer.ggml.merges"])
    return result


# The tokenizer is all in tokenizer.json: transformers' generic fast class loads it as it is. Its
# model-specific classes rebuild it in Python (GemmaTokenizer: 2.5 s and 275 MB of RSS for the
# default model's 262k-word vocabulary, against 1.9 s and 110 MB).
GENERIC_TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def added_tokens_decoder(tokenizer_json: Path) -> dict[str, dict[str, Any]]:
    """tokenizer_config.json's `added_tokens_decoder` for a tokenizer.json: with it, transformers
    takes the added tokens from the config instead of parsing the whole tokenizer.json in Python
    once more (1.1 s of the default model's load)."""
    from tokenizers import Tokenizer

    added = Tokenizer.from_file(str(tokenizer_json)).get_added_tokens_decoder()
    return {str(index): {"content": token.content, "lstrip": token.lstrip,
                         "normalized": token.normalized, "rstrip": token.rstrip,
                         "single_word": token.single_word, "special": token.special}
            for index, token in sorted(added.items())}


def upgrade_tokenizer_config(folder: Path) -> None:
    """Bring an earlier conversion's tokenizer_config.json up to what write_tokenizer writes
    now: the generic class and the added tokens (atomic; a folder without one is left alone)."""
    config_path = folder / "tokenizer_config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return
    changes: dict[str, Any] = {}
    if config.get("tokenizer_class") != GENERIC_TOKENIZER_CLASS:
        changes["tokenizer_class"] = GENERIC_TOKENIZER_CLASS
    if "added_tokens_decoder" not in config and (folder / "tokenizer.json").exists():
        changes["added_tokens_decoder"] = added_tokens_decoder(folder / "tokenizer.json")
    if not changes:
        return
    partial = config_path.with_name(f".{config_path.name}.{os.getpid()}")
    partial.write_text(json.dumps(config | changes, indent=2, ensure_ascii=False))
    os.replace(partial, config_path)


def write_tokenizer(gguf: GgufFile, out_dir: Path, arch: str) -> None:
    """Write tokenizer.json and tokenizer_config.json (with a chat template) into out_dir."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        add_gguf_special_tokens,
        select_tokenizer_builder,
        set_split_regex,
    )

    vocab = tokenizer_dict(gguf)
    try:
        builder = select_tokenizer_builder(arch, vocab["tokenizer_type"])
    except ValueError as exc:
        raise GgufError(f"{gguf.path}: {exc}") from exc
    tokenizer = set_split_regex(add_gguf_special_tokens(builder(vocab), vocab), vocab)
    for attribute, key in _SPECIAL_IDS.items():
        token_id = gguf.metadata.get(key)
        if token_id is not None and 0 <= int(token_id) < len(vocab["tokens"]):
            setattr(tokenizer, attribute, vocab["tokens"][int(token_id)])
    add_bos = bool(gguf.metadata.get("tokenizer.ggml.add_bos_token", vocab["tokenizer_type"] == "llama"))
    tokenizer.add_bos_token = add_bos
    tokenizer.add_eos_token = False  # llama.cpp sets the flag on Gemma, but never appends EOS to a prompt
    if hasattr(tokenizer, "update_post_processor"):
        tokenizer.update_post_processor()
    tokenizer.save_pretrained(str(out_dir))

    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["add_bos_token"] = add_bos
    config["add_eos_token"] = False
    config["tokenizer_class"] = GENERIC_TOKENIZER_CLASS
    config["added_tokens_decoder"] = added_tokens_decoder(out_dir / "tokenizer.json")
    chat_template = gguf.metadata.get("tokenizer.chat_template")
    if not chat_template and arch.startswith("gemma"):
        chat_template = GEMMA_CHAT_TEMPLATE
    if chat_template:
        config["chat_template"] = chat_template
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))
