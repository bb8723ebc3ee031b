"""Load a model folder's tokenizer as mlx-lm does, without parsing tokenizer.json twice.

mlx-lm's `load_tokenizer` parses the whole tokenizer.json with Python's json module only to read
its "decoder" entry (which streaming detokenizer to use), then transformers parses the file
again in Rust, and mlx-lm asks transformers for the 262k-word vocabulary three times while it
infers thinking tags, structural markers and the tool parser. On the default model's 33 MB
tokenizer.json that is ~1.2 s, plus ~0.7 s, of a ~6 s start-up. This does the same with the
decoder read from the loaded tokenizer's own (Rust) decoder and the vocabulary built once;
everything else is mlx-lm's (TokenizerWrapper, its detokenizers, chat template and tool parser
modules), so the result is the object mlx-lm's loader returns.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any


def _decoder_of(tokenizer: Any) -> dict[str, Any] | None:
    """tokenizer.json's "decoder" entry, as the loaded fast tokenizer holds it."""
    backend = getattr(tokenizer, "_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return None
    return json.loads(decoder.__getstate__())


def _detokenizer_class(tokenizer: Any) -> Any:
    """The streaming detokenizer mlx-lm's loader picks for this decoder."""
    from mlx_lm import tokenizer_utils as tu

    decoder = _decoder_of(tokenizer)
    if decoder is not None:
        if tu._is_spm_decoder(decoder):
            return tu.SPMStreamingDetokenizer
        if tu._is_spm_decoder_no_space(decoder):
            return partial(tu.SPMStreamingDetokenizer, trim_space=False)
        if tu._is_bpe_decoder(decoder):
            return tu.BPEStreamingDetokenizer
    return tu.NaiveStreamingDetokenizer


@contextmanager
def _vocabulary_built_once(tokenizer: Any) -> Iterator[None]:
    """While mlx-lm inspects the tokenizer, get_vocab() returns one dict built once (nothing
    adds tokens meanwhile)."""
    vocabulary = tokenizer.get_vocab()
    tokenizer.get_vocab = lambda: vocabulary
    try:
        yield
    finally:
        del tokenizer.get_vocab


def load_tokenizer(model_path: Path, eos_token_ids: int | Sequence[int] | None = None) -> Any:
    """mlx_lm.utils.load_tokenizer(model_path, eos_token_ids=...) for a local folder."""
    from mlx_lm import tokenizer_utils as tu
    from mlx_lm.utils import _tokenizer_defaults
    from transformers import AutoTokenizer

    model_path = Path(model_path)
    defaults = _tokenizer_defaults(model_path) or {}
    if eos_token_ids is None:
        eos_token_ids = defaults.get("eos_token_ids")
    if isinstance(eos_token_ids, int):
        eos_token_ids = [eos_token_ids]

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    config = tokenizer.init_kwargs
    chat_template = response_format = None
    chat_template_type = config.get("chat_template_type", defaults.get("chat_template_type"))
    if chat_template_type:
        module = importlib.import_module(f"mlx_lm.chat_templates.{chat_template_type}")
        # As mlx-lm: a template in the checkpoint replaces only the default template.
        if "chat_template_type" in config or tokenizer.chat_template is None:
            chat_template = module.apply_chat_template
        response_format = getattr(module, "RESPONSE_FORMAT", None)

    with _vocabulary_built_once(tokenizer):
        tool_parser_type = config.get("tool_parser_type", defaults.get("tool_parser_type"))
        if tool_parser_type is None:
            tool_parser_type = tu._infer_tool_parser(tokenizer)
        tool_parser = tool_call_start = tool_call_end = None
        if tool_parser_type is not None:
            tool_module = importlib.import_module(f"mlx_lm.tool_parsers.{tool_parser_type}")
            tool_parser = tool_module.parse_tool_call
            tool_call_start = tool_module.tool_call_start
            tool_call_end = tool_module.tool_call_end
            config["tool_parser_type"] = tool_parser_type
        return tu.TokenizerWrapper(
            tokenizer,
            _detokenizer_class(tokenizer),
            eos_token_ids=eos_token_ids,
            chat_template=chat_template,
            tool_parser=tool_parser,
            tool_call_start=tool_call_start,
            tool_call_end=tool_call_end,
            response_format=response_format,
        )
