"""Speculative decoding inside the continuous batch: a row drafts tokens from its own context
and from recent answers, verifies them in the decode step's pass and keeps what the model
agrees with. Checked through the engine's public interface: the answers (tokens and
log-probabilities, greedy and seeded sampling, alone and batched, with and without the prompt
cache) are those of plain decoding on every tiny family and the default model, drafts were
really accepted where a family's caches roll back, and the prompt cache's checkpoints fall where
they fall without speculation.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from rewind.cache import PromptCache, window_blocks
from rewind.config import CacheConfig, EngineConfig
from rewind.engine import Engine, GenerationRequest, SamplingParams
from rewind.kernels import native
from rewind.models.loader import load_model
from rewind.testing.tiny_models import build_tiny_model

TIMEOUT = 600
# Families whose rows verify drafts in calls of their own: those the CPU kernels run, and, with
# bf16 weights as real checkpoints have, the MLX-layer families (Gemma 4; Qwen 3.5, whose linear
# attention gives tokens back through rewind.cache.linear_steps), where a row drafts while it
# decodes alone. With float32 weights MLX's matmul (OpenBLAS) sums in another order for another
# row count, and speculation is off (rewind.engine.speculation).
SPECULATES = {"llama", "gemma3", "default", "qwen3_5-bf16", "gemma4-bf16"}
# Of those, the ones whose rows draft only while decoding alone (MLX's layers).
DRAFT_ALONE = {"qwen3_5-bf16", "gemma4-bf16"}
# Rows draft only where they decode through the CPU kernels (rewind.engine.speculation: MLX's
# batched forward sums in another order for another row count); elsewhere every mode decodes
# one token a step, and these tests of drafting have nothing to test.
DRAFTS_ON_THE_CPU_KERNELS = pytest.mark.cpu_only


@pytest.fixture(scope="module")
def gemma4_loaded(tmp_path_factory: pytest.TempPathFactory):
    return load_model(str(build_tiny_model("gemma4", tmp_path_factory.mktemp("gemma4"))))


@pytest.fixture(scope="module")
def default_loaded():
    return load_model("default")  # as served: the GGUF in place on the CPU


# The default model (28 s) and Gemma 4 in bf16 (17 s) run on demand (pytest --on-demand): CI neared
# its 20 minutes. The same machinery stays covered in CI by the tiny families on the CPU kernels
# (llama, gemma3, qwen3_5, gemma4), by Qwen 3.5 in bf16 on MLX's layers, and by the default
# model's GGUF blocks in tests/test_mixed_steps.py.
@pytest.fixture(params=["llama", "gemma3", "qwen3_5", "gemma4",
                        pytest.param("default", marks=pytest.mark.on_demand), "qwen3_5-bf16",
                        pytest.param("gemma4-bf16", marks=pytest.mark.on_demand)])
def family_loaded(request: pytest.FixtureRequest, tiny_loaded, bf16_loaded):
    if request.param == "gemma4":
        return request.param, request.getfixturevalue("gemma4_loaded")
    if request.param == "default":
        return request.param, request.getfixturevalue("default_loaded")
    if request.param.endswith("-bf16"):
        return request.param, bf16_loaded(request.param.removesuffix("-bf16"))
    return request.param, tiny_loaded(request.param)


def random_prompts(loaded, lengths: list[int], seed: int = 5) -> list[list[int]]:
    """Prompts of random ids without repeated n-grams to speak of: a row's drafts then come
    from the pool of earlier answers, which makes them long and mostly right."""
    rng = random.Random(seed)
    top = min(loaded.tokenizer.vocab_size, 5000)
    return [[rng.randrange(10, top) for _ in range(n)] for n in lengths]


def params(engine: Engine, max_tokens: int, temperature: float = 0.0,
           stop: list[str] | None = None) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=11, max_tokens=max_tokens,
                          logit_bias={int(t): -100.0 for t in engine.eos_token_ids},
                          logprobs=True, top_logprobs=3, stop=stop or [])


@contextmanager
def cached_engine(loaded, config: EngineConfig, cache_dir: Path) -> Iterator[Engine]:
    """An engine with a prompt cache (RAM and a 64 MiB disk tier) of its own in `cache_dir`."""
    prompt_cache = PromptCache(loaded.model, loaded.fingerprint,
                               CacheConfig(cache_dir=cache_dir, disk_bytes=64 << 20))
    try:
        with Engine(loaded, config, prompt_cache) as engine:
            yield engine
    finally:
        prompt_cache.close()


def answers(engine: Engine, requests: list[GenerationRequest]):
    """(tokens, logprobs, top logprobs, finish reason) of requests submitted together."""
    handles = [engine.submit(r) for r in requests]
    out = []
    for handle in handles:
        done = handle.collect(TIMEOUT)
        out.append((done.tokens, done.logprobs, done.text, done.finish.reason))
    return out


@DRAFTS_ON_THE_CPU_KERNELS
def test_greedy_and_seeded_answers_are_those_of_plain_decoding(family_loaded, tmp_path):
    """Alone, then three at once (greedy, then seeded sampling), then again from the prompt
    cache: the same tokens and the same log-probabilities, bit for bit, with speculation as
    without. Where every cache rolls back, the batched rows drafted from the first answer (the
    pool) and the model kept most of it."""
    family, loaded = family_loaded
    prompts = random_prompts(loaded, [150, 190, 230])
    results = {}
    blocks_before = window_blocks.written
    for mode in ("off", "suffix"):
        with cached_engine(loaded, EngineConfig(parallel=3, chunk_tokens=32, speculative=mode),
                           tmp_path / mode) as engine:
            runs = []
            for temperature in (0.0, 0.9):
                runs += answers(engine, [GenerationRequest(prompts[0],
                                                           params(engine, 40, temperature))])
                runs += answers(engine, [GenerationRequest(p, params(engine, 40, temperature))
                                         for p in prompts])
                if family in DRAFT_ALONE and temperature == 0.0:  # they draft alone: each again
                    for p in prompts:
                        runs += answers(engine, [GenerationRequest(
                            p, params(engine, 40, temperature))])
            speculator = engine._scheduler.speculator
            results[mode] = (runs, None if speculator is None else speculator.counters)
    plain, spec = results["off"][0], results["suffix"][0]
    for one, other in zip(plain, spec):
        assert one[0] == other[0]
        # Log-probabilities bit for bit too, also with OpenBLAS preloaded (as scripts/test.sh
        # and `rewind` run): its gemm sums a drafted block's head rows in another order than
        # its gemv a single row, so the runner computes a head without a C kernel one
        # position at a time.
        assert one[1] == other[1]
    counters = results["suffix"][1]
    if family == "gemma3" and native.load_kernels() is not None:
        # Its drafts went into full sliding windows in place (rewind.cache.window_blocks).
        assert window_blocks.written > blocks_before
    if family in SPECULATES:
        assert counters.accepted_tokens >= 40, counters
        assert counters.accepted_tokens <= counters.drafted_tokens
    else:
        assert counters is None


@DRAFTS_ON_THE_CPU_KERNELS
@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3_5-bf16", "gemma4-bf16"])
def test_checkpoints_fall_where_they_fall_without_speculation(tiny_loaded, bf16_loaded, tmp_path,
                                                              family):
    """A row's answer crosses a 256-token boundary: the next turn, which re-sends the prompt and
    a part of the answer past that boundary, restores the same prefix with speculation as
    without (the boundary checkpoint), and a turn re-sending the whole answer restores it
    whole (the checkpoint where it ended). On the Qwen 3.5 shape that is a linear-attention
    state, checkpointed after drafts were given back."""
    loaded = (bf16_loaded(family.removesuffix("-bf16")) if family.endswith("-bf16")
              else tiny_loaded(family))
    prompt = random_prompts(loaded, [200])[0]
    restored = {}
    for mode in ("off", "suffix"):
        with cached_engine(loaded, EngineConfig(parallel=2, chunk_tokens=32, speculative=mode),
                           tmp_path / mode) as engine:
            warm = answers(engine, [GenerationRequest(prompt, params(engine, 90))])[0][0]
            # The pool now holds the answer: the next run drafts it.
            answer = answers(engine, [GenerationRequest(prompt, params(engine, 90))])[0][0]
            assert answer == warm
            cut = prompt + answer[:70] + [17, 18, 19]
            whole = prompt + answer[:-1] + [17, 18]
            usage = [engine.submit(GenerationRequest(p, params(engine, 1))).collect(TIMEOUT)
                     .finish.usage.cached_tokens for p in (cut, whole)]
            counters = engine._scheduler.speculator
            restored[mode] = (usage, None if counters is None
                              else counters.counters.accepted_tokens)
    assert restored["off"][0] == restored["suffix"][0]
    assert restored["off"][0][0] == 256
    assert restored["suffix"][1] >= 50


@DRAFTS_ON_THE_CPU_KERNELS
def test_stop_strings_and_max_tokens_hold_across_accepted_drafts(default_loaded):
    """The default model copies a text it was shown: the answer stops at a stop string inside an
    accepted draft, and at max_tokens inside one, exactly where plain decoding stops."""
    loaded = default_loaded
    text = ("Copy the list.\nList: alpha, beta, gamma, delta, epsilon, zeta, eta, theta, iota, "
            "kappa, lambda, mu.\nCopy: alpha, beta, gamma, delta, epsilon, zeta, eta, theta, "
            "iota, kappa, lambda, mu.\nList: one, two, three, four, five, six, seven, eight, "
            "nine, ten, eleven, twelve.\nCopy:")
    prompt = loaded.tokenizer.encode(text)
    out = {}
    for mode in ("off", "ngram"):
        with Engine(loaded, EngineConfig(parallel=2, speculative=mode)) as engine:
            out[mode] = answers(engine, [
                GenerationRequest(prompt, params(engine, 60, stop=[" nine"])),
                GenerationRequest(prompt, params(engine, 9)),
            ])
            speculator = engine._scheduler.speculator
            out[mode + "-accepted"] = 0 if speculator is None else speculator.counters.accepted_tokens
    assert out["off"] == out["ngram"]
    stopped, capped = out["ngram"]
    assert stopped[3] == "stop" and "eight," in stopped[2] and "nine" not in stopped[2]
    assert capped[3] == "length" and len(capped[0]) == 9
    assert out["ngram-accepted"] >= 5


@DRAFTS_ON_THE_CPU_KERNELS
def test_structured_output_holds_across_accepted_drafts(default_loaded):
    """A JSON schema's grammar masks every position of a verified draft: the answer is the
    one plain decoding gives, it parses, and drafts were accepted."""
    from llguidance import LLMatcher

    loaded = default_loaded
    schema = {"type": "object", "properties": {
        "names": {"type": "array", "items": {"type": "string"}, "maxItems": 6}},
        "required": ["names"], "additionalProperties": False}
    example = json.dumps({"names": ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]})
    prompt = loaded.tokenizer.encode(f"Repeat the JSON.\nJSON: {example}\nRepeat: {example}\n"
                                     f"JSON: {example}\nRepeat:")
    grammar = LLMatcher.grammar_from_json_schema(schema)
    out = {}
    for mode in ("off", "ngram"):
        with Engine(loaded, EngineConfig(parallel=2, speculative=mode)) as engine:
            request = GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=80),
                                        grammar=grammar)
            out[mode] = answers(engine, [request])[0]
            speculator = engine._scheduler.speculator
            out[mode + "-accepted"] = 0 if speculator is None else speculator.counters.accepted_tokens
    assert out["off"] == out["ngram"]
    assert json.loads(out["ngram"][2])["names"]
    assert out["ngram-accepted"] >= 5


def test_a_request_that_opts_out_decodes_one_token_a_step(tiny_loaded):
    """`speculative=False` on a request: no drafts for it, the same answer."""
    loaded = tiny_loaded("llama")
    prompt = random_prompts(loaded, [120])[0]
    with Engine(loaded, EngineConfig(parallel=2, speculative="suffix")) as engine:
        first = answers(engine, [GenerationRequest(prompt, params(engine, 30))])[0]
        out = engine.submit(GenerationRequest(prompt, params(engine, 30), speculative=False)
                            ).collect(TIMEOUT)
        usage = out.finish.usage
    assert out.tokens == first[0]
    assert usage.drafted_tokens == 0 and usage.accepted_tokens == 0


@DRAFTS_ON_THE_CPU_KERNELS
def test_auto_drafts_where_drafts_are_kept_and_holds_back_where_they_are_not(tiny_loaded):
    """`auto` weighs a draft's positions against the tokens its row is expected to keep: alone,
    on a prompt that repeats itself, it drafts and keeps drafts; three rows at once whose drafts
    fail (random prompts) feed no more drafted tokens than `suffix`, which feeds every draft it
    finds. The answers are the same either way."""
    loaded = tiny_loaded("llama")
    rng = random.Random(5)
    motif = [rng.randrange(10, 400) for _ in range(24)]
    randoms = random_prompts(loaded, [150, 170, 190])
    out = {}
    for mode in ("auto", "suffix"):
        with Engine(loaded, EngineConfig(parallel=3, speculative=mode)) as engine:
            counters = engine._scheduler.speculator.counters
            alone = answers(engine, [GenerationRequest(motif * 6, params(engine, 60))])
            kept_alone = counters.accepted_tokens
            drafted_before = counters.drafted_tokens
            together = answers(engine, [GenerationRequest(p, params(engine, 60))
                                        for p in randoms])
            out[mode] = (alone, together, kept_alone, counters.drafted_tokens - drafted_before)
    assert [a[0] for a in out["auto"][0] + out["auto"][1]] == \
        [a[0] for a in out["suffix"][0] + out["suffix"][1]]
    assert out["auto"][2] >= 10
    # Random rows find few drafts, short ones, which cost a step little beside two others:
    # auto feeds no more than suffix (test_drafts checks it trims a failing row's long draft).
    assert out["auto"][3] <= out["suffix"][3], (out["auto"][2:], out["suffix"][2:])


def test_a_bad_mode_is_refused():
    with pytest.raises(ValueError, match="speculative must be one of auto, off, ngram, suffix"):
        EngineConfig(speculative="eagle")
    with pytest.raises(ValueError, match="longest draft"):
        EngineConfig(speculative_max_draft=0)


@DRAFTS_ON_THE_CPU_KERNELS
def test_the_server_reports_drafts_in_usage_and_metrics(tiny_model_path, tmp_path):
    """Through the real `openai` client on a live server (speculation on by default): the
    second request for the same prompt drafts the first's answer, and its usage says how much
    of the draft it kept (OpenAI's predicted-output fields); `speculative: false` opts out;
    /metrics counts the drafts."""
    import httpx

    from live_server import tiny_live_server

    with tiny_live_server(tiny_model_path("llama"), tmp_path) as live:
        client = live.openai()
        prompt = random_prompts(live.loaded, [100])[0]
        bias = {str(t): -100 for t in live.engine.eos_token_ids}

        def complete(**extra):
            return client.completions.create(model=live.model, prompt=prompt, max_tokens=40,
                                             temperature=0, logit_bias=bias, extra_body=extra)

        first = complete()
        second = complete()
        opted_out = complete(speculative=False)
        metrics = httpx.get(f"{live.url}/metrics").text
        stats = live.engine.stats()
    assert first.choices[0].text == second.choices[0].text == opted_out.choices[0].text
    details = second.usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= 20
    assert opted_out.usage.completion_tokens_details is None
    accepted = [line for line in metrics.splitlines()
                if line.startswith("rewind_speculative_accepted_tokens_total")]
    assert accepted and float(accepted[0].split()[-1]) >= 20
    assert stats["speculative"] == "suffix" and stats["accepted_tokens"] >= 20


def test_serve_refuses_an_unknown_mode():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "rewind", "serve", "--speculative", "eagle"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "invalid choice: 'eagle'" in out.stderr


def _chi_square_p_above(table: list[list[int]], alpha: float) -> bool:
    """Whether a two-sample chi-square test of homogeneity on `table` (2 rows of category
    counts) keeps the hypothesis of one distribution at level `alpha`: the statistic against
    the chi-square quantile (Wilson-Hilferty's approximation, within 1% here)."""
    from statistics import NormalDist

    columns = [c for c in range(len(table[0])) if table[0][c] + table[1][c] > 0]
    rows = [sum(row[c] for c in columns) for row in table]
    total = sum(rows)
    statistic = 0.0
    for c in columns:
        column = table[0][c] + table[1][c]
        for r in range(2):
            expected = rows[r] * column / total
            statistic += (table[r][c] - expected) ** 2 / expected
    df = len(columns) - 1
    if df < 1:
        return True
    z = NormalDist().inv_cdf(1 - alpha)
    quantile = df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3
    return statistic <= quantile


@DRAFTS_ON_THE_CPU_KERNELS
def test_sampled_answers_keep_their_distribution(tiny_loaded):
    """Seeds apart, so not the same draws: 320 answers sampled with speculation and 320 without,
    from a few candidates a position (top_k 3, a small vocabulary), on a prompt that repeats
    itself so rows draft and keep drafts. At every position the tokens drawn follow one
    distribution (chi-square, alpha 0.001). A verifier that kept drafted tokens more often than
    the model draws them would fail here: the repeats are what the drafts propose."""
    loaded = tiny_loaded("llama")
    rng = random.Random(3)
    motif = [rng.randrange(10, 400) for _ in range(24)]
    prompt = motif * 6
    positions, count = 8, 320
    drawn: dict[str, list[list[int]]] = {}
    accepted = 0
    for mode, first_seed in (("suffix", 0), ("off", 10_000)):
        done = []
        with Engine(loaded, EngineConfig(parallel=8, speculative=mode)) as engine:
            eos = {int(t): -100.0 for t in engine.eos_token_ids}
            # In waves of a batch: rows draft in steps that carry no prompt (the policy).
            for wave in range(0, count, 8):
                handles = [engine.submit(GenerationRequest(prompt, SamplingParams(
                    temperature=0.7, top_k=3, seed=first_seed + i, max_tokens=positions,
                    logit_bias=eos))) for i in range(wave, wave + 8)]
                done += [handle.collect(TIMEOUT) for handle in handles]
        drawn[mode] = [d.tokens for d in done]
        if mode == "suffix":
            accepted = sum(d.finish.usage.accepted_tokens for d in done)
    # The rows did draft and keep drafts: hundreds of kept tokens (281 with 128-token prefill
    # calls, 320+ with 64: the calls change which steps carry a prefilling prompt, and no row
    # drafts in those).
    assert accepted > count // 2
    for position in range(positions):
        tokens = sorted({t[position] for mode in drawn for t in drawn[mode]})
        table = [[sum(1 for t in drawn[mode] if t[position] == token) for token in tokens]
                 for mode in ("suffix", "off")]
        assert _chi_square_p_above(table, 0.001), (position, tokens, table)


def _cuda() -> bool:
    from rewind.kernels import cuda_rows

    return cuda_rows.available()


@pytest.mark.skipif(not _cuda(), reason="needs MLX's CUDA backend")
def test_on_cuda_a_lone_row_drafts_and_answers_as_plain_decoding(tiny_model_path, tmp_path):
    """On CUDA, a bf16 model whose layers have kernels computing each position alone
    (rewind.kernels.cuda_rows): a request decoding alone checks its drafts in one call, and its
    answer (greedy, then seeded) is plain decoding's, tokens and log-probabilities, bit for bit;
    the second ask of each prompt drafts from the first answer and keeps most of it. (Rows that
    decode together on a GPU share MLX's batched products, whose bits depend on the batch, with
    or without speculation: those are not compared here.)"""
    import mlx.core as mx

    loaded = load_model(str(tiny_model_path("llama")), dtype=mx.bfloat16)
    prompts = random_prompts(loaded, [150, 190, 230])
    results = {}
    for mode in ("off", "suffix"):
        with cached_engine(loaded, EngineConfig(parallel=3, chunk_tokens=32, speculative=mode),
                           tmp_path / mode) as engine:
            assert engine._scheduler.runner.lone_rows_exact
            runs = []
            for temperature in (0.0, 0.9):
                for p in prompts + prompts:  # each alone, twice: the second drafts from the first
                    runs += answers(engine, [GenerationRequest(p, params(engine, 40, temperature))])
            speculator = engine._scheduler.speculator
            results[mode] = (runs, None if speculator is None else speculator.counters)
            # the lone row's one-token steps are the compiled step in both modes
            assert engine._scheduler.runner.compiled_decode.steps > 100
    plain, spec = results["off"][0], results["suffix"][0]
    for one, other in zip(plain, spec):
        assert one[0] == other[0]
        assert one[1] == other[1]
    counters = results["suffix"][1]
    assert counters.accepted_tokens >= 100, counters
