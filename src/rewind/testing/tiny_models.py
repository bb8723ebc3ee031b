"""Tiny deterministic random-weight models, one per cache family, for fast tests.

`build_tiny_model(family, out_dir)` writes an mlx-lm model folder (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json with a chat template that has <think> tags) in well under a
second, so every test can exercise the real model code and the real cache classes:

    llama    full attention only                        -> KVCache per layer
    gemma3   gemma3_text, sliding window 64 + global    -> RotatingKVCache and KVCache
    qwen3_5  gated delta net linear attention + global  -> ArraysCache and KVCache

Everything is seeded, so two builds give byte-identical weights and the same tokenizer.
Weights are scaled up from mlx's default init: with the default init the logits are nearly
uniform and greedy decoding settles on one token, which would make cache-equivalence tests
that compare greedy sequences pass trivially.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FAMILIES = ("llama", "gemma3", "qwen3_5")
# Built on request, outside the families every cache test runs: Gemma 4's text model (sliding
# window + global layers with their own head sizes, the last layers reading earlier layers' KV,
# per-layer input embeddings).
EXTRA_FAMILIES = ("gemma4",)

SEED = 1234
VOCAB_SIZE = 512  # byte-level BPE: 256 byte symbols + merges + special tokens
HIDDEN_SIZE = 64
# How much the init is scaled: enough that greedy sequences vary, small enough to stay finite.
WEIGHT_GAIN = 2.0

BOS, EOS, PAD = "<bos>", "<eos>", "<pad>"
TURN_START, TURN_END = "<|im_start|>", "<|im_end|>"
THINK_START, THINK_END = "<think>", "</think>"
SPECIAL_TOKENS = [PAD, BOS, EOS, TURN_START, TURN_END, THINK_START, THINK_END]

# ChatML with reasoning: an assistant turn's `reasoning_content` is rendered inside <think> tags
# only for turns after the last user message (as Qwen 3 does), so earlier reasoning is dropped
# from the prompt. That is the agentic pattern the prompt cache must handle.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}"
    "{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and m.get('reasoning_content') and loop.index0 > ns.last_user %}"
    "<think>\n{{ m['reasoning_content'] }}\n</think>\n\n"
    "{% endif %}"
    "{{ m['content'] if m['content'] is string else '' }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking %}<think>\n{% endif %}"
    "{% endif %}"
)

# Training text for the tokenizer: varied English, code and JSON so that prompts in tests
# (chat, tool calls) tokenize into ordinary merges rather than raw bytes.
TRAINING_TEXT = """\
The Eiffel Tower is located in the city of Paris, the capital of France.
An agent reads a long conversation again and again, and each turn adds a tool result or a message.
The cache keeps checkpoints every 256 tokens, so the next turn recomputes only what is new.
Sliding window layers keep the last positions; linear attention layers keep a recurrent state.
def fibonacci(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
{"name": "get_weather", "arguments": {"city": "Berlin", "unit": "celsius"}}
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
Hello! How can I help you today? Please think step by step, then answer briefly.
User: what is two plus two? Assistant: two plus two is four.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828
Once upon a time there was a small model that answered every question with a story.
The weather in Berlin is cloudy with light rain; tomorrow it will be sunny and warm.
"""


def _family_config(family: str) -> dict[str, Any]:
    common = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN_SIZE,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }
    if family == "llama":
        return {
            **common,
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "num_hidden_layers": 4,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "rope_theta": 10000.0,
        }
    if family == "gemma3":
        return {
            **common,
            "model_type": "gemma3_text",
            "architectures": ["Gemma3ForCausalLM"],
            # Pattern 3 over 6 layers: layers 2 and 5 are global, the others slide over 64 tokens.
            "num_hidden_layers": 6,
            "sliding_window": 64,
            "sliding_window_pattern": 3,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "query_pre_attn_scalar": 64,
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
        }
    if family == "qwen3_5":
        return {
            **common,
            "model_type": "qwen3_5",
            # Interval 2 over 4 layers: linear, full, linear, full.
            "num_hidden_layers": 4,
            "full_attention_interval": 2,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "rope_parameters": {
                "type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        }
    if family == "gemma4":
        return {
            **common,
            "model_type": "gemma4_text",
            "architectures": ["Gemma4ForCausalLM"],
            # Pattern 3 over 6 layers (global: 2 and 5); layers 4 and 5 reuse the KV of the last
            # earlier layer of their kind, so only 4 layers have caches.
            "num_hidden_layers": 6,
            "sliding_window": 64,
            "sliding_window_pattern": 3,
            "num_kv_shared_layers": 2,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "global_head_dim": 64,
            "hidden_size_per_layer_input": 16,
            "vocab_size_per_layer_input": VOCAB_SIZE,
        }
    known = ", ".join((*FAMILIES, *EXTRA_FAMILIES))
    raise ValueError(f"unknown tiny model family {family!r}; choose one of {known}")


def train_tokenizer(out_dir: Path, special_tokens: list[str] | None = None,
                    extra_config: dict | None = None) -> dict[str, int]:
    """A byte-level BPE trained on TRAINING_TEXT, saved with its tokenizer_config.json (plus
    `extra_config`); returns the special tokens' ids."""
    special_tokens = special_tokens or SPECIAL_TOKENS
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    ids = {token: tokenizer.token_to_id(token) for token in special_tokens}
    # Like Llama and Gemma: plain encoding starts with <bos>; the chat template writes its own.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, ids[BOS])]
    )
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": TURN_END,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": True,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        **(extra_config or {}),
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return ids


def _scale_init(model: Any) -> None:
    """Multiply every matrix by WEIGHT_GAIN (norm weights stay ones) so logits are not flat."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    scaled = [
        (name, value * WEIGHT_GAIN if value.ndim >= 2 else value)
        for name, value in tree_flatten(model.parameters())
    ]
    model.update(tree_unflatten(scaled))
    mx.eval(model.parameters())


def build_tiny_model(family: str, out_dir: Path, seed: int = SEED,
                     overrides: dict | None = None, dtype: str = "float32") -> Path:
    """Write a tiny random-weight mlx-lm model of `family` into `out_dir` and return `out_dir`.

    `overrides` replaces config fields, e.g. to build a random model of a real model's size for
    speed measurements (the weights stay random, so only timings mean anything). `dtype`: the
    weights' type on disk ("bfloat16" as real checkpoints, which the CPU path reads in place)."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes, save_config, save_model

    config = {**_family_config(family), **(overrides or {})}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    special_ids = train_tokenizer(out_dir)
    config["bos_token_id"] = special_ids[BOS]
    config["eos_token_id"] = [special_ids[TURN_END], special_ids[EOS]]
    config["pad_token_id"] = special_ids[PAD]

    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mx.float32)
    _scale_init(model)
    if dtype != "float32":
        model.set_dtype(getattr(mx, dtype))
    save_model(out_dir, model)
    save_config(config, out_dir / "config.json")
    return out_dir
