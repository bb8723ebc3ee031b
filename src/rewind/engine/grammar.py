"""Constrained decoding: a grammar (llguidance's, which llama.cpp and vLLM use too) turns into a
token mask for one row of the batch at each step, so constrained and free requests share a batch
and the prompt cache.

The engine holds one GrammarBackend (the tokenizer as llguidance sees it, built on first use:
about a second for a 262k vocabulary); each constrained sequence owns a Constraint (a matcher that
follows the tokens the row samples). Grammars come from the server as llguidance grammar text
(`LLMatcher.grammar_from_json_schema`, `grammar_from_lark`).
"""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx
import numpy as np

from rewind.engine.request import InvalidRequestError


class Constraint:
    """The grammar state of one sequence."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size

    def mask(self) -> mx.array:
        """Allowed next tokens, a bool array [vocab] (llguidance's bitmask, one bit a token)."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool)
        if allowed.shape[0] < self.vocab_size:  # logits wider than the tokenizer: padding rows
            allowed = np.pad(allowed, (0, self.vocab_size - allowed.shape[0]))
        return mx.array(allowed)

    def accept(self, token: int) -> None:
        self.matcher.consume_token(token)

    @property
    def failed(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


class GrammarBackend:
    """llguidance's view of the model's tokenizer, shared by every constraint of one engine."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None

    def _llguidance_tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                hf = getattr(self._tokenizer, "_tokenizer", self._tokenizer)
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    hf, n_vocab=self.vocab_size, eos_token=self._eos or None)
            return self._ll_tokenizer

    def constraint(self, grammar: str) -> Constraint:
        """A fresh matcher for `grammar`; InvalidRequestError naming the problem if it is bad."""
        try:
            from llguidance import LLMatcher
        except ImportError as exc:  # a dependency of rewind-engine; say so if it is missing
            raise InvalidRequestError("constrained decoding needs llguidance "
                                      "(pip install llguidance)") from exc
        tokenizer = self._llguidance_tokenizer()
        problem = LLMatcher.validate_grammar(grammar, tokenizer)
        if problem and not problem.startswith("WARNING"):
            raise InvalidRequestError(f"invalid grammar: {problem}")
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"invalid grammar: {matcher.get_error()}")
        return Constraint(matcher, self.vocab_size)
