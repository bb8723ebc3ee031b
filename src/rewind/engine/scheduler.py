"""The scheduler: admits requests into N slots and decides, step by step, what the model runs.

Runs on the engine thread only (the one thread that touches the model and every live cache).
A step is three calls (Engine.step): `schedule()` settles what the step before left (tokens
still in flight, cancellations, admission) and returns the pass to run as a StepPlan;
runner.run(plan) runs it; `postprocess(plan, output)` samples and emits tokens, verifies drafts,
takes checkpoints and moves sequences from prefill to the decode batch. Which prompt calls a
step runs is rewind.engine.planner's, a pure function of positions and costs.

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

What happens to a token once sampled (its text, stop strings, the request's finish, counters,
sample listeners) is rewind.engine.emission's; drafting and verifying drafts is
rewind.engine.verify's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import mlx.core as mx

from rewind.cache.checkpoints import decode_checkpoint, is_checkpoint
from rewind.cache.rollback import rolls_back
from rewind.config import PASS_TOKENS, EngineConfig
from rewind.engine.emission import Counters, Emission, SampleListener
from rewind.engine.memory_budget import KvAccount, NeverFits
from rewind.engine.planner import passes_every_layer, plan_prefill
from rewind.engine.positions import takes_positions
from rewind.engine.request import EngineStoppedError, FinishReason, QueueFullError
from rewind.engine.runner import ModelRunner
from rewind.engine.sampler import LazySamples, read_samples, sample_lazy, sample_rows
from rewind.engine.sequence import EventSink, Sequence
from rewind.engine.speculation import Speculator, resolve_mode, step_costs_for
from rewind.engine.step_inputs import plain_rows
from rewind.engine.step_plan import PrefillSlice, StepOutput, StepPlan
from rewind.engine.verify import Verifier
from rewind.kernels.native import chosen_isa

log = logging.getLogger(__name__)

__all__ = ["Counters", "EventSink", "SampleListener", "Scheduler", "Sequence"]


class Scheduler:
    def __init__(self, runner: ModelRunner, config: EngineConfig, prompt_cache: Any,
                 eos_token_ids: set[int], listeners: list[SampleListener],
                 counters: Counters | None = None, memory: KvAccount | None = None,
                 draft_model: Any = None) -> None:
        self.runner = runner
        # The memory budget's account of this engine's sequences, if one is kept: admission
        # waits for room for a prompt's cache, and each decoding row's room grows before the
        # step that makes its token (rewind.engine.memory_budget).
        self.memory = memory
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
        # MLX's layers on the CPU, where each position computes alone (runner.lone_rows_exact):
        # a row drafts while it decodes alone, on caches of its own; with others it decodes in
        # the merged batch without drafts.
        rows_alone = ((self.layer_count is not None or runner.lone_rows_exact)
                      and not takes_positions(self.model))
        mode = resolve_mode(config.speculative, rows_alone and not self.pipeline)
        if mode != "off" and not rows_alone:
            log.warning("speculative decoding (%s) needs rows that compute alone (the CPU "
                        "kernels, MLX's layers on the CPU with bf16 weights, or on CUDA a bf16 "
                        "model of attention layers over growing caches); this model and backend "
                        "decode without it", mode)
            mode = "off"
        if mode != "off":
            self.pipeline = False
            runner.draft_alone()
        elif rows_alone:
            # The same lone-row path as with speculation on: MLX's merged batch computes a lone
            # row with other bits (its masked attention) than the row's own cache does.
            runner.decode_alone()
        # A draft model (rewind.engine.draft_model) drafts where `auto` would draft from text.
        if draft_model is not None and config.speculative == "auto" and mode != "off":
            mode = "draft"
        elif draft_model is not None:
            log.warning("the draft model is not used: speculative decoding is %s here", mode)
        max_draft = config.speculative_max_draft
        if runner.max_check_positions is not None:  # what the backend's check can take
            max_draft = min(max_draft, runner.max_check_positions - 1)
        self.speculator: Speculator | None = (
            None if mode == "off" else Speculator(
                mode, max_draft, config.speculative_step_tokens,
                weighs_cost=config.speculative == "auto" and mode != "draft",
                draft_model=draft_model if mode == "draft" else None,
                # A draft's price: what a verification costs on this CPU's kernel build.
                costs=step_costs_for(chosen_isa() if mx.default_device() == mx.cpu else None)))
        self._inflight: LazySamples | None = None  # a queued decode step's unread tokens
        # Counters come in from a scheduler before this one where the engine restarted: they
        # carry on, and the emission counts into the same object.
        self.counters = counters if counters is not None else Counters()
        self.emission = Emission(self.counters, eos_token_ids, listeners, self.speculator)
        self.verifier: Verifier | None = (
            None if self.speculator is None
            else Verifier(self.speculator, self.emission, self.model, self.block_tokens))
        self._lock = threading.Lock()  # guards `waiting` (submit runs on callers' threads)
        self.waiting: deque[Sequence] = deque()
        self.prefilling: deque[Sequence] = deque()
        self.decoding: list[Sequence] = []  # row i of the batch cache is decoding[i]
        self.batch_cache: list[Any] | None = None
        self._restored_now = False  # this step restored a prefix from the prompt cache
        # The passes the last step planned after its first (prefill only), and whether that
        # step's prefill was sliced beside decoding rows (rewind.engine.planner).
        self._later_passes: list[list[PrefillSlice[Sequence]]] = []
        self._sliced = False
        self.closed: str | None = None  # why enqueue() refuses (close()); None: it takes requests

    # ---- called from any thread -------------------------------------------------------------

    def enqueue(self, seq: Sequence) -> None:
        with self._lock:
            if self.closed is not None:
                raise EngineStoppedError(self.closed)
            if len(self.waiting) >= self.config.max_queue:
                raise QueueFullError(len(self.waiting), self.config.max_queue,
                                     self.retry_after(len(self.waiting)))
            self.waiting.append(seq)

    def retry_after(self, queued: int) -> float:
        """When a slot is likely free for one more: the queue ahead drains `parallel` requests
        per typical request time (1 s before any request finished)."""
        typical = self.emission.typical_request_seconds or 1.0
        return min(60.0, max(1.0, typical * (queued + 1) / self.config.parallel))

    @property
    def running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    @property
    def queued(self) -> int:
        return len(self.waiting)

    # ---- engine thread only -----------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """This step's forward pass as a plan (rewind.engine.step_plan); None when there is
        nothing to run. Settles first what the step before left: the tokens of a pipelined
        step still in flight when this one cannot be pipelined, the cancelled requests, and
        admission (restoring each admitted prompt's cached prefix)."""
        if self._inflight is not None:
            if self._can_pipeline():
                return self._pipelined_plan()
            self._flush()
        plan = self._continuation()
        if plan is not None:
            return plan
        self._drop_cancelled()
        self._restored_now = False
        admitted = self._admit()
        self._cut_rows_over_budget()
        if not self.prefilling and not self.decoding:
            return None
        if self._can_pipeline():
            return self._pipelined_plan()
        self.counters.steps += 1
        drafts: list[tuple[int, list[int]]] = []
        if self.decoding and self.verifier is not None:
            try:
                drafts = self.verifier.drafts(self.decoding, self.batch_cache,
                                              bool(self.prefilling), self.counters.steps)
            except Exception as exc:
                self._fail_decoding(exc)
            # A draft the row's room cannot hold is not verified: the row decodes one token.
            drafts = [(row, draft) for row, draft in drafts
                      if self._room_for(self.decoding[row], len(draft) + 1)]
        # Sliced passes are planned within the mixed budget, whole-chunk passes are not.
        self._sliced = self._slicing
        passes = self._plan_prefill()
        self._later_passes = passes[1:]
        return self._plan(passes[0] if passes else [], drafts=drafts, admitted=admitted)

    def postprocess(self, plan: StepPlan, out: StepOutput) -> None:
        """Read the pass's output against its plan: sample and emit the decode rows' tokens
        (verifying drafts), move each prompt call's sequence on (checkpoint, first token, into
        the decode batch), end the requests whose own inputs or outputs failed.

        A failure of one request's own inputs or outputs (its image embeddings, its sampler or
        grammar, its text, its checkpoint) ends that request here. A failure of the model's work
        (a forward call, or the evaluation of its outputs) raises out of runner.run or here:
        which row caused it is unknown and every cache in the pass may be half advanced, so the
        engine ends all its requests and stops (Engine._fail)."""
        if plan.pipelined:
            self._after_pipelined(plan, out)
            return
        if out.decode_failed is not None:
            self._fail_decoding(out.decode_failed)
        for index, exc in out.failed.items():
            self._fail_prefill(plan.prefill[index].prompt, exc)
        if plan.decode and out.decode_failed is None and out.decode_logits:
            if plan.drafts:
                self._after_verify(plan, out.decode_logits)
            else:
                self._after_decode(out.decode_logits[0])
        checkpoints = {id(call) for call in plan.checkpoints}
        for index, call in enumerate(plan.prefill):
            if index in out.failed:
                continue
            seq, carry = call.prompt, out.carried[index]
            done = (self.layer_count or 1) if carry is None else carry.done
            self.counters.prefill_token_layers += (call.end - call.start) * (done - call.first)
            if carry is not None:  # layers left: it goes on in a later step
                self.counters.partial_chunk_calls += 1
                seq.partial, seq.partial_end = carry, call.end
                continue
            seq.partial = None
            self._after_chunk(call, out.prefill_logits[index], id(call) in checkpoints)

    def _plan(self, calls: list[PrefillSlice[Sequence]], drafts: list[tuple[int, list[int]]],
              admitted: list[Sequence], continuation: bool = False) -> StepPlan:
        # A call that passes every layer and ends at a checkpoint position is checkpointed
        # after the pass (rewind.cache.checkpoints: block and message boundaries, the prompt's
        # last token but one).
        checkpoints = [c for c in calls if passes_every_layer(c, self.layer_count)
                       and is_checkpoint(c.end, c.prompt.prompt_length, self.block_tokens,
                                         c.prompt.checkpoint_at)]
        return StepPlan(decode=[] if continuation else list(self.decoding),
                        batch=None if continuation else self.batch_cache,
                        drafts=drafts, prefill=calls, checkpoints=checkpoints,
                        continuation=continuation, admitted=admitted)

    def _continuation(self) -> StepPlan | None:
        """The next prefill-only pass the last step planned (rewind.engine.planner), if it
        still applies."""
        while self._later_passes:
            calls = self._later_passes.pop(0)
            if self.decoding and not self._sliced:
                # A prompt finished in an earlier pass and its sequence now decodes: the rest of
                # the step's prefill (up to `prefill_chunk` tokens, seconds on a CPU) would hold
                # its second token; the next steps mix it with prefill under the budget instead.
                self._later_passes = []
                return None
            # A sequence that ended meanwhile (a failed call) drops out of the later passes.
            calls = [c for c in calls
                     if c.prompt in self.prefilling and c.prompt.prefilled == c.start]
            if calls:
                if self._sliced:
                    self.counters.extra_prefill_passes += 1
                return self._plan(calls, drafts=[], admitted=[], continuation=True)
        return None

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
            self.emission.finish(seq, reason, error)
        self.prefilling.clear()
        self.decoding = []
        self.batch_cache = None
        self._inflight = None
        self._later_passes = []

    # ---- pipelined decode -------------------------------------------------------------------

    def _can_pipeline(self) -> bool:
        """Whether this step can be a decode step queued before the previous step's tokens are
        read (mlx-lm's batch generator does the same): only decoding, nobody to admit or drop,
        and no row whose next logits depend on the token before (penalties, grammars)."""
        if not self.pipeline or not self.decoding or self.prefilling:
            return False
        if self.waiting and self.running < self.config.parallel:
            return False
        if any(s.cancelled.is_set() or s.sampler.needs_history for s in self.decoding):
            return False
        # The queued step makes each row's token after the one in flight. A row whose token in
        # flight is its last by max_tokens would get a token nobody reads, its cache a row the
        # answer does not hold (the prompt cache would then keep it): it finishes unpipelined.
        # A row without room for it is cut by an unpipelined step (_cut_rows_over_budget).
        ahead = 2 if self._inflight is not None else 1
        if any(len(s.generated) + ahead > s.request.params.max_tokens for s in self.decoding):
            return False
        return all(self._room_for(s, ahead) for s in self.decoding)

    def _pipelined_plan(self) -> StepPlan:
        """A decode step queued on the in-flight tokens (or the rows' last ones); their reading
        and emission wait for postprocess, while it runs."""
        self.counters.steps += 1
        self.counters.pipelined_steps += 1
        previous, self._inflight = self._inflight, None
        return StepPlan(decode=list(self.decoding), batch=self.batch_cache or [],
                        pipelined=True, fed=previous)

    def _after_pipelined(self, plan: StepPlan, out: StepOutput) -> None:
        if out.decode_failed is not None:
            self._fail_decoding(out.decode_failed)
            return
        try:
            lazy = sample_lazy([s.sampler for s in self.decoding], out.decode_logits[0])
        except Exception as exc:
            self._fail_decoding(exc)
            return
        mx.async_eval(lazy.arrays())
        self._inflight = lazy
        if plan.fed is not None:
            # The step just queued fed these tokens: the caches hold them once it is done.
            self._emit_decoded(plan.fed, fed=True)

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
            self.emission.finish(seq, "cancelled")
        if gone:
            mx.clear_cache()  # hand the freed cache memory back now, not at some later step

    def _admit(self) -> list[Sequence]:
        """Waiting sequences into free slots, oldest first; where a memory budget is kept, each
        once its prompt's cache has room (the oldest waits, and those behind it with it)."""
        admitted: list[Sequence] = []
        while self.running < self.config.parallel:
            with self._lock:
                if not self.waiting:
                    return admitted
                seq = self.waiting[0]
            if seq.ticket is None and self.memory is not None:
                try:
                    seq.ticket = self.memory.reserve(seq.prompt_length + 1)
                except NeverFits as exc:  # the budget shrank or a model loaded since submit
                    self._take_waiting(seq)
                    self.emission.finish(seq, "error", str(exc))
                    continue
                if seq.ticket is None:
                    return admitted
            self._take_waiting(seq)
            try:
                self._start_prefill(seq)
            except Exception as exc:  # a bad request ends itself, never the engine
                log.exception("request %s failed at admission", seq.request.request_id)
                self.emission.finish(seq, "error", f"{type(exc).__name__}: {exc}")
                continue
            seq.admitted.set()
            self.prefilling.append(seq)
            admitted.append(seq)
        return admitted

    def _take_waiting(self, seq: Sequence) -> None:
        with self._lock:
            self.waiting.remove(seq)

    def _room_for(self, seq: Sequence, tokens: int) -> bool:
        """Whether the row's room in the memory budget holds `tokens` more than it generated
        (its prompt and every token it emitted; growing it where it does not yet), or no
        budget is kept."""
        ticket = seq.ticket
        return ticket is None or ticket.grow_to(seq.prompt_length + len(seq.generated) + tokens)

    def _cut_rows_over_budget(self) -> None:
        """End with finish_reason "length" the decoding rows whose next token would take their
        cache over the memory budget, before the step that would make it."""
        cut = [row for row, seq in enumerate(self.decoding) if not self._room_for(seq, 1)]
        for row in cut:
            seq = self.decoding[row]
            reason = (f"memory budget: this sequence's cache ({seq.ticket.tokens} tokens) "
                      "would cross --memory-budget")
            log.warning("%s; ending it with finish_reason length", reason)
            seq.ticket.count_cut()
            self.emission.finish(seq, "length", reason)
        self._leave_batch(cut)

    def _start_prefill(self, seq: Sequence) -> None:
        usage = seq.usage
        usage.queue_seconds = time.perf_counter() - seq.submitted_at
        usage.prompt_tokens = len(seq.prompt)
        self.counters.prompt_tokens += len(seq.prompt)
        self.emission.notify("queue_seconds", usage.queue_seconds)
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
            self.emission.notify("restore_seconds", restored.seconds)
        else:
            seq.cache = self.runner.new_cache()
            seq.prefilled = 0
        seq.checkpoint_at = {p for p in seq.request.checkpoints if 0 < p <= len(seq.prompt)}

    # ---- prefill ----------------------------------------------------------------------------

    @property
    def _slicing(self) -> bool:
        """Whether this step's prefill goes beside decoding rows in layer slices (the CPU
        kernels), planned by rewind.engine.planner."""
        return bool(self.decoding) and self.layer_count is not None

    def _prefill_budget(self) -> int:
        """Prompt tokens this step: few while rows decode (each decoding row waits for them),
        a larger batch of chunks when nothing else runs."""
        if self.decoding:
            return max(self.mixed_prefill_tokens - len(self.decoding), 1)
        return max(self.config.prefill_chunk, 1)

    def _plan_prefill(self) -> list[list[PrefillSlice[Sequence]]]:
        """This step's prompt calls in passes (rewind.engine.planner), the oldest prompt first."""
        if self._slicing and self._restored_now:
            # The restore (copying a long prefix into live caches) was this step's share of
            # work beside the decoding rows; prefill goes on next step.
            return []
        return plan_prefill(list(self.prefilling), self._prefill_budget(), self.chunk_tokens,
                            self.runner, sliced=self._slicing, pass_tokens=PASS_TOKENS)

    def _fail_prefill(self, seq: Sequence, exc: Exception) -> None:
        log.error("prefill of %s failed: %s: %s", seq.request.request_id, type(exc).__name__, exc)
        if seq in self.prefilling:
            self.prefilling.remove(seq)
            seq.cache, seq.partial = None, None
            self.emission.finish(seq, "error", f"{type(exc).__name__}: {exc}")

    def _after_chunk(self, call: PrefillSlice[Sequence], logits: mx.array | None,
                     checkpoint: bool) -> None:
        seq, end = call.prompt, call.end
        if seq not in self.prefilling:
            return  # ended meanwhile
        seq.prefilled = end
        self.counters.prefilled_tokens += end - call.start
        if end < seq.prompt_length:
            if checkpoint:
                self._checkpoint(seq, seq.prompt[:end], seq.cache or [])
            return
        try:
            sampled = sample_rows([seq.sampler], logits)[0]
        except Exception as exc:
            self._fail_prefill(seq, exc)
            return
        self.prefilling.remove(seq)
        if self.emission.on_token(seq, sampled):
            try:
                self._join_batch(seq)
            except Exception as exc:  # e.g. a cache class that cannot batch
                log.exception("joining the decode batch failed for %s", seq.request.request_id)
                self.emission.finish(seq, "error", f"{type(exc).__name__}: {exc}")
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
                and seq.request.positions is None
                and rolls_back(seq.cache or [], linear=self.runner.linear_steps)):
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
            self.emission.finish(seq, "error", f"{type(exc).__name__}: {exc}")
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
                if not self.emission.on_token(seq, sampled)]
        if self.prompt_cache is not None:
            self._decode_checkpoints(set(done), fed)
        self._leave_batch(done)
        if done:
            if self._inflight is not None:  # the queued step's tokens of those rows are void
                keep = [i for i in range(len(results)) if i not in set(done)]
                self._inflight = self._inflight.select(keep) if keep else None
            mx.clear_cache()

    def _after_verify(self, plan: StepPlan, logits: list[mx.array | None]) -> None:
        """Emit a speculative step's tokens: the drafting rows' (the verifier's), then the other
        rows' one token each; rows that finish leave the batch."""
        verifier = self.verifier
        assert verifier is not None
        drafted = plan.drafts
        plain = plain_rows(plan)
        try:
            plain_samples = (read_samples(sample_lazy([self.decoding[r].sampler for r in plain],
                                                      logits[len(drafted)]))
                             if plain else [])
        except Exception as exc:
            self._fail_decoding(exc)
            return
        done = verifier.verify(drafted, logits, self.decoding, self.batch_cache or [],
                               self.counters.steps)
        for row, sampled in zip(plain, plain_samples):
            if not self.emission.on_token(self.decoding[row], sampled):
                done.add(row)
        if self.prompt_cache is not None:
            self._decode_checkpoints(done)
        self._leave_batch(sorted(done))
        if done:
            mx.clear_cache()

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
