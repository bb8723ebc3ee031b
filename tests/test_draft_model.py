"""A draft model drafting for the rows of the continuous batch (rewind.engine.draft_model):
answers are those of plain decoding, bit for bit, alone and batched, whatever the draft model;
with the model itself as its draft every drafted token is kept; a draft model of another
vocabulary is refused."""

from __future__ import annotations

import random

import pytest

from rewind.config import EngineConfig
from rewind.engine import Engine, GenerationRequest, SamplingParams
from rewind.engine.draft_model import DraftModel, DraftModelError
from rewind.models.loader import load_model
from rewind.testing.tiny_models import build_tiny_model

TIMEOUT = 600
# Rows verify drafts only through the CPU kernels (rewind.engine.speculation).
pytestmark = pytest.mark.cpu_only


def prompts_of(loaded, lengths: list[int], seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    top = min(loaded.tokenizer.vocab_size, 5000)
    return [[rng.randrange(10, top) for _ in range(n)] for n in lengths]


def run(loaded, draft, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0,
        speculative: str = "auto"):
    """(answers, speculation stats) of the prompts submitted together."""
    with Engine(loaded, EngineConfig(parallel=3, chunk_tokens=32, speculative=speculative),
                draft=draft) as engine:
        bias = {int(t): -100.0 for t in engine.eos_token_ids}
        handles = [engine.submit(GenerationRequest(p, SamplingParams(
            temperature=temperature, seed=7, max_tokens=max_tokens, logit_bias=bias,
            logprobs=True))) for p in prompts]
        out = []
        for handle in handles:
            done = handle.collect(TIMEOUT)
            out.append((done.tokens, done.logprobs))
        return out, engine.stats()


@pytest.fixture(scope="module")
def gemma_pair(tiny_model_path, tmp_path_factory):
    """The tiny Gemma 3 (sliding windows and a global layer) and a second one of the same
    tokenizer with other random weights."""
    target = load_model(str(tiny_model_path("gemma3")))
    other = load_model(str(build_tiny_model("gemma3", tmp_path_factory.mktemp("gemma3-other"),
                                            seed=123)))
    itself = load_model(str(tiny_model_path("gemma3")))  # the same weights, loaded again
    return target, other, itself


def test_the_model_as_its_own_draft_keeps_every_token_and_answers_the_same(gemma_pair):
    target, _, itself = gemma_pair
    # Prompts longer than the tiny model's window: the draft caches' rings wrap and give back.
    prompts = prompts_of(target, [150, 260, 700])
    plain, plain_stats = run(target, None, prompts, 60, speculative="off")
    drafted, stats = run(target, itself, prompts, 60)
    assert drafted == plain
    assert stats["speculative"] == "draft"
    assert stats["drafted_tokens"] >= 60
    assert stats["accepted_tokens"] == stats["drafted_tokens"]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_another_draft_model_changes_no_answer(gemma_pair, temperature: float):
    target, other, _ = gemma_pair
    prompts = prompts_of(target, [120, 300, 40], seed=9)
    plain, _ = run(target, None, prompts, 50, temperature, speculative="off")
    drafted, stats = run(target, other, prompts, 50, temperature)
    assert drafted == plain
    assert stats["speculative"] == "draft" and stats["drafted_tokens"] > 0
    assert stats["accepted_tokens"] < stats["drafted_tokens"]  # random weights disagree


def test_a_draft_model_of_another_vocabulary_is_refused(gemma_pair, tmp_path):
    target, _, _ = gemma_pair
    wider = load_model(str(build_tiny_model("llama", tmp_path / "wider",
                                            overrides={"vocab_size": 1024})))
    with pytest.raises(DraftModelError, match="vocabulary"):
        Engine(target, EngineConfig(), draft=wider)


def test_a_hybrid_draft_model_is_refused(tiny_loaded):
    with pytest.raises(DraftModelError, match="attention caches"):
        DraftModel(tiny_loaded("qwen3_5"))


def test_an_explicit_mode_keeps_its_drafts(gemma_pair):
    target, other, _ = gemma_pair
    _, stats = run(target, other, prompts_of(target, [100]), 20, speculative="ngram")
    assert stats["speculative"] == "ngram"


def drafted(model: DraftModel, row, context: list[int], limit: int) -> list[int]:
    """The row's draft once its draft cache caught up (a step each `catch_up_tokens`)."""
    for _ in range(len(context) // model.catch_up_tokens + 2):
        draft = model.propose(row, context, limit)
        if draft:
            return draft
    raise AssertionError("the row never caught up")


@pytest.mark.parametrize("kept", [0, 2, 5])
def test_a_row_gives_back_the_drafts_the_model_did_not_keep(gemma_pair, kept: int):
    """After a draft the model kept only in part, the row's draft cache holds what a fresh
    row fed the same tokens holds: its next draft is the same, in rings that wrapped."""
    target, _, itself = gemma_pair
    model = DraftModel(itself, catch_up_tokens=128)
    context = prompts_of(target, [300], seed=kept)[0]
    row = model.new_row()
    first = drafted(model, row, context, 6)
    assert len(first) == 6
    # The model kept `kept` drafted tokens and then chose a token of its own.
    other = next(t for t in range(20, 40) if t != first[kept])
    context = context + first[:kept] + [other]
    again = drafted(model, row, context, 5)
    fresh = model.new_row()
    assert again == drafted(model, fresh, context, 5)
    assert row.tokens == fresh.tokens == context + again[:-1]


def test_rewind_serve_drafts_with_a_draft_model(tiny_model_path, tmp_path):
    """`rewind serve --draft-model` on loopback, the openai client: the same answer as a server
    without it, and the drafted tokens counted in the response's usage and /metrics."""
    import sys

    import httpx
    from openai import OpenAI

    from rewind.bench.harness import LOOPBACK, ServerProcess, free_port

    folder = str(tiny_model_path("gemma3"))
    prompt = prompts_of(load_model(folder), [200], seed=4)[0]
    texts = {}
    for draft in (None, folder):
        port = free_port()
        argv = [sys.executable, "-m", "rewind", "serve", "--model", folder, "--host", LOOPBACK,
                "--port", str(port), "--no-prompt-cache", "--log-level", "warning"]
        if draft:
            argv += ["--draft-model", draft]
        server = ServerProcess("rewind", argv, port, tmp_path / f"serve-{port}.log",
                               ready_paths=("/health",), model_id=folder)
        with server.start():
            server.wait_ready(120)
            client = OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
            # The tiny tokenizer's special tokens (EOS among them) are its first ids.
            answer = client.completions.create(model=folder, prompt=prompt, max_tokens=40,
                                               temperature=0.0,
                                               logit_bias={str(i): -100 for i in range(10)})
            texts[draft] = answer.choices[0].text
            metrics = httpx.get(f"{server.base_url}/metrics").text
        drafted = [line for line in metrics.splitlines()
                   if line.startswith("rewind_speculative_drafted_tokens_total")]
        if draft:
            assert drafted and float(drafted[0].split()[-1]) > 0, metrics[-2000:]
    assert texts[None] == texts[folder]
