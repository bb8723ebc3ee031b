"""Perplexity of a model on a text: the check that a conversion gave a working model, not noise."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence


def token_log_likelihoods(model: Any, tokens: list[int]) -> list[float]:
    """log p(tokens[i] | tokens[:i]) for i >= 1, computed in one forward pass (float32 softmax)."""
    import mlx.core as mx

    if len(tokens) < 2:
        raise ValueError("perplexity needs at least two tokens")
    inputs = mx.array(tokens[:-1])[None]
    targets = mx.array(tokens[1:])
    logits = model(inputs)[0].astype(mx.float32)
    log_probs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    picked = mx.take_along_axis(log_probs, targets[:, None], axis=-1)[:, 0]
    return picked.tolist()


def perplexity(model: Any, tokenizer: Any, text: str) -> float:
    """exp of the mean negative log-likelihood of the text's tokens (BOS included as context)."""
    tokens = tokenizer.encode(text)
    log_likelihoods = token_log_likelihoods(model, tokens)
    return math.exp(-sum(log_likelihoods) / len(log_likelihoods))


@dataclass(frozen=True)
class ChunkedPerplexity:
    """llama-perplexity's estimate of a text (see chunked_perplexity), with what it printed on the
    way: `running[i]` is its `[i+1]` value, the perplexity over chunks 1..i+1."""

    ppl: float
    error: float  # its `+/-`: ppl times the standard error of the mean negative log-likelihood
    n_ctx: int
    text_tokens: int  # the whole text's tokens, BOS included where the model adds one
    scored: int  # tokens scored: chunks * (n_ctx - n_ctx // 2 - 1)
    chunk_ppl: tuple[float, ...]  # each chunk's own perplexity
    running: tuple[float, ...]


def perplexity_chunks(tokens: Sequence[int], n_ctx: int, bos: int | None) -> list[list[int]]:
    """llama-perplexity's chunks of a text's tokens (tokenized whole, BOS first where the model adds
    one): len(tokens) // n_ctx chunks of n_ctx tokens, the rest dropped, each chunk's first token
    replaced by `bos` (None: the model adds no BOS, the tokens stay). It needs 2 * n_ctx tokens."""
    if n_ctx < 4:
        raise ValueError(f"n_ctx {n_ctx}: too short to score half a chunk")
    if len(tokens) < 2 * n_ctx:
        raise ValueError(f"the text has {len(tokens)} tokens; perplexity with a context of "
                         f"{n_ctx} needs at least {2 * n_ctx}")
    chunks = []
    for start in range(0, len(tokens) // n_ctx * n_ctx, n_ctx):
        chunk = [int(token) for token in tokens[start:start + n_ctx]]
        if bos is not None:
            chunk[0] = bos
        chunks.append(chunk)
    return chunks


def _logits_from(model: Any, inputs: Any, start: int, stop: int) -> Any:
    """Logits [stop - start, vocab] of positions start..stop-1 of one row `inputs` [1, T], from one
    pass over the row with no cache. Through the model's backbone and the output head Rewind
    serves with (the CPU fast head where the loader installed one) for a family with a known
    split, the model's own call otherwise."""
    from rewind.kernels.backend import kernels_for
    from rewind.kernels.model_split import split_model

    split = split_model(model)
    if split is None:
        return model(inputs)[0, start:stop]
    hidden = split.backbone(inputs)
    return split.logits(hidden[0, start:stop], kernels_for(model).head)


def chunk_nlls(model: Any, chunk: Sequence[int]) -> list[float]:
    """-log p(chunk[j + 1] | chunk[:j + 1]) for j in n // 2 .. n - 2 (n = len(chunk)): the tokens of
    the chunk's second half that llama-perplexity scores, the chunk evaluated from scratch."""
    import mlx.core as mx

    first = len(chunk) // 2
    logits = _logits_from(model, mx.array(list(chunk))[None], first, len(chunk) - 1)
    logits = logits.astype(mx.float32)
    targets = mx.array(list(chunk[first + 1:]))
    log_probs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    picked = mx.take_along_axis(log_probs, targets[:, None], axis=-1)[:, 0]
    return (-picked).tolist()


def chunked_perplexity(model: Any, tokens: Sequence[int], n_ctx: int = 512,
                       bos: int | None = None, max_chunks: int | None = None,
                       on_chunk: Callable[[int, float], None] | None = None) -> ChunkedPerplexity:
    """Perplexity by llama.cpp's `llama-perplexity -c n_ctx` method (tools/perplexity/
    perplexity.cpp, perplexity()), so the two compare: the text's tokens split into chunks of
    n_ctx (perplexity_chunks: first token BOS where the model adds one), each chunk evaluated on
    its own from an empty context, and only its second half scored: the logits at positions
    n_ctx // 2 .. n_ctx - 2 against the next tokens. The estimate is exp of the mean negative
    log-likelihood over every scored token, its error ppl * sqrt(var / (count - 1)) as
    llama-perplexity prints it. `max_chunks`: the first chunks only (its --chunks). `on_chunk`
    (index, running perplexity) after each chunk."""
    chunks = perplexity_chunks(tokens, n_ctx, bos)
    if max_chunks is not None:
        chunks = chunks[:max_chunks]
    total = total_sq = 0.0
    count = 0
    chunk_ppl: list[float] = []
    running: list[float] = []
    for index, chunk in enumerate(chunks):
        nlls = chunk_nlls(model, chunk)
        total += sum(nlls)
        total_sq += sum(value * value for value in nlls)
        count += len(nlls)
        chunk_ppl.append(math.exp(sum(nlls) / len(nlls)))
        running.append(math.exp(total / count))
        if on_chunk is not None:
            on_chunk(index, running[-1])
    mean = total / count
    ppl = math.exp(mean)
    variance = total_sq / count - mean * mean
    error = ppl * math.sqrt(variance / (count - 1)) if variance > 0 and count > 1 else 0.0
    return ChunkedPerplexity(ppl=ppl, error=error, n_ctx=n_ctx, text_tokens=len(tokens),
                             scored=count, chunk_ppl=tuple(chunk_ppl), running=tuple(running))


def compute_in_float32(model: Any) -> Any:
    """Dequantize and cast to float32, as rewind's loader does on CPU (only float32 matmuls reach
    OpenBLAS): the stored form's rounding stays, the activation dtype no longer differs per form."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import dequantize_model

    dequantize_model(model)
    model.update(tree_map(lambda value: value.astype(mx.float32)
                          if mx.issubdtype(value.dtype, mx.floating) else value, model.parameters()))
    mx.eval(model.parameters())
    return model
