"""Text families beyond the three every cache test runs: Gemma 4 (KV-shared layers, per-layer
input embeddings, window + global layers of different head sizes) and Llama 3.1+ rope scaling.
Each runs on the engine's own thread, batched and through the prompt cache, and must give the
tokens plain batch-1 greedy decoding gives."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from rewind.cache import PromptCache
from rewind.config import CacheConfig, EngineConfig
from rewind.engine import Engine, GenerationRequest, SamplingParams
from rewind.engine.forward import last_logits
from rewind.kernels.model_split import split_model
from rewind.kernels.native_forward import native_forward
from rewind.models.loader import load_model
from rewind.testing.tiny_models import build_tiny_model

TIMEOUT = 120
TEXT = ("An agent reads a long conversation again and again, and each turn adds a tool result. "
        "def fibonacci(n: int) -> int:\n    a, b = 0, 1\n    return a\n") * 6
LLAMA3_ROPE = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 256}}


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def reference_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """Plain batch-1 greedy decoding on the calling thread, written independently of the engine
    (no end-of-sequence: the engine runs below with the same token budget)."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[:, -1, :]
    out: list[int] = []
    while len(out) < max_tokens:
        out.append(int(mx.argmax(logits, axis=-1).item()))
        logits = model(mx.array([[out[-1]]]), cache=cache)[:, -1, :]
    return out


def no_eos(loaded) -> dict[int, float]:
    return {int(t): -1e9 for t in Engine(loaded).eos_token_ids}


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory: pytest.TempPathFactory):
    return load_model(str(build_tiny_model("gemma4", tmp_path_factory.mktemp("gemma4"))))


@pytest.fixture(scope="module")
def llama3_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama3-rope"), overrides=LLAMA3_ROPE)


def test_gemma4_batched_on_the_engine_equals_plain_greedy(gemma4) -> None:
    tokenizer = gemma4.tokenizer
    prompts = [tokenizer.encode(TEXT), tokenizer.encode("The quick brown fox " * 5),
               tokenizer.encode(TEXT[:150])]
    assert len(prompts[0]) > 256  # crosses the 64-token window and a 256-token cache step
    lengths = [12, 7, 10]
    bias = no_eos(gemma4)
    with Engine(gemma4, EngineConfig(parallel=3, prefill_chunk=128)) as engine:
        handles = [engine.submit(GenerationRequest(p, SamplingParams(
            temperature=0.0, max_tokens=n, logit_bias=bias))) for p, n in zip(prompts, lengths)]
        results = [h.collect(TIMEOUT) for h in handles]
    for prompt, n, result in zip(prompts, lengths, results):
        assert result.tokens == reference_greedy(gemma4.model, prompt, n)
    assert len({tuple(r.tokens[:4]) for r in results}) == len(prompts)


def test_gemma4_prompt_cache_gives_the_uncached_answer(gemma4, tmp_path: Path) -> None:
    """A repeat restores all but the last token, the next turn restores past the answer, and a
    restore from the disk tier alone (RAM budget of one byte) gives the same tokens."""
    tokenizer = gemma4.tokenizer
    turn1 = tokenizer.encode(TEXT)
    with Engine(gemma4, EngineConfig(parallel=2)) as engine:
        uncached = engine.generate(GenerationRequest(turn1, greedy(10)), TIMEOUT)
    for ram_bytes in (256 << 20, 1):
        prompt_cache = PromptCache(gemma4.model, gemma4.fingerprint,
                                   CacheConfig(cache_dir=tmp_path / str(ram_bytes),
                                               disk_bytes=64 << 20, ram_bytes=ram_bytes))
        try:
            with Engine(gemma4, EngineConfig(parallel=2), prompt_cache) as engine:
                first = engine.generate(GenerationRequest(turn1, greedy(10)), TIMEOUT)
                prompt_cache.flush()
                repeat = engine.generate(GenerationRequest(turn1, greedy(10)), TIMEOUT)
                turn2 = turn1 + first.tokens + tokenizer.encode(" and one more question",
                                                                add_special_tokens=False)
                second = engine.generate(GenerationRequest(turn2, greedy(8)), TIMEOUT)
        finally:
            prompt_cache.close()
        assert first.tokens == uncached.tokens
        assert repeat.tokens == uncached.tokens
        assert repeat.finish.usage.cached_tokens == len(turn1) - 1
        assert second.finish.usage.cached_tokens == len(turn1) + len(first.tokens) - 1
        if ram_bytes == 1:
            assert repeat.finish.usage.cached_disk_tokens > 0
        assert second.tokens == reference_greedy(gemma4.model, turn2, 8)


@pytest.mark.parametrize("native", ["default", "off"])
def test_llama3_rope_scaling_on_the_engine_thread(llama3_folder: Path, native: str) -> None:
    """mlx-lm's Llama3RoPE keeps its periods as a lazy array built at load time; the engine's
    thread must still compute with it (through the C kernels where they are installed, and
    through MLX's layers)."""
    loaded = load_model(str(llama3_folder), native_forward=None if native == "default" else "off")
    if native == "off":
        assert native_forward(loaded.model) is None
    prompt = loaded.tokenizer.encode(TEXT)
    with Engine(loaded, EngineConfig(parallel=2)) as engine:
        result = engine.generate(GenerationRequest(prompt, SamplingParams(
            temperature=0.0, max_tokens=12, logit_bias=no_eos(loaded))), TIMEOUT)
    assert result.tokens == reference_greedy(loaded.model, prompt, 12)
    assert len(set(result.tokens)) > 2


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory: pytest.TempPathFactory):
    return load_model(str(build_tiny_model(
        "gemma3", tmp_path_factory.mktemp("gemma2"),
        overrides={"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"],
                   "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0})))


@pytest.mark.parametrize("family", ["gemma4", "gemma2"])
def test_soft_capped_families_compute_only_the_last_logits(request, family: str) -> None:
    """Gemma 2 and 4 soft-cap their logits after the head: the split knows it, so a prefill
    computes no logits and the last position's equal the full model's."""
    loaded = request.getfixturevalue(family)
    split = split_model(loaded.model)
    assert split is not None and split.softcap == 30.0
    tokens = mx.array([loaded.tokenizer.encode(TEXT)[:150]])
    full = loaded.model(tokens, cache=make_prompt_cache(loaded.model))[:, -1, :]
    fast = last_logits(loaded.model, tokens, make_prompt_cache(loaded.model))
    assert float(mx.abs(full).max()) <= 30.0
    assert float(mx.abs(fast - full).max()) < 1e-4


# Families whose call is backbone then head (rewind.engine.forward), built from the tiny llama's
# sizes with what each needs besides.
BACKBONE_THEN_HEAD = {
    "olmo2": {},
    "smollm3": {"no_rope_layer_interval": 4},
    "phi3": {},
    "glm4": {"attention_bias": True, "partial_rotary_factor": 0.5},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True},
    "qwen3_next": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1,
                   "mlp_only_layers": [], "norm_topk_prob": True, "full_attention_interval": 2,
                   "linear_num_value_heads": 4, "linear_num_key_heads": 2,
                   "linear_key_head_dim": 32, "linear_value_head_dim": 32,
                   "linear_conv_kernel_dim": 4, "partial_rotary_factor": 0.5},
}


@pytest.mark.parametrize("family", sorted(BACKBONE_THEN_HEAD))
def test_more_families_compute_only_the_last_logits(tmp_path: Path, family: str) -> None:
    folder = build_tiny_model("llama", tmp_path, overrides={"model_type": family,
                                                            **BACKBONE_THEN_HEAD[family]})
    model = load_model(str(folder)).model
    assert split_model(model) is not None
    tokens = mx.array([list(range(3, 140))])
    full = model(tokens, cache=make_prompt_cache(model))[:, -1, :]
    fast = last_logits(model, tokens, make_prompt_cache(model))
    assert float(mx.abs(fast - full).max()) < 1e-4 * max(1.0, float(mx.abs(full).max()))
