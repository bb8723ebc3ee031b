"""The prompt cache never changes the answer.

For every tiny family (full attention, sliding window 64, gated-delta hybrid) and the real
Gemma 3 270M: the greedy tokens with the cache equal those without it, and every logit row
(the prompt's last position and each decode step) matches within LOGIT_ATOL. The tolerance
covers only float rounding from chunk shapes: a restored prefix ends the prefill at another
position than a cold one, so the suffix runs in other matmul shapes. Where the chunking is the
same the results are bit for bit equal (tests/test_records.py checks that).

Prefill is driven by rewind.engine.single.prefill_with_cache, the way the engine drives PromptCache:
chunks end on 256-token boundaries, message boundaries and len - 1, with a checkpoint at each.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from rewind.cache import BlockExtras, PromptCache
from rewind.engine.single import prefill_with_cache
from rewind.config import CacheConfig

LOGIT_ATOL = 1e-4  # tiny float32 models: logits of magnitude ~1-10
REAL_LOGIT_ATOL = 5e-3  # Gemma 3 270M: 18 layers, vocabulary of 262k; see test_real_model
DECODE_STEPS = 4

WORDS = (
    "the agent reads a file and calls a tool then writes the answer with care while the cache "
    "keeps every block of tokens so that the next turn starts from where the last one diverged "
    "weather in berlin is cloudy paris is sunny numbers one two three four five six seven"
).split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def agent_session(seed: int = 0, scale: int = 1) -> list[list[dict[str, Any]]]:
    """Message lists of four turns of an agent loop. Turn 2 appends a tool result after the
    assistant's reasoning and tool call; turn 3 follows a new user message, so the chat
    template drops turn 2's reasoning (a rewind); turn 4 appends again."""
    rng = random.Random(seed)
    system = {"role": "system", "content": _text(rng, 260 * scale)}
    user1 = {"role": "user", "content": _text(rng, 40 * scale)}
    call = {
        "role": "assistant",
        "reasoning_content": _text(rng, 90 * scale),
        "content": '{"name": "read_file", "arguments": {"path": "notes.txt"}}',
    }
    tool = {"role": "tool", "content": _text(rng, 60 * scale)}
    answer = {"role": "assistant", "reasoning_content": _text(rng, 50), "content": _text(rng, 30)}
    user2 = {"role": "user", "content": _text(rng, 30 * scale)}
    answer2 = {"role": "assistant", "content": _text(rng, 20)}
    user3 = {"role": "user", "content": _text(rng, 25)}
    return [
        [system, user1],
        [system, user1, call, tool],
        [system, user1, call, tool, answer, user2],
        [system, user1, call, tool, answer, user2, answer2, user3],
    ]


@dataclass
class Prompt:
    tokens: list[int]
    boundaries: list[int]  # message boundaries: checkpoints, as the server would send them


def render(tokenizer: Any, messages: list[dict[str, Any]]) -> Prompt:
    tokens = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    boundaries = []  # message starts, and the end of the last message (before the reply)
    for count in range(1, len(messages) + 1):
        prefix = list(tokenizer.apply_chat_template(messages[:count], add_generation_prompt=False))
        if tokens[: len(prefix)] == prefix:  # the template renders this prefix stably
            boundaries.append(len(prefix))
    return Prompt(tokens, boundaries)


@dataclass
class Answer:
    tokens: list[int]
    logits: mx.array  # [1 + DECODE_STEPS, vocab]
    restored: int
    ram_tokens: int
    disk_tokens: int


def answer(model: Any, prompt: Prompt, cache: PromptCache | None, **kwargs: Any) -> Answer:
    prefilled = prefill_with_cache(model, prompt.tokens, cache, checkpoints=prompt.boundaries, **kwargs)
    logits, rows, tokens = prefilled.logits, [prefilled.logits], []
    for _ in range(DECODE_STEPS):
        token = int(mx.argmax(logits, axis=-1).item())
        tokens.append(token)
        logits = model(mx.array([[token]]), cache=prefilled.cache)[:, -1, :]
        rows.append(logits)
    stacked = mx.concatenate(rows)
    mx.eval(stacked)
    restored = prefilled.restored
    return Answer(
        tokens,
        stacked,
        restored.tokens if restored else 0,
        restored.ram_tokens if restored else 0,
        restored.disk_tokens if restored else 0,
    )


class Reference:
    """Answers without any cache, computed once per prompt."""

    def __init__(self, model: Any, atol: float = LOGIT_ATOL) -> None:
        self.model, self.atol = model, atol
        self._answers: dict[tuple[int, ...], Answer] = {}

    def check(self, prompt: Prompt, got: Answer) -> None:
        key = tuple(prompt.tokens)
        if key not in self._answers:
            self._answers[key] = answer(self.model, prompt, None)
        want = self._answers[key]
        assert got.tokens == want.tokens
        difference = float(mx.abs(got.logits - want.logits).max())
        assert difference <= self.atol, f"logits differ by {difference}"


@dataclass
class Tiny:
    model: Any
    prompts: list[Prompt]
    reference: Reference


_tiny_cache: dict[str, Tiny] = {}


@pytest.fixture
def tiny(tiny_model_path: Callable[[str], Path], tiny_family: str) -> Tiny:
    if tiny_family not in _tiny_cache:
        model, tokenizer = load(str(tiny_model_path(tiny_family)))
        prompts = [render(tokenizer, messages) for messages in agent_session()]
        _tiny_cache[tiny_family] = Tiny(model, prompts, Reference(model))
    return _tiny_cache[tiny_family]


def ram_only(**overrides: Any) -> CacheConfig:
    return CacheConfig(disk_enabled=False, **overrides)


def with_disk(folder: Path, **overrides: Any) -> CacheConfig:
    return CacheConfig(cache_dir=folder, disk_bytes=overrides.pop("disk_bytes", 256 << 20), **overrides)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ---- the paths --------------------------------------------------------------------------------


def test_session_sizes(tiny: Tiny) -> None:
    """The session really exercises blocks: prompts of 600-1500 tokens, not ending on a block
    boundary, and a rewind that diverges before the previous prompt's end."""
    lengths = [len(p.tokens) for p in tiny.prompts]
    assert 600 <= lengths[0] and lengths[-1] <= 1500, lengths
    assert all(n % 256 for n in lengths)
    first, second, third = (p.tokens for p in tiny.prompts[:3])
    assert common_prefix(second, first) == len(first)  # turn 2 extends turn 1
    assert common_prefix(third, second) < len(second) - 50  # turn 3 drops reasoning


def test_agent_session_from_ram(tiny: Tiny) -> None:
    """Exact repeat, new turn appended, rewind, prompts ending inside a block; RAM tier only."""
    cache = PromptCache(tiny.model, "tiny", ram_only())
    first, second, third, fourth = tiny.prompts
    cold = answer(tiny.model, first, cache)
    tiny.reference.check(first, cold)
    assert cold.restored == 0

    repeat = answer(tiny.model, first, cache)
    tiny.reference.check(first, repeat)
    assert repeat.restored == len(first.tokens) - 1  # everything but the token to sample from

    seen = [first.tokens]
    for prompt in (second, third, fourth):
        got = answer(tiny.model, prompt, cache)
        tiny.reference.check(prompt, got)
        shared = max(common_prefix(prompt.tokens, old) for old in seen)
        # Restored up to the last checkpoint inside the shared prefix: recompute is the new
        # content plus less than one block, and here a message boundary makes it exact.
        assert shared - 256 < got.restored <= shared
        boundary = max(b for b in prompt.boundaries if b <= shared)
        assert got.restored >= boundary
        assert got.ram_tokens == got.restored and got.disk_tokens == 0
        seen.append(prompt.tokens)
    stats = cache.stats()
    assert stats["tokens_restored_ram"] > 0 and stats["tokens_restored_disk"] == 0
    assert stats["tokens_recomputed"] + stats["tokens_restored"] == stats["tokens_requested"]
    cache.close()


def test_disk_hit_after_ram_eviction(tiny: Tiny, tmp_path: Path) -> None:
    cache = PromptCache(tiny.model, "tiny", with_disk(tmp_path))
    first, second = tiny.prompts[:2]
    answer(tiny.model, first, cache)
    cache.ram.set_budget(0)  # evict the whole RAM tier: everything spills to the scratch file
    cache.flush()
    assert cache.ram.stats()["entries"] == 0 and cache.store.stats()["records_written"] > 0
    cache.ram.set_budget(1 << 30)
    got = answer(tiny.model, second, cache)
    tiny.reference.check(second, got)
    assert got.restored == len(first.tokens) - 1
    assert got.disk_tokens == got.restored and got.ram_tokens == 0
    # The disk hit was promoted: the next turn reads RAM.
    again = answer(tiny.model, second, cache)
    tiny.reference.check(second, again)
    assert again.ram_tokens == again.restored == len(second.tokens) - 1
    cache.close()


def test_disk_only_tier(tiny: Tiny, tmp_path: Path) -> None:
    """No RAM budget at all: every record goes straight to disk and comes back from it."""
    cache = PromptCache(tiny.model, "tiny", with_disk(tmp_path, ram_bytes=0))
    for index, prompt in enumerate(tiny.prompts[:2]):
        got = answer(tiny.model, prompt, cache)
        tiny.reference.check(prompt, got)
        assert got.ram_tokens == 0
        assert (got.restored > 0) == (index > 0)
    assert cache.stats()["disk"]["hits"] > 0
    cache.close()


def test_small_ram_tier_keeps_whole_points(tiny: Tiny) -> None:
    """A RAM budget of half the session's records: later points cannot fit with their chain,
    so they are not admitted (they would only evict points RAM can restore); an earlier point
    survives whole and restores, with the same answer."""
    probe = PromptCache(tiny.model, "tiny", ram_only())
    first = tiny.prompts[0]
    answer(tiny.model, first, probe)
    total = probe.stats()["ram"]["bytes"]
    probe.close()
    cache = PromptCache(tiny.model, "tiny", ram_only(ram_bytes=total // 2))
    answer(tiny.model, first, cache)
    stats = cache.stats()
    assert stats["points_past_ram"] + stats["ram"]["evictions"] > 0
    assert stats["ram"]["bytes"] <= total // 2
    got = answer(tiny.model, first, cache)
    tiny.reference.check(first, got)
    assert 256 <= got.restored < len(first.tokens) - 1


def test_a_missing_window_record_moves_the_restore_earlier(tiny: Tiny) -> None:
    """The window rows of the last point are gone (evicted, no disk tier): that point is passed
    over, an earlier one serves, same answer."""
    from mlx_lm.models.cache import RotatingKVCache

    if not any(isinstance(layer, RotatingKVCache) for layer in make_prompt_cache(tiny.model)):
        pytest.skip("no sliding-window layers in this family")
    cache = PromptCache(tiny.model, "tiny", ram_only())
    first, second = tiny.prompts[:2]
    answer(tiny.model, first, cache)
    last_point = len(first.tokens) - 1
    window_key = cache.point_keys(first.tokens[:last_point])["window"]
    assert cache.ram.contains(window_key)
    cache.ram.discard(window_key)
    got = answer(tiny.model, second, cache)
    tiny.reference.check(second, got)
    assert 0 < got.restored < last_point
    cache.close()


def test_hole_in_the_middle_of_a_chain(tiny: Tiny) -> None:
    """Records after a missing one are useless: the restore stops at the hole."""
    source = PromptCache(tiny.model, "tiny", ram_only())
    first = tiny.prompts[0]
    answer(tiny.model, first, source)
    holed = PromptCache(tiny.model, "tiny", ram_only())
    missing = source.point_keys(first.tokens[:256])["kv"]
    copied = 0
    for end in [*range(256, len(first.tokens), 256), len(first.tokens) - 1, *first.boundaries]:
        for key in source.point_keys(first.tokens[:end]).values():
            record = source.ram.peek(key)
            if record is not None and key != missing and not holed.ram.contains(key):
                holed.ram.put(key, None, record)  # no eviction here: parents do not matter
                copied += 1
    assert copied > 0 and not holed.ram.contains(missing)
    got = answer(tiny.model, first, holed)
    tiny.reference.check(first, got)
    assert got.restored < 256  # nothing past the hole; a point before it may still serve
    source.close()
    holed.close()


@pytest.mark.parametrize("kind", ["kv", "point"])
def test_corrupted_record_on_disk(tiny: Tiny, tmp_path: Path, kind: str) -> None:
    cache = PromptCache(tiny.model, "tiny", with_disk(tmp_path, ram_bytes=0))
    first, second = tiny.prompts[:2]
    answer(tiny.model, first, cache)
    cache.flush()
    if kind == "kv":  # the spine record of the second block: the chain breaks at 256
        key, limit = cache.point_keys(first.tokens[:512])["kv"], 256
    else:  # the state record at the prompt's last checkpoint (its kv record where none)
        keys = cache.point_keys(first.tokens[: len(first.tokens) - 1])
        key = keys["state"] if cache.store.contains(keys["state"]) else keys["kv"]
        limit = len(first.tokens) - 2
    cache.store._debug_corrupt(key)
    got = answer(tiny.model, second, cache)
    tiny.reference.check(second, got)
    assert got.restored <= limit
    assert cache.store.stats()["corrupt"] == 1
    cache.close()


def test_record_that_does_not_fit_the_model_is_recomputed(tiny_model_path) -> None:
    """A record that passes its identity check but lacks a layer's rows (a stale format, a
    bug): the restore falls back to a fresh cache instead of failing the request."""
    from rewind.cache.serialize import Record

    model, tokenizer = load(str(tiny_model_path("llama")))
    prompt = render(tokenizer, agent_session()[0])
    source = PromptCache(model, "tiny", ram_only())
    answer(model, prompt, source)
    key = source.point_keys(prompt.tokens[:256])["kv"]
    good = source.ram.peek(key)
    forged = Record(arrays={"tokens": good.arrays["tokens"]}, meta=dict(good.meta))
    cache = PromptCache(model, "tiny", ram_only())
    cache.ram.put(key, None, forged)
    got = answer(model, prompt, cache)
    Reference(model).check(prompt, got)
    assert got.restored == 0 and cache.stats()["restore_errors"] == 1
    source.close()
    cache.close()


def test_batched_cache_checkpoint_is_skipped_not_fatal(tiny_model_path) -> None:
    """A batched cache (the engine's decode batch) has no record kind: that checkpoint is
    skipped and counted, and the prompt cache stays on for the next ones."""
    model, tokenizer = load(str(tiny_model_path("llama")))
    prompt = render(tokenizer, agent_session()[0])
    cache = PromptCache(model, "tiny", ram_only())
    live = prefill_with_cache(model, prompt.tokens[:300], None).cache
    batched = [layer.merge([layer]) for layer in live]
    cache.checkpoint(prompt.tokens[:300], batched)
    assert cache.stats()["unsupported_checkpoints"] == 1 and cache.stats()["enabled"]
    cache.checkpoint(prompt.tokens[:300], live)
    assert prefill_with_cache(model, prompt.tokens[:400], cache).restored.tokens == 300
    cache.close()


def test_tiny_disk_budget_stores_nothing_and_recomputes(tiny: Tiny, tmp_path: Path) -> None:
    cache = PromptCache(tiny.model, "tiny", with_disk(tmp_path, ram_bytes=0, disk_bytes=4096))
    for prompt in tiny.prompts[:2]:
        got = answer(tiny.model, prompt, cache)
        tiny.reference.check(prompt, got)
        assert got.restored == 0
    cache.flush()
    assert cache.store.stats()["rejected"] > 0
    cache.close()


def test_unusable_cache_folder_turns_the_disk_tier_off(tiny: Tiny, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    cache = PromptCache(tiny.model, "tiny", with_disk(blocker / "scratch", ram_bytes=0))
    assert cache.store is None or not cache.store.enabled
    for prompt in tiny.prompts[:2]:
        got = answer(tiny.model, prompt, cache)
        tiny.reference.check(prompt, got)
        assert got.restored == 0
    assert list(tmp_path.iterdir()) == [blocker]
    cache.close()


def test_writer_busy_while_requests_read(tiny: Tiny, tmp_path: Path) -> None:
    """A one-slot writer queue and no flush: turns restore from records the writer thread is
    still writing (the store serves queued records) while it writes the next ones."""
    cache = PromptCache(tiny.model, "tiny", with_disk(tmp_path, ram_bytes=0, writer_queue=1))
    reads: list[int] = []
    for prompt in tiny.prompts[:3]:
        got = answer(tiny.model, prompt, cache)
        tiny.reference.check(prompt, got)
        reads.append(got.restored)
    assert all(n > 0 for n in reads[1:])
    cache.flush()
    stats = cache.store.stats()
    assert stats["write_errors"] == 0 and stats["corrupt"] == 0 and stats["records_written"] > 0
    cache.close()


def test_salt_and_images_separate_caches(tiny: Tiny) -> None:
    cache = PromptCache(tiny.model, "tiny", ram_only())
    first = tiny.prompts[0]
    answer(tiny.model, first, cache)
    other_tenant = prefill_with_cache(tiny.model, first.tokens, cache, BlockExtras(salt="tenant-2"))
    assert other_tenant.restored.tokens == 0
    image = BlockExtras(image_hashes=[(300, 340, b"picture")])
    with_image = prefill_with_cache(tiny.model, first.tokens, cache, image)
    # Blocks and points before the image still match; nothing after its start does.
    assert 256 <= with_image.restored.tokens <= 300
    cache.close()


# ---- the real model ---------------------------------------------------------------------------


@pytest.mark.real_model
def in_place(model: Any) -> bool:
    from rewind.kernels.native_forward import native_forward

    forward = native_forward(model)
    return forward is not None and forward.form == "gguf"


def test_real_model(tmp_path: Path) -> None:
    """Gemma 3 270M (sliding window 512 + global layers): RAM hits across an agent session with
    a rewind, then a disk hit. On the CPU the default reads its GGUF in place with int8
    activations, where any rounding difference would grow into another answer: there the
    cached logits are the uncached ones to the bit (the kernels give a row the same bits in any
    chunking). Elsewhere its logits are larger and its stack deeper than the tiny models', so the
    tolerance is REAL_LOGIT_ATOL."""
    from rewind.models.loader import load_model

    try:
        loaded = load_model("default")
    except Exception as error:  # noqa: BLE001 - the converter may be unavailable here
        pytest.skip(f"default model unavailable: {error}")
    sessions = agent_session(seed=5)
    first, rewound = render(loaded.tokenizer, sessions[1]), render(loaded.tokenizer, sessions[2])
    reference = Reference(loaded.model, atol=0.0 if in_place(loaded.model) else REAL_LOGIT_ATOL)
    cache = PromptCache(loaded.model, loaded.fingerprint, with_disk(tmp_path))
    assert answer(loaded.model, first, cache).restored == 0
    got = answer(loaded.model, rewound, cache)  # reasoning dropped: restored from RAM
    reference.check(rewound, got)
    shared = common_prefix(rewound.tokens, first.tokens)
    assert shared - 256 < got.restored <= shared and got.ram_tokens == got.restored
    cache.ram.set_budget(0)  # everything to the scratch file
    cache.flush()
    cache.ram.set_budget(1 << 30)
    got = answer(loaded.model, rewound, cache)  # an exact repeat, from disk
    reference.check(rewound, got)
    assert got.disk_tokens == got.restored == len(rewound.tokens) - 1
    cache.close()


def test_checkpoint_after_the_window_moved_on_stores_nothing_it_cannot_rebuild(tiny: Tiny) -> None:
    """A checkpoint taken long after the prefill passed its blocks (no checkpoint on the way):
    the sliding layers no longer hold those blocks' rows, so nothing is stored from there on,
    and a restore still gives the uncached answer."""
    from mlx_lm.models.cache import RotatingKVCache

    prompt = tiny.prompts[0]
    if not any(isinstance(layer, RotatingKVCache) for layer in make_prompt_cache(tiny.model)):
        pytest.skip("no sliding-window layers in this family")
    cache = PromptCache(tiny.model, "tiny", ram_only())
    live = prefill_with_cache(tiny.model, prompt.tokens[:-1], None).cache  # no checkpoints
    cache.checkpoint(prompt.tokens[:-1], live)
    assert cache.stats()["blocks_past_window"] == 1
    got = answer(tiny.model, prompt, cache)
    tiny.reference.check(prompt, got)
    assert got.restored == 0
    cache.close()
