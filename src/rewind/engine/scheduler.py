"""The scheduler: admits requests into N slots and decides, step by step, what the model runs.

Runs on the engine thread only (the one thread that touches the model and every live cache).
Each step runs every decoding row plus prompt chunks of waiting sequences, up to a token budget
(`EngineConfig.mixed_prefill_tokens` while rows decode, `prefill_chunk` when none does), as vLLM
and SGLang schedule: a long prompt arriving mid-stream delays the running rows by one budget's
worth of work per token, not by its whole prefill. Where the runner can stop a call between
layers (the CPU kernels: `runner.layer_count`), the budget counts prompt tokens x layers, so a
chunk's layers are spread over several steps and a budget smaller than one chunk holds; the
calls still cover the same chunks, so the answer does not change. The runner
(rewind.engine.runner) runs a step, in one forward pass where the backend allows it, and never
decides.

A sequence prefills on its own batch-1 cache (restored from the prompt cache when there is one),
in calls cut on the one chunk grid, checkpointing where rewind.cache.checkpoints says; it
samples its first token from the prompt's last logits, then joins the decode batch through the
batch cache classes' merge/extend and leaves it through filter.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from rewind.cache.checkpoints import chunk_ends, decode_checkpoint, is_checkpoint
from rewind.cache.rollback import roll_back, rolls_back
from rewind.config import PASS_TOKENS, EngineConfig
from rewind.engine.positions import takes_positions
from rewind.engine.request import (
    EngineStoppedError,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    QueueFullError,
    TokenEvent,
    Usage,
)
from rewind.engine.runner import ModelRunner, RowCaches, Segment
from rewind.engine.sampler import (
    LazySamples,
    Sampled,
    SequenceSampler,
    read_samples,
    sample_lazy,
    sample_rows,
)
from rewind.engine.speculation import RowDrafts, Speculator, resolve_mode, tenant_of
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
    # A chunk part-way through the layers (runner.layer_count): its end and its rows in flight.
    # `cache` then holds the chunk in the layers it passed; `prefilled` counts it once all did.
    partial_end: int = 0
    partial: Any = None
    checkpoint_at: set[int] = field(default_factory=set)  # extra checkpoint positions
    generated: list[int] = field(default_factory=list)
    next_input: int = -1  # last sampled token, the input of its next decode step
    last_token_at: float = 0.0
    drafts: RowDrafts | None = None  # its speculative-decoding state, while it may draft

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
    steps: int = 0  # engine steps that ran the model
    pipelined_steps: int = 0  # of which decode steps queued before the previous was read
    # Prefill work in prompt tokens x layers passed (x the layer count where calls stop between
    # layers; one "layer" a call elsewhere), and the chunk calls that stopped between layers.
    prefill_token_layers: int = 0
    partial_chunk_calls: int = 0
    # Prefill-only passes a mixed step ran after the decoding rows' (a sequence's next call).
    extra_prefill_passes: int = 0


@dataclass
class Chunk:
    """One prefill call of one sequence: prompt positions [start, end)."""

    seq: Sequence
    start: int
    end: int
    stop: int | None = None  # run only the layers before this one (None: all)
    first: int = 0  # the layer it starts at (a chunk in flight goes on where it stopped)


class Scheduler:
    def __init__(self, runner: ModelRunner, config: EngineConfig, prompt_cache: Any,
                 eos_token_ids: set[int], listeners: list[SampleListener]) -> None:
        self.runner = runner
        self.model = runner.model
        self.config = config
        self.prompt_cache = prompt_cache
        # Checkpoints follow the prompt cache's block size, model calls a grid that divides it:
        # the runner's, built on that cache (rewind.cache.checkpoints).
        self.block_tokens: int = runner.block_tokens
        self.chunk_tokens: int = runner.chunk_tokens
        # Layers a chunk can be spread over, steps apart (the CPU kernels); None: whole chunks.
        self.layer_count = runner.layer_count
        self.mixed_prefill_tokens = config.resolved_mixed_prefill_tokens(
            sliced=self.layer_count is not None)
        self.pipeline = config.resolved_pipeline_decode() and not takes_positions(self.model)
        # Speculative decoding where a row can verify a draft in a call of its own on its own
        # cache, in the decode step's pass (RowCaches: the CPU kernels); see
        # rewind.engine.speculation for why only there.
        # `auto` leaves a pipelined decode (asked for on the CPU) as it is; a mode named
        # explicitly turns pipelining off, since a step drafts from the tokens the last one read.
        rows_alone = self.layer_count is not None and not takes_positions(self.model)
        mode = resolve_mode(config.speculative, rows_alone and not self.pipeline)
        if mode != "off" and not rows_alone:
            log.warning("speculative decoding (%s) needs rows decoding through the CPU kernels; "
                        "this backend decodes without it", mode)
            mode = "off"
        if mode != "off":
            self.pipeline = False
        self.speculator: Speculator | None = (
            None if mode == "off" else Speculator(mode, config.speculative_max_draft,
                                                  config.speculative_step_tokens))
        self._inflight: LazySamples | None = None  # a queued decode step's unread tokens
        self.eos_token_ids = eos_token_ids
        self.listeners = listeners
        self.counters = Counters()
        self._lock = threading.Lock()  # guards `waiting` (submit runs on callers' threads)
        self.waiting: deque[Sequence] = deque()
        self.prefilling: deque[Sequence] = deque()
        self.decoding: list[Sequence] = []  # row i of the batch cache is decoding[i]
        self.batch_cache: list[Any] | None = None
        self._typical_request_seconds = 0.0  # moving average over finished requests
        self._restored_now = False  # this step restored a prefix from the prompt cache
        self.closed: str | None = None  # why enqueue() refuses (close()); None: it takes requests

    # ---- called from any thread -------------------------------------------------------------

    def enqueue(self, seq: Sequence) -> None:
        with self._lock:
            if self.closed is not None:
                raise EngineStoppedError(self.closed)
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
        """One loop iteration; False when there was nothing to do.

        A failure of one request's own inputs or outputs (its image embeddings, its sampler or
        grammar, its text, its checkpoint) ends that request here. A failure of the model's work
        (a forward call, or the evaluation of its outputs) raises out of step(): which row
        caused it is unknown and every cache in the pass may be half advanced, so the engine
        ends all its requests and stops (Engine._fail)."""
        if self._inflight is not None:
            if self._can_pipeline():
                self._pipelined_step()
                return True
            self._flush()
        started = time.perf_counter()
        self._drop_cancelled()
        self._restored_now = False
        self._admit()
        if not self.prefilling and not self.decoding:
            return False
        if self._can_pipeline():
            self._pipelined_step()
            return True
        self.counters.steps += 1
        admitted = time.perf_counter()
        rows = len(self.decoding)
        # Sliced rounds are planned within the mixed budget, whole-chunk rounds are not.
        sliced = self._slicing
        rounds = self._plan_prefill()
        self._run_round(rounds[0] if rounds else [], with_decode=bool(self.decoding))
        ran = 1
        for chunks in rounds[1:]:
            if self.decoding and not sliced:
                # A prompt finished in an earlier round and its sequence now decodes: the rest of
                # this step's prefill (up to `prefill_chunk` tokens, seconds on a CPU) would hold
                # its second token; the next steps mix it with prefill under the budget instead.
                break
            # A sequence that ended meanwhile (a failed call) drops out of the later rounds.
            chunks = [c for c in chunks if c.seq in self.prefilling and c.seq.prefilled == c.start]
            if chunks:
                self._run_round(chunks, with_decode=False)
                if sliced:
                    self.counters.extra_prefill_passes += 1
            ran += 1
        if log.isEnabledFor(logging.DEBUG):
            # Where a stream's time between tokens goes (`rewind serve --log-level debug`).
            work = ", ".join(f"{c.end - c.start}x{(c.stop or self.layer_count or 1) - c.first}"
                             for chunks in rounds[:ran] for c in chunks)
            now = time.perf_counter()
            log.debug("step %d: %d decoding, prefill [%s] (tokens x layers), %.1f ms "
                      "(admission %.1f ms)", self.counters.steps, rows, work,
                      (now - started) * 1e3, (admitted - started) * 1e3)
        return True

    def close(self, reason: FinishReason, error: str) -> None:
        """abort_all, and refuse every later enqueue with EngineStoppedError(error): a request
        submitted while the engine fails gets an answer, never a queue nobody steps."""
        with self._lock:
            self.closed = error
        self.abort_all(reason, error)

    def abort_all(self, reason: FinishReason, error: str | None) -> None:
        """Finish every request in the engine (shutdown, or a failure outside any request)."""
        with self._lock:
            waiting, self.waiting = list(self.waiting), deque()
        for seq in [*waiting, *self.prefilling, *self.decoding]:
            self._finish(seq, reason, error)
        self.prefilling.clear()
        self.decoding = []
        self.batch_cache = None
        self._inflight = None

    # ---- pipelined decode -------------------------------------------------------------------

    def _can_pipeline(self) -> bool:
        """Whether this step can be a decode step queued before the previous step's tokens are
        read (mlx-lm's batch generator does the same): only decoding, nobody to admit or drop,
        and no row whose next logits depend on the token before (penalties, grammars)."""
        if not self.pipeline or not self.decoding or self.prefilling:
            return False
        if self.waiting and self.running < self.config.parallel:
            return False
        return not any(s.cancelled.is_set() or s.sampler.needs_history for s in self.decoding)

    def _pipelined_step(self) -> None:
        """Queue a decode step on the in-flight tokens (or the rows' last ones), then read and
        emit the in-flight ones while it runs."""
        self.counters.steps += 1
        self.counters.pipelined_steps += 1
        previous = self._inflight
        inputs = (mx.array([[s.next_input] for s in self.decoding]) if previous is None
                  else previous.tokens.reshape(-1, 1))
        self._inflight = None
        # A failing forward call raises out of step() (see step).
        logits = self.runner.forward(
            [Segment(inputs, self.batch_cache or [], logits=True)], evaluate=False)[0]
        try:
            lazy = sample_lazy([s.sampler for s in self.decoding], logits)
        except Exception as exc:
            self._fail_decoding(exc)
            return
        mx.async_eval(lazy.arrays())
        self._inflight = lazy
        if previous is not None:
            # The step just queued fed these tokens: the caches hold them once it is done.
            self._emit_decoded(previous, fed=True)

    def _flush(self) -> None:
        """Read and emit the in-flight step's tokens; afterwards the caches hold every generated
        token but the last, as after an unpipelined step."""
        lazy, self._inflight = self._inflight, None
        if lazy is not None:
            self._emit_decoded(lazy, fed=False)

    # ---- admission and cancellation ---------------------------------------------------------

    def _drop_cancelled(self) -> None:
        with self._lock:
            gone = [s for s in self.waiting if s.cancelled.is_set()]
            for seq in gone:
                self.waiting.remove(seq)
        for seq in [s for s in self.prefilling if s.cancelled.is_set()]:
            self.prefilling.remove(seq)
            seq.cache, seq.partial = None, None
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
            self._restored_now = self._restored_now or restored.tokens > 0
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
            seq.cache = self.runner.new_cache()
            seq.prefilled = 0
        seq.checkpoint_at = {p for p in seq.request.checkpoints if 0 < p <= len(seq.prompt)}

    # ---- prefill ----------------------------------------------------------------------------

    @property
    def _slicing(self) -> bool:
        """Whether this step's prefill goes beside decoding rows in layer slices (the CPU
        kernels), planned by `_plan_slices`."""
        return bool(self.decoding) and self.layer_count is not None

    def _prefill_budget(self) -> int:
        """Prompt tokens this step: few while rows decode (each decoding row waits for them),
        a larger batch of chunks when nothing else runs."""
        if self.decoding:
            return max(self.mixed_prefill_tokens - len(self.decoding), 1)
        return max(self.config.prefill_chunk, 1)

    def _plan_prefill(self) -> list[list[Chunk]]:
        """This step's prefill calls in rounds: round r holds the r-th chunk of each sequence
        that gets one. Chunks of one sequence depend on each other; chunks of different ones
        share a forward pass (each weight read once for all), so the budget goes round-robin
        over the waiting prompts, oldest first. At least one chunk per step, so a full decode
        batch cannot starve a waiting prompt."""
        budget = self._prefill_budget()
        if self._slicing:
            if self._restored_now:
                # The restore (copying a long prefix into live caches) was this step's share
                # of work beside the decoding rows; prefill goes on next step.
                return []
            return self._plan_slices(budget)
        pending = {id(seq): chunk_ends(seq.prefilled, len(seq.prompt), self.chunk_tokens,
                                       seq.checkpoint_at) for seq in self.prefilling}
        starts = {id(seq): seq.prefilled for seq in self.prefilling}
        rounds: list[list[Chunk]] = []
        for depth in range(max((len(ends) for ends in pending.values()), default=0)):
            chunks: list[Chunk] = []
            for seq in self.prefilling:
                ends = pending[id(seq)]
                if depth >= len(ends):
                    continue
                start, end = starts[id(seq)], ends[depth]
                if end - start > budget and (rounds or chunks):
                    break
                first = seq.partial.done if seq.partial is not None and depth == 0 else 0
                chunks.append(Chunk(seq, start, end, first=first))
                budget -= end - start
                starts[id(seq)] = end
            else:
                rounds.append(chunks)
                continue
            if chunks:
                rounds.append(chunks)
            break
        return rounds

    def _plan_slices(self, budget: int) -> list[list[Chunk]]:
        """This step's prefill work next to the decoding rows, where a chunk's layers can be
        spread over steps: `budget` prompt tokens' worth of work through every layer at no
        context, counted with each layer's attention over what the sequence holds
        (runner.layer_costs), oldest prompt first, at least one layer of one chunk. Each
        sequence goes on with its chunk in flight or starts its next one; the chunk grid, and so
        the answer, is the same as whole chunks'. A prompt's last call goes alone in its pass:
        its sequence then joins the decode batch.

        Round 0 shares the decoding rows' pass. Budget left after it goes to further passes
        (prefill only) for the sequences whose chunk passed every layer: their next chunk
        depends on it, so it needs a pass of its own, charged `PASS_TOKENS` for reading the
        weights again. Those passes are for the small calls the checkpoints cut (a message
        boundary, the prompt's last token but one), which would otherwise cost a step each."""
        total_layers = self.layer_count or 1
        unit = sum(self.runner.layer_costs(0))
        left = budget * unit
        # (sequence, start, end of its call in flight or None, layers that call has passed)
        candidates = [(seq, seq.prefilled,
                       seq.partial_end if seq.partial is not None else None,
                       seq.partial.done if seq.partial is not None else 0)
                      for seq in self.prefilling]
        rounds: list[list[Chunk]] = []
        while candidates and left > 0:
            if rounds:
                left -= PASS_TOKENS * unit
                if left <= 0:
                    break
            chunks: list[Chunk] = []
            for seq, start, end, done in candidates:
                if end is None:
                    end = chunk_ends(start, len(seq.prompt), self.chunk_tokens,
                                     seq.checkpoint_at)[0]
                tokens = end - start
                joins = end == len(seq.prompt)
                if joins and chunks:
                    break
                costs = [tokens * cost for cost in self.runner.layer_costs(end)]
                if not self._sliceable(seq):
                    stop, spent = None, sum(costs[done:])
                    if spent > left and (chunks or rounds):
                        break
                else:
                    stop, spent = done, 0.0
                    while stop < total_layers and spent + costs[stop] <= left:
                        spent += costs[stop]
                        stop += 1
                    if stop == done:
                        if chunks or rounds:
                            break
                        stop, spent = done + 1, costs[done]
                chunks.append(Chunk(seq, start, end, stop=stop, first=done))
                left -= spent
                if left <= 0 or joins:
                    break
            if not chunks:
                break
            rounds.append(chunks)
            # Next pass: the sequences whose call passed every layer and has prompt after it (a
            # joining call ends its sequence's prefill).
            candidates = [(c.seq, c.end, None, 0) for c in chunks
                          if c.stop in (None, total_layers) and c.end < len(c.seq.prompt)]
        return rounds

    @staticmethod
    def _sliceable(seq: Sequence) -> bool:
        """Whether its calls can stop between layers: no per-call model state (rotary positions,
        per-layer residuals) to carry over."""
        return seq.request.positions is None and seq.request.layer_residuals is None

    def _chunk_segment(self, chunk: Chunk) -> Segment:
        seq, start, end = chunk.seq, chunk.start, chunk.end
        request = seq.request
        # The ids the model is given: the prompt's, or the image prompt's model_tokens where its
        # model reads more than embeddings from them (Gemma 4's per-layer inputs: image tokens
        # as 0). Cache keys and checkpoints keep seq.prompt.
        ids = seq.prompt if request.model_tokens is None else request.model_tokens
        if seq.partial is not None:  # its rows are in flight: no new inputs
            return Segment(tokens=mx.array([[0]]), cache=seq.cache or [],
                           logits=chunk.end == len(seq.prompt), stop=chunk.stop,
                           carry=seq.partial)
        return Segment(
            tokens=mx.array([ids[start:end]]),
            cache=seq.cache or [],
            logits=end == len(seq.prompt),
            # Image prompts: this chunk's input embeddings (image features in image spans).
            embeds=None if request.embed is None else request.embed(start, end),
            # Qwen-VL image prompts: their 3-D rotary positions (rewind.engine.positions);
            # Qwen3-VL's: the features added after its first layers (engine.residuals).
            positions=None if request.positions is None else request.positions(start, end),
            residuals=(None if request.layer_residuals is None
                       else request.layer_residuals(start, end)),
            stop=chunk.stop,
        )

    def _run_round(self, chunks: list[Chunk], with_decode: bool) -> None:
        """One forward pass: the decode batch (when `with_decode`) and these prefill chunks."""
        segments: list[Segment] = []
        drafted: list[tuple[int, list[int]]] = []
        if with_decode:
            try:
                drafted = self._drafts()
                segments.extend(self._decode_segments(drafted))
            except Exception as exc:
                self._fail_decoding(exc)
                with_decode, drafted = False, []
        decode_segments = len(segments)
        taken: list[tuple[Chunk, Segment]] = []
        for chunk in chunks:
            try:  # a request's own inputs (image features) failing ends that request only
                segments.append(self._chunk_segment(chunk))
                taken.append((chunk, segments[-1]))
            except Exception as exc:
                self._fail_prefill(chunk.seq, exc)
        if not segments:
            return
        # A failing forward call raises out of step() (see step).
        logits = self.runner.forward(segments)
        if with_decode and drafted:
            self._after_verify(drafted, logits[:decode_segments])
        elif with_decode:
            self._after_decode(logits[0])
        logits = logits[decode_segments:]
        for (chunk, segment), chunk_logits in zip(taken, logits):
            done = (self.layer_count or 1) if segment.carry is None else segment.carry.done
            self.counters.prefill_token_layers += (chunk.end - chunk.start) * (done - chunk.first)
            if segment.carry is not None:  # layers left: it goes on in a later step
                self.counters.partial_chunk_calls += 1
                chunk.seq.partial, chunk.seq.partial_end = segment.carry, chunk.end
                continue
            chunk.seq.partial = None
            self._after_chunk(chunk, chunk_logits)

    def _fail_prefill(self, seq: Sequence, exc: Exception) -> None:
        log.error("prefill of %s failed: %s: %s", seq.request.request_id, type(exc).__name__, exc)
        if seq in self.prefilling:
            self.prefilling.remove(seq)
            seq.cache, seq.partial = None, None
            self._finish(seq, "error", f"{type(exc).__name__}: {exc}")

    def _after_chunk(self, chunk: Chunk, logits: mx.array | None) -> None:
        seq, end = chunk.seq, chunk.end
        if seq not in self.prefilling:
            return  # ended meanwhile
        seq.prefilled = end
        self.counters.prefilled_tokens += end - chunk.start
        total = len(seq.prompt)
        if end < total:
            # Block boundaries, the points the request named (message boundaries), and the
            # prompt's last token but one.
            if is_checkpoint(end, total, self.block_tokens, seq.checkpoint_at):
                self._checkpoint(seq, seq.prompt[:end], seq.cache or [])
            return
        try:
            sampled = sample_rows([seq.sampler], logits)[0]
        except Exception as exc:
            self._fail_prefill(seq, exc)
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
        self.batch_cache = self.runner.join(self.batch_cache, seq.cache or [])
        self.decoding.append(seq)
        if (self.speculator is not None and seq.request.speculative
                and seq.request.positions is None and rolls_back(seq.cache or [])):
            seq.drafts = self.speculator.start(seq.prompt + seq.generated)

    def _leave_batch(self, rows: list[int]) -> None:
        if not rows:
            return
        keep = [i for i in range(len(self.decoding)) if i not in set(rows)]
        self.decoding = [self.decoding[i] for i in keep]
        self.batch_cache = (None if self.batch_cache is None
                            else self.runner.keep_rows(self.batch_cache, keep))

    def _fail_decoding(self, exc: Exception) -> None:
        log.error("decode step failed: %s: %s", type(exc).__name__, exc)
        for seq in self.decoding:
            self._finish(seq, "error", f"{type(exc).__name__}: {exc}")
        self.decoding, self.batch_cache = [], None

    def _after_decode(self, logits: mx.array | None) -> None:
        try:
            lazy = sample_lazy([s.sampler for s in self.decoding], logits)
        except Exception as exc:
            self._fail_decoding(exc)
            return
        self._emit_decoded(lazy, fed=False)

    def _emit_decoded(self, lazy: LazySamples, fed: bool) -> None:
        """Emit one token per decoding row; rows that finish leave the batch. `fed`: a queued
        step already took these tokens as its input (pipelined), so the caches hold them.
        Reading them evaluates the forward pass of a pipelined step: a failure raises out of
        step() (see step)."""
        results = read_samples(lazy)
        done = [i for i, (seq, sampled) in enumerate(zip(self.decoding, results))
                if not self._on_token(seq, sampled)]
        if self.prompt_cache is not None:
            self._decode_checkpoints(set(done), fed)
        self._leave_batch(done)
        if done:
            if self._inflight is not None:  # the queued step's tokens of those rows are void
                keep = [i for i in range(len(results)) if i not in set(done)]
                self._inflight = self._inflight.select(keep) if keep else None
            mx.clear_cache()

    # ---- speculative decoding ---------------------------------------------------------------

    def _drafts(self) -> list[tuple[int, list[int]]]:
        """(row, drafted tokens) of the rows that draft this step. None while a prompt is
        being prefilled: a draft lengthens the step that carries the prompt's chunk, and a
        waiting prompt's first token is what an agent's turn waits for (three agent sessions:
        the sum of first-token times rose by a fifth when drafts shared those steps). A draft
        never takes a row's cache past its next block boundary, so its checkpoints fall where
        they would without speculation, nor past its last token (max_tokens); the step's drafts
        stay within `step_tokens`."""
        speculator = self.speculator
        # A model given explicit rotary positions (Qwen-VL image prompts: rewind.vision
        # installs them on the first image, after this scheduler began) decodes with them.
        if (speculator is None or self.prefilling or takes_positions(self.model)
                or not isinstance(self.batch_cache, RowCaches)):
            return []
        left = speculator.step_tokens
        out: list[tuple[int, list[int]]] = []
        # The step's draft budget goes round-robin: each step another row asks first.
        rows = len(self.decoding)
        first = self.counters.steps % rows if rows else 0
        for row in [*range(first, rows), *range(first)]:
            seq = self.decoding[row]
            drafts = seq.drafts
            if drafts is None or left <= 0:
                continue
            index = drafts.index
            index.extend(seq.generated[len(index.tokens) - len(seq.prompt):])
            held = len(seq.prompt) + len(seq.generated) - 1
            boundary = (held // self.block_tokens + 1) * self.block_tokens
            limit = min(left, boundary - held - 1,
                        seq.request.params.max_tokens - len(seq.generated) - 1)
            if limit <= 0:
                continue
            draft = speculator.propose(drafts, tenant_of(seq.request.extras),
                                       self.counters.steps, limit)
            if draft:
                out.append((row, draft))
                left -= len(draft)
        return sorted(out)

    def _decode_segments(self, drafted: list[tuple[int, list[int]]]) -> list[Segment]:
        """The decode step's segments: every row as one (RowCaches: a call per row in one pass),
        or, with drafts, the rows that draft each as its own call over [input, drafts] with
        logits at every position, then the others together."""
        if not drafted:
            return [Segment(tokens=mx.array([[s.next_input] for s in self.decoding]),
                            cache=self.batch_cache or [], logits=True,
                            positions=self._decode_positions())]
        batch = self.batch_cache or []
        segments = [Segment(tokens=mx.array([[self.decoding[row].next_input, *draft]]),
                            cache=batch[row], logits=True, logit_positions=len(draft) + 1)
                    for row, draft in drafted]
        plain = self._plain_rows(drafted)
        if plain:
            segments.append(Segment(tokens=mx.array([[self.decoding[r].next_input] for r in plain]),
                                    cache=RowCaches([batch[r] for r in plain]), logits=True))
        return segments

    def _plain_rows(self, drafted: list[tuple[int, list[int]]]) -> list[int]:
        drafting = {row for row, _ in drafted}
        return [r for r in range(len(self.decoding)) if r not in drafting]

    def _after_verify(self, drafted: list[tuple[int, list[int]]],
                      logits: list[mx.array | None]) -> None:
        """Emit a speculative step's tokens: each drafting row's, position by position, as its
        sampler draws them from the logits after the tokens accepted before, up to the first
        that differs from the draft (that one is the model's own, and emitted too); then roll
        the row's cache back past what it did not keep. Then the other rows' one token each."""
        speculator = self.speculator
        assert speculator is not None
        batch = self.batch_cache or []
        plain = self._plain_rows(drafted)
        try:
            plain_samples = (read_samples(sample_lazy([self.decoding[r].sampler for r in plain],
                                                      logits[len(drafted)]))
                             if plain else [])
        except Exception as exc:
            self._fail_decoding(exc)
            return
        done: set[int] = set()
        speculator.counters.steps += 1
        for (row, draft), row_logits in zip(drafted, logits):
            seq = self.decoding[row]
            emitted, accepted, alive = self._verify_row(seq, draft, row_logits)
            try:
                roll_back(batch[row], len(draft) + 1 - emitted)
            except Exception as exc:  # the row's cache holds tokens it did not keep
                log.exception("rolling back the draft of %s failed", seq.request.request_id)
                if alive:
                    self._finish(seq, "error", f"{type(exc).__name__}: {exc}")
                alive = False
            if seq.drafts is not None:
                speculator.record(seq.drafts, self.counters.steps, len(draft), accepted)
            seq.usage.drafted_tokens += len(draft)
            seq.usage.accepted_tokens += accepted
            if not alive:
                done.add(row)
        for row, sampled in zip(plain, plain_samples):
            if not self._on_token(self.decoding[row], sampled):
                done.add(row)
        if self.prompt_cache is not None:
            self._decode_checkpoints(done)
        self._leave_batch(sorted(done))
        if done:
            mx.clear_cache()

    def _verify_row(self, seq: Sequence, draft: list[int],
                    logits: mx.array | None) -> tuple[int, int, bool]:
        """Emit a drafting row's tokens from its logits [1, len(draft) + 1, vocab]: (tokens
        emitted, drafted tokens accepted, whether the sequence goes on)."""
        assert logits is not None
        greedy = seq.sampler.plain_greedy
        try:
            choices = mx.argmax(logits[0], axis=-1).tolist() if greedy else []
        except Exception as exc:
            self._finish(seq, "error", f"{type(exc).__name__}: {exc}")
            return 0, 0, False
        emitted = accepted = 0
        for position in range(len(draft) + 1):
            if greedy:
                sampled = Sampled(int(choices[position]), None, None)
            else:
                try:
                    sampled = sample_rows([seq.sampler], logits[:, position, :])[0]
                except Exception as exc:
                    log.exception("sampling failed for %s", seq.request.request_id)
                    self._finish(seq, "error", f"{type(exc).__name__}: {exc}")
                    return emitted, accepted, False
            emitted += 1
            if not self._on_token(seq, sampled):
                return emitted, accepted, False
            if position == len(draft) or sampled.token != draft[position]:
                break
            accepted += 1
        return emitted, accepted, True

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

    def _decode_checkpoints(self, finished_rows: set[int], fed: bool = False) -> None:
        """Checkpoint a decoding sequence every block it holds and where it ends (the next
        turn of a conversation usually re-sends this answer). A row's batch cache holds its
        prompt and every generated token but the last, which is the next step's input; with
        `fed` (a pipelined step queued on it), the last one too."""
        for row, seq in enumerate(self.decoding):
            held = len(seq.prompt) + len(seq.generated) - (0 if fed else 1)
            if not decode_checkpoint(held, len(seq.prompt), self.block_tokens,
                                     row in finished_rows):
                continue
            try:
                single = self.runner.extract(self.batch_cache or [], row)
            except Exception:
                log.exception("extracting row %d for a checkpoint failed", row)
                continue
            self._checkpoint(seq, (seq.prompt + seq.generated)[:held], single)

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
        if self.speculator is not None:
            self.speculator.finished(seq.drafts, tenant_of(seq.request.extras), seq.generated)
            seq.drafts = None
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
