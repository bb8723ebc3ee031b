"""Per-sequence sampling: penalties, logit bias, temperature, top-k/top-p/min-p, seeds, logprobs.

Order (as vLLM and llama.cpp do it): repetition penalty -> presence / frequency penalties ->
logit bias -> (logprobs are read here) -> temperature -> top-k -> top-p -> min-p -> draw.
Reported logprobs are those of the penalised, biased distribution before temperature and
truncation, so they do not depend on the sampling knobs.

Each sequence owns a SequenceSampler (its history and its random key). `sample_rows` builds every
row's graph lazily and evaluates them together, with one argmax over the whole batch when every row
is plain greedy.
"""

from __future__ import annotations

import math
import secrets
from collections import Counter
from dataclasses import dataclass

import mlx.core as mx

from rewind.engine.grammar import Constraint
from rewind.engine.request import InvalidRequestError, SamplingParams


@dataclass
class Sampled:
    token: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None


# What OpenAI reports for a token the model gives no chance: JSON has no -Infinity, and a bare
# -Infinity in a response or an SSE line breaks every client's parser.
LOWEST_LOGPROB = -9999.0


def _reportable(logprob: float) -> float:
    return float(logprob) if math.isfinite(logprob) else LOWEST_LOGPROB


class SequenceSampler:
    """Sampling state of one sequence: prompt token set, generated-token counts, random key."""

    def __init__(self, params: SamplingParams, prompt_tokens: list[int], vocab_size: int,
                 constraint: Constraint | None = None) -> None:
        self.params = params
        self.vocab_size = vocab_size
        self.constraint = constraint  # a grammar's token mask, applied after the bias
        if params.logit_bias:
            bad = [t for t in params.logit_bias if not 0 <= int(t) < vocab_size]
            if bad:
                raise InvalidRequestError(f"logit_bias token ids out of range: {bad[:5]}")
        self._bias_ids: mx.array | None = None  # built on the engine thread (see below)
        self._bias_values: mx.array | None = None
        # Repetition penalty covers the prompt too (HF semantics); keep the distinct ids only.
        self._seen: set[int] = set(prompt_tokens) if params.repetition_penalty != 1.0 else set()
        self._counts: Counter[int] = Counter()
        self._seed = params.seed if params.seed is not None else secrets.randbits(63)
        # MLX streams are per thread: a lazy array made on the caller's thread cannot be
        # evaluated on the engine thread, so every array is created on first use.
        self._key: mx.array | None = None

    @property
    def plain_greedy(self) -> bool:
        """Argmax of the raw logits is the whole job: no processing, no logprobs."""
        p = self.params
        return p.greedy and not self._processes and not p.logprobs

    @property
    def needs_history(self) -> bool:
        """Each step's logits depend on the tokens accepted before it (penalties, grammars)."""
        p = self.params
        return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                or p.frequency_penalty != 0.0 or self.constraint is not None)

    @property
    def _processes(self) -> bool:
        p = self.params
        return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                or p.frequency_penalty != 0.0 or bool(p.logit_bias)
                or self.constraint is not None)

    def accept(self, token: int) -> None:
        """Record a generated token for the penalties."""
        if self.params.repetition_penalty != 1.0:
            self._seen.add(token)
        if self.params.presence_penalty != 0.0 or self.params.frequency_penalty != 0.0:
            self._counts[token] += 1
        if self.constraint is not None:
            self.constraint.accept(token)

    def process(self, logits: mx.array) -> mx.array:
        """Penalties and bias on one row of logits [vocab] (float32)."""
        p = self.params
        logits = logits.astype(mx.float32)
        if p.repetition_penalty != 1.0 and self._seen:
            ids = mx.array(sorted(self._seen), dtype=mx.int32)
            picked = logits[ids]
            logits[ids] = mx.where(picked < 0, picked * p.repetition_penalty,
                                   picked / p.repetition_penalty)
        if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and self._counts:
            ids = mx.array(list(self._counts.keys()), dtype=mx.int32)
            counts = mx.array(list(self._counts.values()), dtype=mx.float32)
            logits[ids] = logits[ids] - (p.frequency_penalty * counts + p.presence_penalty)
        if p.logit_bias:
            if self._bias_ids is None or self._bias_values is None:
                self._bias_ids = mx.array([int(t) for t in p.logit_bias], dtype=mx.int32)
                self._bias_values = mx.array(list(p.logit_bias.values()), dtype=mx.float32)
            logits[self._bias_ids] = logits[self._bias_ids] + self._bias_values
        if self.constraint is not None:
            logits = mx.where(self.constraint.mask(), logits, -math.inf)
        return logits

    def draw(self, logits: mx.array) -> mx.array:
        """A token id (lazy scalar) from processed logits [vocab]."""
        p = self.params
        if p.greedy:
            return mx.argmax(logits)
        logits = logits * (1.0 / p.temperature)
        if 0 < p.top_k < self.vocab_size:
            kth_best = mx.min(mx.topk(logits, p.top_k))
            logits = mx.where(logits < kth_best, -math.inf, logits)
        if p.top_p < 1.0:
            order = mx.argsort(-logits)
            sorted_logits = logits[order]
            sorted_probs = mx.softmax(sorted_logits)
            # Keep a token while the mass before it is under top_p: the first always survives.
            keep = (mx.cumsum(sorted_probs) - sorted_probs) < p.top_p
            threshold = mx.min(mx.where(keep, sorted_logits, math.inf))
            logits = mx.where(logits < threshold, -math.inf, logits)
        if p.min_p > 0.0:
            logprobs = logits - mx.logsumexp(logits)
            logits = mx.where(logprobs < mx.max(logprobs) + math.log(p.min_p), -math.inf, logits)
        if self._key is None:
            self._key = mx.random.key(self._seed)
        self._key, step_key = mx.random.split(self._key)
        return mx.random.categorical(logits, key=step_key)


@dataclass
class LazySamples:
    """One token per row, not evaluated yet: a pipelined decode queues the next step on
    `tokens` before reading them."""

    tokens: mx.array  # [B] int
    # Per row: (logprob, top ids, top values), lazy, or None where the row asks for none.
    logprobs: list[tuple[mx.array, mx.array | None, mx.array | None] | None]

    def arrays(self) -> list[mx.array]:
        return [self.tokens, *(a for item in self.logprobs if item is not None
                               for a in item if a is not None)]

    def select(self, rows: list[int]) -> LazySamples:
        return LazySamples(self.tokens[mx.array(rows, dtype=mx.int32)],
                           [self.logprobs[i] for i in rows])


def _batch_greedy(sampler: SequenceSampler) -> bool:
    """Greedy with at most a logit bias, no logprobs: the whole batch of such rows is one graph
    (see `_biased_argmax`)."""
    p = sampler.params
    return (p.greedy and not p.logprobs and sampler.constraint is None
            and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0)


def _biased_argmax(samplers: list[SequenceSampler], logits: mx.array) -> mx.array:
    """argmax of each row of logits [B, vocab] plus its sampler's logit bias, as `process` and
    `draw` compute it row by row (float32, the bias added at its ids), in a handful of kernels
    for the whole batch instead of a handful per row: with a logit bias on every row (an EOS
    ban, say) the per-row graph was ~10 kernels a row, ~300 at 32 rows, whose encoding on the
    host took longer than the model's forward pass on a GPU (rewind bench decode-scaling)."""
    rows: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    for row, sampler in enumerate(samplers):
        for token, value in (sampler.params.logit_bias or {}).items():
            rows.append(row)
            ids.append(int(token))
            values.append(float(value))
    if not rows:
        return mx.argmax(logits, axis=-1)
    biased = logits.astype(mx.float32)
    at_rows = mx.array(rows, dtype=mx.int32)
    at_ids = mx.array(ids, dtype=mx.int32)
    biased[at_rows, at_ids] = biased[at_rows, at_ids] + mx.array(values, dtype=mx.float32)
    return mx.argmax(biased, axis=-1)


def sample_lazy(samplers: list[SequenceSampler], logits: mx.array) -> LazySamples:
    """The graph of one token per row of logits [B, vocab], row i with samplers[i]: one argmax
    over the whole batch when every row is greedy with at most a logit bias (plain greedy: of
    the logits as they are), else each row's own graph."""
    if all(s.plain_greedy for s in samplers):
        return LazySamples(mx.argmax(logits, axis=-1), [None] * len(samplers))
    if all(_batch_greedy(s) for s in samplers):
        return LazySamples(_biased_argmax(samplers, logits), [None] * len(samplers))
    tokens, logprobs = [], []
    for row, sampler in enumerate(samplers):
        processed = sampler.process(logits[row])
        token = sampler.draw(processed)
        tokens.append(token)
        item = None
        if sampler.params.logprobs:
            row_logprobs = processed - mx.logsumexp(processed)
            top_ids = top_values = None
            k = sampler.params.top_logprobs
            if k > 0:
                top_ids = mx.argpartition(-row_logprobs, k - 1)[:k]
                top_values = row_logprobs[top_ids]
            item = (row_logprobs[token], top_ids, top_values)
        logprobs.append(item)
    return LazySamples(mx.stack(tokens).reshape(-1), logprobs)


def read_samples(lazy: LazySamples) -> list[Sampled]:
    """Evaluate and read the tokens (and log-probabilities) of `sample_lazy`."""
    mx.eval(lazy.arrays())
    results = []
    for token, item in zip(lazy.tokens.tolist(), lazy.logprobs):
        value = top = None
        if item is not None:
            logprob, top_ids, top_values = item
            value = _reportable(logprob.item())
            if top_ids is not None and top_values is not None:
                pairs = zip(top_ids.tolist(), top_values.tolist())
                top = sorted(((int(i), _reportable(v)) for i, v in pairs),
                             key=lambda pair: -pair[1])
        results.append(Sampled(int(token), value, top))
    return results


def sample_rows(samplers: list[SequenceSampler], logits: mx.array) -> list[Sampled]:
    """Sample one token per row of logits [B, vocab], row i with samplers[i]."""
    return read_samples(sample_lazy(samplers, logits))
