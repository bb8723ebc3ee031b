"""The scheduler: admits requests into N slots, prefills them chunk by chunk, decodes them as a batch.

Runs on the engine thread only (the one thread that touches the model and every live cache).
Each loop iteration does at most one prefill chunk (so running sequences keep decoding) and one
batched decode step. A sequence prefills on its own batch-1 cache (restored from the prompt cache
when there is one), samples its first token from the prompt's last logits, then joins the decode
batch through the batch cache classes' merge/extend and leaves it through filter.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from rewind.config import BLOCK_TOKENS, EngineConfig
from rewind.engine.forward import last_logits, prefill
from rewind.engine.positions import given_positions, takes_positions
from rewind.engine.residuals import given_residuals
from rewind.engine.request import (
    FinishEvent,
    FinishReason,
    GenerationRequest,
    QueueFullError,
    TokenEvent,
    Usage,
)
from rewind.engine.sampler import Sampled, SequenceSampler, sample_rows
from rewind.engine.stops import TextStream

log = logging.getLogger(__name__)

EventSink = Callable[[TokenEvent | FinishEvent], None]
SampleListener = Callable[[str, float], None]


@dataclass
class Sequence:
    """One request's life inside the engine."""

    request: GenerationRequest
    emit: EventSink
    sampler: SequenceSampler
    text: TextStream
    submitted_at: float
    usage: Usage
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Set once it holds a slot and its cached prefix is restored (usage.cached_tokens is final),
    # or once it finished without: Anthropic's stream reports cache figures in its first event.
    admitted: threading.Event = field(default_factory=threading.Event)
    cache: list[Any] | None = None  # its own batch-1 cache while prefilling
    prefilled: int = 0  # prompt tokens held by `cache`
    checkpoint_at: set[int] = field(default_factory=set)  # extra checkpoint positions
    generated: list[int] = field(default_factory=list)
    next_input: int = -1  # last sampled token, the input of its next decode step
    last_token_at: float = 0.0

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt_tokens


@dataclass
class Counters:
    requests_finished: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    prefilled_tokens: int = 0  # prompt tokens actually computed
    generated_tokens: int = 0
    cached_tokens: int = 0
    cached_ram_tokens: int = 0
    cached_disk_tokens: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)


class Scheduler:
    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig, prompt_cache: Any,
                 eos_token_ids: set[int], listeners: list[SampleListener]) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.prompt_cache = prompt_cache
        # Chunks and checkpoints follow the prompt cache's block size (256 unless configured).
        self.block_tokens: int = getattr(prompt_cache, "block_tokens", None) or BLOCK_TOKENS
        self.eos_token_ids = eos_token_ids
        self.listeners = listeners
        self.counters = Counters()
        self._lock = threading.Lock()  # guards `waiting` (submit runs on callers' threads)
        self.waiting: deque[Sequence] = deque()
        self.prefilling: deque[Sequence] = deque()
        self.decoding: list[Sequence] = []  # row i of the batch cache is decoding[i]
        self.batch_cache: list[Any] | None = None
        self._typical_request_seconds = 0.0  # moving average over finished requests

    # ---- called from any thread -------------------------------------------------------------

    def enqueue(self, seq: Sequence) -> None:
        with self._lock:
            if len(self.waiting) >= self.config.max_queue:
                raise QueueFullError(len(self.waiting), self.config.max_queue,
                                     self._retry_after(len(self.waiting)))
            self.waiting.append(seq)

    def _retry_after(self, queued: int) -> float:
        """When a slot is likely free for one more: the queue ahead drains `parallel` requests
        per typical request time (1 s before any request finished)."""
        typical = self._typical_request_seconds or 1.0
        return min(60.0, max(1.0, typical * (queued + 1) / self.config.parallel))

    @property
    def running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    @property
    def queued(self) -> int:
        return len(self.waiting)

    # ---- engine thread only -----------------------------------------------------------------

    def step(self) -> bool:
        """One loop iteration; False when there was nothing to do."""
        self._drop_cancelled()
        self._admit()
        did_work = False
        if self.prefilling:
            self._prefill_chunk(self.prefilling[0])
            did_work = True
        if self.decoding:
            self._decode_step()
            did_work = True
        return did_work

    def abort_all(self, reason: FinishReason, error: str | None) -> None:
        """Finish every request in the engine (shutdown, or a failure outside any request)."""
        with self._lock:
            waiting, self.waiting = list(self.waiting), deque()
        for seq in [*waiting, *self.prefilling, *self.decoding]:
            self._finish(seq, reason, error)
        self.prefilling.clear()
        self.decoding = []
        self.batch_cache = None

    # ---- admission and cancellation ---------------------------------------------------------

    def _drop_cancelled(self) -> None:
        with self._lock:
            gone = [s for s in self.waiting if s.cancelled.is_set()]
            for seq in gone:
                self.waiting.remove(seq)
        for seq in [s for s in self.prefilling if s.cancelled.is_set()]:
            self.prefilling.remove(seq)
            seq.cache = None
            gone.append(seq)
        leaving = [i for i, s in enumerate(self.decoding) if s.cancelled.is_set()]
        gone += [self.decoding[i] for i in leaving]
        self._leave_batch(leaving)
        for seq in gone:
            self._finish(seq, "cancelled")
        if gone:
            mx.clear_cache()  # hand the freed cache memory back now, not at some later step

    def _admit(self) -> None:
        while self.running < self.config.parallel:
            with self._lock:
                if not self.waiting:
                    return
                seq = self.waiting.popleft()
            try:
                self._start_prefill(seq)
            except Exception as exc:  # a bad request ends itself, never the engine
                log.exception("request %s failed at admission", seq.request.request_id)
                self._finish(seq, "error", f"{type(exc).__name__}: {exc}")
                continue
            seq.admitted.set()
            self.prefilling.append(seq)

    def _start_prefill(self, seq: Sequence) -> None:
        usage = seq.usage
        usage.queue_seconds = time.perf_counter() - seq.submitted_at
        usage.prompt_tokens = len(seq.prompt)
        self.counters.prompt_tokens += len(seq.prompt)
        self._notify("queue_seconds", usage.queue_seconds)
        restored = None
        if self.prompt_cache is not None:
            try:
                restored = self.prompt_cache.restore(seq.prompt, seq.request.extras,
                                                     max_kv_size=self.config.max_kv_size)
            except Exception:  # the cache is an optimisation: a fault costs recomputation only
                log.exception("prompt-cache restore failed; computing the whole prompt")
        if restored is not None:
            seq.cache, seq.prefilled = restored.cache, restored.tokens
            usage.cached_tokens = restored.tokens
            usage.cached_ram_tokens = restored.ram_tokens
            usage.cached_disk_tokens = restored.disk_tokens
            usage.restore_seconds = restored.seconds
            self.counters.cached_tokens += restored.tokens
            self.counters.cached_ram_tokens += restored.ram_tokens
            self.counters.cached_disk_tokens += restored.disk_tokens
            self._notify("restore_seconds", restored.seconds)
        else:
            seq.cache = make_prompt_cache(self.model, max_kv_size=self.config.max_kv_size)
            seq.prefilled = 0
        seq.checkpoint_at = {p for p in seq.request.checkpoints if 0 < p <= len(seq.prompt)}

    # ---- prefill ----------------------------------------------------------------------------

    def _chunk_end(self, seq: Sequence, start: int) -> int:
        """Where the next model call ends: the next 256 multiple, requested checkpoint, or the
        prompt's last token but one; then the last token alone (only its logits are needed, and
        the output projection costs as much as the rest of a small model). The chunking is the
        same with and without a prompt cache, so the two differ only by what was restored."""
        total = len(seq.prompt)
        block = self.block_tokens
        stops = [(start // block + 1) * block, total - 1, total]
        stops += [p for p in seq.checkpoint_at if p > start]
        return min(p for p in stops if start < p <= total)

    def _prefill_chunk(self, seq: Sequence) -> None:
        """Up to config.prefill_chunk prompt tokens of one sequence, checkpointing at each chunk
        end; at the prompt's end, sample its first token and move it to the decode batch."""
        try:
            total = len(seq.prompt)
            if seq.prefilled >= total:
                raise RuntimeError(f"nothing left to prefill ({seq.prefilled} of {total} cached)")
            budget_end = seq.prefilled + self.config.prefill_chunk
            while True:
                start, end = seq.prefilled, self._chunk_end(seq, seq.prefilled)
                # The ids the model is given: the prompt's, or the image prompt's model_tokens
                # where its model reads more than embeddings from them (Gemma 4's per-layer
                # inputs: image tokens as 0). Cache keys and checkpoints keep seq.prompt.
                ids = seq.prompt if seq.request.model_tokens is None else seq.request.model_tokens
                chunk = mx.array([ids[start:end]])
                # Image prompts: this chunk's input embeddings (image features in image spans).
                embeds = None if seq.request.embed is None else seq.request.embed(start, end)
                # Qwen-VL image prompts: their 3-D rotary positions (rewind.engine.positions);
                # Qwen3-VL's: the features added after its first layers (engine.residuals).
                positions = (None if seq.request.positions is None
                             else seq.request.positions(start, end))
                residuals = (None if seq.request.layer_residuals is None
                             else seq.request.layer_residuals(start, end))
                if end == total:
                    with (given_positions(self.model, positions),
                          given_residuals(self.model, residuals)):
                        logits = last_logits(self.model, chunk, seq.cache, embeds)
                    mx.eval(logits, [c.state for c in seq.cache])
                    seq.prefilled = end
                    self.counters.prefilled_tokens += end - start
                    sampled = sample_rows([seq.sampler], logits)[0]
                    break
                with (given_positions(self.model, positions),
                      given_residuals(self.model, residuals)):
                    prefill(self.model, chunk, seq.cache, embeds)
                seq.prefilled = end
                self.counters.prefilled_tokens += end - start
                self._checkpoint(seq, seq.prompt[:end], seq.cache)
                if end >= budget_end:
                    return  # the rest in a later iteration: let the decode batch move
        except Exception as exc:
            log.exception("prefill of %s failed", seq.request.request_id)
            self.prefilling.remove(seq)
            seq.cache = None
            self._finish(seq, "error", f"{type(exc).__name__}: {exc}")
            return
        self.prefilling.remove(seq)
        if self._on_token(seq, sampled):
            try:
                self._join_batch(seq)
            except Exception as exc:  # e.g. a cache class that cannot batch
                log.exception("joining the decode batch failed for %s", seq.request.request_id)
                self._finish(seq, "error", f"{type(exc).__name__}: {exc}")
        seq.cache = None

    def _checkpoint(self, seq: Sequence, tokens: list[int], cache: list[Any]) -> None:
        """Hand the prompt cache a checkpoint; `cache` holds exactly `tokens`."""
        if self.prompt_cache is None:
            return
        try:
            self.prompt_cache.checkpoint(tokens, cache, seq.request.extras)
        except Exception:  # the cache is an optimisation: a failing checkpoint costs reuse only
            log.exception("prompt-cache checkpoint at %d failed", len(tokens))

    # ---- the decode batch -------------------------------------------------------------------

    def _join_batch(self, seq: Sequence) -> None:
        single = [layer.merge([layer]) for layer in seq.cache or []]
        if self.batch_cache is None:
            self.batch_cache = single
        else:
            for batch_layer, new_layer in zip(self.batch_cache, single):
                batch_layer.extend(new_layer)
        self.decoding.append(seq)

    def _leave_batch(self, rows: list[int]) -> None:
        if not rows:
            return
        keep = [i for i in range(len(self.decoding)) if i not in set(rows)]
        self.decoding = [self.decoding[i] for i in keep]
        if not keep:
            self.batch_cache = None
            return
        for layer in self.batch_cache or []:
            layer.filter(keep)

    def _decode_step(self) -> None:
        try:
            inputs = mx.array([[s.next_input] for s in self.decoding])
            with given_positions(self.model, self._decode_positions()):
                logits = last_logits(self.model, inputs, self.batch_cache)
            results = sample_rows([s.sampler for s in self.decoding], logits)
        except Exception as exc:
            log.exception("decode step failed")
            for seq in self.decoding:
                self._finish(seq, "error", f"{type(exc).__name__}: {exc}")
            self.decoding, self.batch_cache = [], None
            return
        done = [i for i, (seq, sampled) in enumerate(zip(self.decoding, results))
                if not self._on_token(seq, sampled)]
        if self.prompt_cache is not None:
            self._decode_checkpoints(set(done))
        self._leave_batch(done)
        if done:
            mx.clear_cache()

    def _decode_positions(self) -> mx.array | None:
        """[3, rows, 1] rotary positions of this decode step's inputs on a model that takes
        positions (rewind.engine.positions): each row's input is token index `held` of its
        sequence, at position held + the request's position_delta. None on other models."""
        if not takes_positions(self.model):
            return None
        rows = [len(s.prompt) + len(s.generated) - 1 + s.request.position_delta
                for s in self.decoding]
        return mx.broadcast_to(mx.array(rows, dtype=mx.int32)[None, :, None],
                               (3, len(rows), 1))

    def _decode_checkpoints(self, finished_rows: set[int]) -> None:
        """Checkpoint a decoding sequence every 256 tokens it holds and where it ends (the next
        turn of a conversation usually re-sends this answer). A row's batch cache holds its
        prompt and every generated token but the last, which is the next step's input."""
        for row, seq in enumerate(self.decoding):
            held = len(seq.prompt) + len(seq.generated) - 1
            if held % self.block_tokens != 0 and row not in finished_rows:
                continue
            if held <= len(seq.prompt):
                continue  # nothing beyond the prompt's own checkpoints
            try:
                single = [layer.extract(row) for layer in self.batch_cache or []]
            except Exception:
                log.exception("extracting row %d for a checkpoint failed", row)
                continue
            self._checkpoint(seq, seq.prompt + seq.generated[:-1], single)

    # ---- tokens out -------------------------------------------------------------------------

    def _on_token(self, seq: Sequence, sampled: Sampled) -> bool:
        """Emit one generated token; True while the sequence goes on. A failure here (say, in
        detokenization) ends this request only."""
        try:
            return self._emit_token(seq, sampled)
        except Exception as exc:
            log.exception("token handling failed for %s", seq.request.request_id)
            self._finish(seq, "error", f"{type(exc).__name__}: {exc}")
            return False

    def _emit_token(self, seq: Sequence, sampled: Sampled) -> bool:
        now = time.perf_counter()
        if not seq.generated:
            seq.usage.ttft_seconds = now - seq.submitted_at
            self._notify("ttft_seconds", seq.usage.ttft_seconds)
        else:
            self._notify("itl_seconds", now - seq.last_token_at)
        seq.last_token_at = now
        token = sampled.token
        seq.generated.append(token)
        seq.sampler.accept(token)
        seq.next_input = token
        self.counters.generated_tokens += 1

        reason: FinishReason | None = None
        stop_string = None
        if token in self.eos_token_ids:
            step = seq.text.finish()
            reason = "stop"
        else:
            step = seq.text.add(token)
            if step.stop is not None:
                reason, stop_string = "stop", step.stop
            elif len(seq.generated) >= seq.request.params.max_tokens:
                tail = seq.text.finish()
                step.text += tail.text
                reason, stop_string = ("stop", tail.stop) if tail.stop else ("length", None)
        seq.emit(TokenEvent(token, step.text, sampled.logprob, sampled.top_logprobs))
        if reason is not None:
            self._finish(seq, reason, stop_string=stop_string)
            return False
        return True

    def _finish(self, seq: Sequence, reason: FinishReason, error: str | None = None,
                stop_string: str | None = None) -> None:
        usage = seq.usage
        usage.completion_tokens = len(seq.generated)
        usage.total_seconds = time.perf_counter() - seq.submitted_at
        if reason in ("stop", "length"):
            previous = self._typical_request_seconds
            self._typical_request_seconds = (usage.total_seconds if previous == 0.0
                                             else 0.8 * previous + 0.2 * usage.total_seconds)
        self.counters.requests_finished += 1
        reasons = self.counters.finish_reasons
        reasons[reason] = reasons.get(reason, 0) + 1
        seq.emit(FinishEvent(reason, usage, error, stop_string))
        seq.admitted.set()

    def _notify(self, name: str, value: float) -> None:
        for listener in self.listeners:
            try:
                listener(name, value)
            except Exception:  # a metrics hook must not break generation
                log.exception("sample listener failed")
