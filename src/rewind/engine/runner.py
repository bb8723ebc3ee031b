"""The model runner: every forward call of the engine, and the decode batch's cache surgery.

The scheduler decides what runs in a step (which rows decode, which prompt chunks prefill); the
runner runs it and never decides. A step is a list of `Segment`s, each a [B, L] block of tokens
with its own cache: the decode batch is one segment (B rows, L = 1, the batch cache), each
prefill chunk another (B = 1, its sequence's own cache).

Why one call for several segments: on the CPU kernels (rewind.kernels.native_forward) a forward
pass streams every layer weight once for all its rows, so decode rows and a prefill chunk in one
pass cost one weight read instead of two, and the rows' logits come from one output-head call
(the head is most of a small model's bytes: Gemma 3 270M's tied 262k-word embedding). Elsewhere
(MLX's own layers: other families, GPUs, per-call rotary positions) the segments run one after
another, with the same answers.

Chunk grid: rewind.cache.checkpoints is the one place prompt positions are cut into model calls
and checkpoints are chosen, for the server and every command, so the same prompt is always
computed in the same calls whether it is restored from the prompt cache, batched with others, or
alone. That matters for the answer itself: a call's shape changes the summation order of some
families (sliding-window caches, linear attention), so a different cut gives logits that differ
in the last bits. `ModelRunner.prefill` is the one chunk loop of a sequence prefilled alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import mlx.core as mx

from rewind.cache import linear_steps, window_blocks
from rewind.cache.checkpoints import BLOCK_TOKENS, engine_chunk_tokens, prefill_plan
from rewind.engine.compiled_decode import CompiledDecode
from rewind.engine.positions import given_positions, takes_positions
from rewind.engine.residuals import given_residuals
from rewind.engine.segment import RowCaches, Segment
from rewind.engine.step_inputs import decode_segments, prefill_segment
from rewind.engine.step_plan import StepOutput, StepPlan
from rewind.kernels import cuda_attention, cuda_rows, cuda_skinny, gated_delta
from rewind.kernels.backend import ModelKernels, kernels_for
from rewind.engine.model_thread import ModelThread
from rewind.kernels.model_split import pipeline_stages, split_model
from rewind.kernels.native_linear import rows_compute_alone


class ModelRunner:
    """Owns the model's forward calls; one per engine, engine thread only."""

    def __init__(self, model: Any, max_kv_size: int | None = None,
                 chunk_tokens: int | None = None, kernels: ModelKernels | None = None,
                 fault: Callable[[], None] | None = None,
                 block_tokens: int = BLOCK_TOKENS, thread: ModelThread | None = None) -> None:
        self.model = model
        # Tests only: called before each forward call, may raise (rewind.engine.faults).
        self.fault = fault
        # The kernel backend's pieces for this model (rewind.kernels.backend): handed in, or
        # asked of the process's backend.
        self.kernels = kernels if kernels is not None else kernels_for(model)
        self.max_kv_size = max_kv_size
        # Checkpoints follow the prompt cache's block size (rewind.cache.checkpoints
        # .block_tokens_of); model calls end on a grid that divides it: the configured one, or
        # the backend's default cut to fit.
        self.block_tokens = block_tokens
        self.chunk_tokens = engine_chunk_tokens(chunk_tokens, block_tokens)
        # How many layers a segment's calls can be split between (`Segment.stop`), on a backend
        # that keeps rows in flight between calls (the CPU kernels); None elsewhere.
        self.layer_count: int | None = (
            len(self.kernels.forward.layers)
            if self.kernels.fuses_segments and split_model(model) is not None else None)
        if self.layer_count is not None:
            # A drafting row's keys go into full sliding windows in place, given back at
            # rollback (rewind.cache.rollback).
            self.kernels.forward.block_writer = window_blocks
        # MLX's layers on the CPU where each position computes alone (rewind.kernels
        # .native_linear.rows_compute_alone): a row decoding alone can check a draft in a call
        # of its own and give back what was not kept, as on the CPU kernels.
        # On CUDA, the same inside cuda_rows.rows_alone where every layer's products and
        # attention have kernels that compute each position alone and every cache holds one
        # row's keys (no window, no recurrence).
        cpu_rows_alone = self.layer_count is None and rows_compute_alone(model)
        cuda_rows_alone = (self.layer_count is None and not cpu_rows_alone
                           and _cuda_rows_alone(model, max_kv_size))
        self.lone_rows_exact = (split_model(model) is not None
                                and (cpu_rows_alone or cuda_rows_alone))
        # The positions a drafted row's check may bring (its input and drafts): the CUDA
        # kernels' rows (cuda_rows.MAX_ROWS); no bound elsewhere.
        self.max_check_positions: int | None = cuda_rows.MAX_ROWS if cuda_rows_alone else None
        # Set by the scheduler where rows compute alone (lone_rows_exact), drafting or not: a
        # row decoding alone keeps its own caches (RowCaches of one row); two or more share one
        # merged batch cache.
        self.lone_rows = False
        # Whether drafting rows' linear-attention layers are recorded so that they can give
        # tokens back (rewind.cache.linear_steps); set with `lone_rows`.
        self.linear_steps = False
        # The decode batch's call built once per shape and replayed, on MLX's layers of a model
        # that runs whole here (rewind.engine.compiled_decode; REWIND_COMPILED_DECODE, on CUDA by
        # default).
        # Its traces are MLX's, kept per thread: the engines of a model thread share one (a
        # warm-up's traces then serve requests).
        self.compiled_decode: CompiledDecode | None = None
        # A tied head's product for a decode batch in Rewind's kernel where the loader marked it
        # (rewind.kernels.cuda_skinny); None: the model's own head.
        split = split_model(model)
        self.batch_head = None if split is None else cuda_skinny.head_of(split.head)
        if self.layer_count is None and pipeline_stages(model) == 1:
            forward = model if split is None else split.backbone

            def make() -> CompiledDecode:
                return CompiledDecode(forward)

            self.compiled_decode = make() if thread is None else thread.keep(
                f"compiled_decode {id(model)}", make)

    def decode_alone(self) -> None:
        """Rows decoding alone keep their own caches from now on, where a batch would merge
        them (MLX's layers): a lone row then computes with a one-token step's bits whether or
        not it drafts, so its answer is the same with speculation on and off."""
        self.lone_rows = self.layer_count is None

    def draft_alone(self) -> None:
        """decode_alone, and the model's linear-attention layers record a drafting row's call
        (the scheduler drafts)."""
        self.decode_alone()
        if self.lone_rows:
            gated_delta.observe(linear_steps.note_recurrence)
            self.linear_steps = linear_steps.install(self.model)

    def layer_costs(self, context: int) -> list[float]:
        """Per-layer work of one token at `context` tokens held (the CPU kernels' estimate, in
        mean-layer units; 1 per layer where calls cannot stop between layers)."""
        if self.layer_count is None:
            return [1.0]
        return self.kernels.forward.layer_costs(context)

    # ---- caches -----------------------------------------------------------------------------

    def new_cache(self) -> list[Any]:
        from rewind.cache.kv import make_cache

        return make_cache(self.model, max_kv_size=self.max_kv_size)

    def join(self, batch: list[Any] | None, single: list[Any]) -> list[Any]:
        """The decode batch with one more row (a batch-1 cache appended); a new batch if None.
        Where segments share a pass (the CPU kernels) the batch is the rows' own caches side by
        side (RowCaches): joining and leaving copy nothing, where merging into one batch buffer
        copies every row's cache (~50 ms for three 6k-token rows of the default model on 2
        cores, a wait for every decoding row)."""
        if self.layer_count is not None:
            return RowCaches([*(batch or []), single])
        if self.lone_rows and batch is None:
            return RowCaches([single])
        if isinstance(batch, RowCaches):  # a lone row meets another: one merged batch
            return [layer.merge([layer, new_layer]) for layer, new_layer in zip(batch[0], single)]
        rows = [layer.merge([layer]) for layer in single]
        if batch is None:
            return rows
        for batch_layer, new_layer in zip(batch, rows):
            batch_layer.extend(new_layer)
        return batch

    def keep_rows(self, batch: list[Any], keep: list[int]) -> list[Any] | None:
        """The batch with only rows `keep` (None when none is left). A merged batch left with
        one row gives it its own caches again where lone rows keep theirs (one copy, as when
        it joined)."""
        if not keep:
            return None
        if isinstance(batch, RowCaches):
            return RowCaches([batch[i] for i in keep])
        if self.lone_rows and len(keep) == 1:
            return RowCaches([[layer.extract(keep[0]) for layer in batch]])
        for layer in batch:
            layer.filter(keep)
        return batch

    @staticmethod
    def extract(batch: list[Any], row: int) -> list[Any]:
        """One row's caches as a batch-1 cache (for a checkpoint): a copy out of a merged batch,
        the row's own caches out of RowCaches."""
        if isinstance(batch, RowCaches):
            return batch[row]
        return [layer.extract(row) for layer in batch]

    # ---- forward ----------------------------------------------------------------------------

    def prefill(self, cache: list[Any], tokens: Sequence[int], start: int = 0,
                boundaries: Iterable[int] = (),
                on_checkpoint: Callable[[int, list[Any]], None] | None = None,
                logits: bool = True, blocks_only: bool = False) -> mx.array | None:
        """One sequence alone, the chunk loop of every path but the scheduler's: feed `tokens`
        (prompt positions start.. onward) into `cache`, which holds the `start` before them, in
        the calls of rewind.cache.checkpoints.prefill_plan (message `boundaries` cut calls too);
        return the last position's logits [1, vocab] when `logits`. `on_checkpoint(position,
        cache)` runs after every call whose end the plan marks a checkpoint, with the cache
        holding `position` tokens (`blocks_only`: see prefill_plan)."""
        tokens = list(tokens)
        if not tokens:
            raise ValueError("nothing to prefill")
        total = start + len(tokens)
        position = start
        last: mx.array | None = None
        for step in prefill_plan(start, total, self.chunk_tokens, self.block_tokens, boundaries,
                                 blocks_only=blocks_only):
            end = step.end
            chunk = mx.array([tokens[position - start:end - start]])
            last = self.forward([Segment(chunk, cache, logits=logits and end == total)])[0]
            position = end
            if step.checkpoint and on_checkpoint is not None:
                on_checkpoint(end, cache)
            if end < total:
                mx.clear_cache()  # chunk temporaries: keep peak memory at one chunk's worth
        return last

    def run(self, plan: StepPlan) -> StepOutput:
        """One plan's forward pass (rewind.engine.step_plan): the decode rows and the prompt
        calls it lists, in one pass where the backend allows. A request's own inputs failing
        (its image features) leave its call out of the pass and are reported in the output; a
        failing forward call raises, since which row caused it is unknown and every cache in
        the pass may be half advanced."""
        out = StepOutput(prefill_logits=[None] * len(plan.prefill),
                         carried=[None] * len(plan.prefill))
        segments: list[Segment] = []
        if plan.decode:
            try:
                segments = decode_segments(plan, takes_positions(self.model))
            except Exception as exc:  # noqa: BLE001 - reported: the rows end, the pass runs
                out.decode_failed = exc
        decode_count = len(segments)
        taken: list[int] = []
        for index, call in enumerate(plan.prefill):
            try:
                segments.append(prefill_segment(call))
            except Exception as exc:  # noqa: BLE001 - reported: that request ends, not the pass
                out.failed[index] = exc
                continue
            taken.append(index)
        if not segments:
            return out
        logits = self.forward(segments, evaluate=not plan.pipelined)
        out.decode_logits = logits[:decode_count]
        for index, segment, call_logits in zip(taken, segments[decode_count:],
                                               logits[decode_count:]):
            out.prefill_logits[index] = call_logits
            out.carried[index] = segment.carry
        return out

    def forward(self, segments: list[Segment], evaluate: bool = True) -> list[mx.array | None]:
        """Run every segment; return each one's last-position logits [B, vocab] where it asked
        for them, else None. Caches advance by each segment's length. `evaluate=False` leaves
        the logits lazy where the backend allows (a pipelined decode queues them with
        mx.async_eval)."""
        if not segments:
            return []
        if self.fault is not None:
            self.fault()
        rows_of = [len(s.cache) if isinstance(s.cache, RowCaches) else 0 for s in segments]
        if any(rows_of):
            return self._forward_rows(segments, rows_of, evaluate)
        return self._forward(segments, evaluate)

    def _forward(self, segments: list[Segment], evaluate: bool) -> list[mx.array | None]:
        split = split_model(self.model)
        # The plain segments share one pass through the CPU kernels; the others (per-call model
        # state) run alone, with the same answers.
        native = [i for i, s in enumerate(segments) if s.plain] if self.layer_count else []
        hidden: list[mx.array | None] = [None] * len(segments)
        if native:
            for i, h in zip(native, self._native_segments([segments[i] for i in native])):
                hidden[i] = h
        # Pipeline stages (rewind.parallel.shard): each segment's graph holds a send or a
        # receive between the ranks and a gather, and a CPU kernel inside a layer (the gated
        # delta rule) evaluates its inputs while the graph is being built, so a later stage
        # would wait on the next segment's receive while an earlier one waits in this segment's
        # gather. Each segment's exchange completes before the next is built.
        one_by_one = len(segments) > 1 and pipeline_stages(self.model) > 1
        for i, segment in enumerate(segments):
            if i in native:
                continue
            if segment.stop is not None or segment.carry is not None:
                raise ValueError("this backend runs a segment through all layers in one call")
            if segment.logit_positions > 1 and self.linear_steps:
                # A drafting row: its linear-attention layers keep what giving back needs.
                with linear_steps.recording(segment.cache):
                    hidden[i] = self._one(split, segment)
            elif segment.logit_positions > 1 and self.lone_rows:
                # A drafting row's check: each position alone (CUDA's kernels; nothing to do
                # on the CPU, whose kernels always compute so)
                with cuda_rows.rows_alone():
                    hidden[i] = self._one(split, segment)
            elif self.compiled_decode is not None and self.compiled_decode.takes(segment):
                hidden[i] = self.compiled_decode(segment)
                if hidden[i] is None:  # the model's trace failed: the plain call
                    hidden[i] = self._one(split, segment)
            else:
                hidden[i] = self._one(split, segment)
            if one_by_one:
                mx.eval(hidden[i])
        logits = self._heads(split, segments, hidden)
        if evaluate:
            mx.eval([a for a in logits if a is not None],
                    [[layer.state for layer in s.cache] for s in segments])
        return logits

    def _forward_rows(self, segments: list[Segment], rows_of: list[int],
                      evaluate: bool) -> list[mx.array | None]:
        """forward() where a segment's cache is RowCaches: one segment per row, each over its
        own cache, and each such segment's logits put back together [B, vocab]."""
        expanded: list[Segment] = []
        for segment, rows in zip(segments, rows_of):
            if not rows:
                expanded.append(segment)
                continue
            for row, cache in enumerate(segment.cache):
                expanded.append(Segment(
                    segment.tokens[row:row + 1], cache, segment.logits,
                    None if segment.embeds is None else segment.embeds[row:row + 1],
                    None if segment.positions is None else segment.positions[:, row:row + 1],
                    segment.residuals))
        logits = self._forward(expanded, evaluate)
        out: list[mx.array | None] = []
        start = 0
        for rows in rows_of:
            if not rows:
                out.append(logits[start])
                start += 1
                continue
            parts = logits[start:start + rows]
            start += rows
            out.append(None if parts[0] is None else mx.concatenate(parts, axis=0))
        return out

    def _native_segments(self, segments: list[Segment]) -> list[mx.array | None]:
        """Every segment through the CPU kernels in one pass (each weight read once for all of
        their rows), each up to its `stop` layer: hidden states of those that passed every layer,
        None (and their rows in `carry`) for the others."""
        forward = self.kernels.forward
        total = len(forward.layers)
        blocks = [s.carry if s.carry is not None else forward.begin(s.tokens, s.cache, s.embeds)
                  for s in segments]
        forward.advance([(block, total if s.stop is None else min(s.stop, total))
                         for block, s in zip(blocks, segments)])
        hidden: list[mx.array | None] = []
        for block, segment in zip(blocks, segments):
            done = block.done == total
            segment.carry = None if done else block
            hidden.append(forward.finish(block) if done else None)
        return hidden

    def _one(self, split: Any, segment: Segment) -> mx.array:
        """Hidden states [B, L, H] of one segment (the full model's logits [B, L, vocab] for a
        family without a known backbone/head split)."""
        kwargs = {} if segment.embeds is None else {"input_embeddings": segment.embeds}
        with (given_positions(self.model, segment.positions),
              given_residuals(self.model, segment.residuals)):
            if split is None:
                return self.model(segment.tokens, cache=segment.cache, **kwargs)
            return split.backbone(segment.tokens, cache=segment.cache, **kwargs)

    def _heads(self, split: Any, segments: list[Segment],
               hidden: list[mx.array | None]) -> list[mx.array | None]:
        """Last-position logits of the segments that want them (and passed every layer),
        through one head call."""
        wanted = [i for i, s in enumerate(segments) if s.logits and hidden[i] is not None]
        out: list[mx.array | None] = [None] * len(segments)
        if not wanted:
            return out
        if split is None:  # `hidden` already holds logits
            for i in wanted:
                n = segments[i].logit_positions
                out[i] = hidden[i][:, -1, :] if n == 1 else hidden[i][:, -n:, :]
            return out
        fast_head = self.kernels.head
        if fast_head is None:
            # MLX's matmul may sum in another order for another row count (OpenBLAS's gemv
            # against its gemm): one call each, and one a position, so a drafted position's
            # logits are those a one-token step computes.
            rows_head = cuda_rows.head_of(split.head) if self.lone_rows else None
            for i in wanted:
                n = segments[i].logit_positions
                if n == 1:
                    out[i] = split.logits(hidden[i][:, -1, :], self.batch_head)
                elif rows_head is not None and n <= cuda_rows.MAX_ROWS:
                    # CUDA: every position alone, the head's weight read once for eight
                    out[i] = split.logits(hidden[i][:, -n:, :], rows_head)
                else:
                    out[i] = mx.stack([split.logits(hidden[i][:, p, :])
                                       for p in range(-n, 0)], axis=1)
            return out
        # The CPU head kernel computes each row alone, so stacking the rows changes nothing
        # and reads its weights once.
        last = [_last_positions(hidden[i], segments[i].logit_positions) for i in wanted]
        rows = [a.shape[0] for a in last]
        stacked = last[0] if len(last) == 1 else mx.concatenate(last, axis=0)
        logits = split.logits(stacked, fast_head)
        start = 0
        for i, count in zip(wanted, rows):
            out[i] = _per_row(logits[start:start + count], segments[i].logit_positions)
            start += count
        return out


def _cuda_rows_alone(model: Any, max_kv_size: int | None) -> bool:
    """cuda_rows.layers_compute_rows_alone, every cache one row's growing keys (a sliding
    window's or a recurrence's cache would take the positions together), and the product
    kernel giving MLX's one-row bits for this model's weights on this GPU."""
    split = split_model(model)
    if split is None or not cuda_rows.layers_compute_rows_alone(
            model, cuda_attention.kernel_takes_heads):
        return False
    from rewind.cache.kv import GrowingKVCache, make_cache

    if not all(type(layer) is GrowingKVCache
               for layer in make_cache(model, max_kv_size=max_kv_size)):
        return False
    return (cuda_rows.head_of(split.head) is not None
            and cuda_rows.same_as_mlx(cuda_rows.weights_of(model, split.head)))


def _last_positions(hidden: mx.array, positions: int) -> mx.array:
    """The last `positions` positions of hidden states [B, L, H] as rows [B * positions, H]."""
    if positions == 1:
        return hidden[:, -1, :]
    return hidden[:, -positions:, :].reshape(-1, hidden.shape[-1])


def _per_row(logits: mx.array, positions: int) -> mx.array:
    """Logits rows [B * positions, V] back as [B, V] (one position) or [B, positions, V]."""
    if positions == 1:
        return logits
    return logits.reshape(-1, positions, logits.shape[-1])
