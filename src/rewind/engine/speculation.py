"""Speculative decoding without a draft model: which rows draft, how many tokens, from where.

A decode step on a CPU reads every weight once whatever the number of rows, so a row that feeds
its next input and k drafted tokens in one call pays for the k extra positions' arithmetic
only (about a prefill token each), and keeps every drafted token the model agrees with, plus
the model's own next token after them. The scheduler runs the verification (a row's call over
[input, drafts], its logits at every position, its sampler drawing position by position) and
rolls the cache back past the first disagreement (rewind.cache.rollback); this module decides
what is drafted.

Exact by construction: every emitted token is the one the row's sampler draws from the logits
after the tokens accepted before it, and the sampler draws (and splits its random key) once per
emitted token, as without speculation. Where a row's logits are the same bits in a call of k + 1
positions as in k + 1 calls of one (the CPU kernels: rewind.kernels, attention and matrix
products compute each row alone), greedy and seeded answers are token for token the same.

When it does not pay it is off:
- per row: a draft of length L after a draft the model fully accepted is twice as long (up to
  `max_draft`), else one longer than what was accepted; after `MISSES_TO_PAUSE` drafts with
  nothing accepted in a row, the row stops drafting for a number of steps that doubles with
  each further miss (to PAUSE_STEPS_MAX);
- per step: at most `step_tokens` drafted tokens over all rows, each step another row first,
  and with `auto` a row feeds only as much of its draft as raises the step's expected tokens a
  unit of time (its acceptance so far against what its positions cost the whole batch:
  `worth_drafting`); a mode named explicitly feeds every draft found;
- per backend: only where a row's positions compute alone, so its multi-position logits are
  exact: rows decoding on caches of their own through the CPU kernels (the runner's RowCaches),
  and MLX's layers on the CPU with bf16 weights (rewind.kernels.native_linear
  .rows_compute_alone: Qwen 3.5, Gemma 4), where a row drafts while it decodes alone (a batch
  shares one merged cache, whose rows cannot give back different numbers of tokens). On CUDA
  the same for bf16/fp16 models whose every layer is attention over a growing cache and
  bias-free products (Llama-like): inside rewind.kernels.cuda_rows.rows_alone a drafted row's
  check runs kernels that compute each position with a one-token step's bits. MLX's own
  batched forward (Metal; CUDA elsewhere) sums in another order for another row count. `auto`
  stays off on GPUs, where the decode step is pipelined (queued before the last one's tokens
  are read), which drafting gives up; a mode named explicitly drafts where rows compute alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rewind.config import SPECULATIVE_MODES as MODES
from rewind.engine.drafts import DraftPool, NgramIndex

FIRST_DRAFT = 4
MISSES_TO_PAUSE = 2
PAUSE_STEPS_MAX = 64

@dataclass(frozen=True)
class StepCosts:
    """What a step costs, in plain one-row steps, by the positions it computes (its rows plus
    their drafted tokens), measured with `python benchmarks/probes/verify_cost.py` on the
    default model, 1,024 tokens held per row. What a draft adds is the step's cost with it less
    without it: where the cost of a position falls as a step widens (the VNNI build: each weight
    read once for every position, wider products on faster kernels) a draft beside others' costs
    less than alone; where the products are bound by their arithmetic (the AVX2 build) it does
    not fall. Past the last point each position adds what the last span did. Each row beyond the first adds `row_cost` besides its positions (its own cache's
    attention and bookkeeping)."""

    points: tuple[tuple[int, float], ...]
    row_cost: float

    def cost(self, positions: int, rows: int) -> float:
        """A step of `rows` rows and `positions` positions, in plain one-row steps."""
        points = self.points
        if positions >= points[-1][0]:
            (x0, y0), (x1, y1) = points[-2], points[-1]
        else:
            (x0, y0), (x1, y1) = next((a, b) for a, b in zip(points, points[1:])
                                      if positions < b[0])
        return y0 + (y1 - y0) * (positions - x0) / (x1 - x0) + self.row_cost * max(0, rows - 1)


# The kernels' AVX-512 VNNI build: the 2-core Xeon (Sapphire Rapids kind) at b70051f
# (benchmarks/results/verify-cost-xeon-b70051f.md, `--rows 1,3`): one row and k = 0, 1, 2, 4, 8,
# 16 drafted tokens took 19.4, 23.9, 26.9, 37.1, 48.1 and 58.8 ms; three plain rows 29.9 ms,
# three rows with 4, 8 and 16 drafted tokens between them 48.8, 56.3 and 68.0.
VNNI_COSTS = StepCosts(((1, 1.0), (2, 1.23), (3, 1.39), (5, 1.91), (9, 2.48), (17, 3.03)),
                       0.12)
# The AVX2 build: a 2-core AMD EPYC (Zen 2, no AVX-512) once products of up to 32 rows read each
# weight tile once for all of them (benchmarks/results/verify-cost-epyc-zen2-few-rows.md):
# 17.8, 22.2, 27.2, 40.0, 66.8 and 112.7 ms for one row and k = 0..16 (44.5, 72.4 and 119.4 for
# k = 4, 8, 16 before, verify-cost-epyc-zen2-a754936.md); two plain rows 22.5 ms, four 38.4.
# Without VNNI an int8 product is three instructions a vector (maddubs, madd, add), and at 2
# threads the head is bound by them, not by memory: each drafted position costs ~35% of a plain
# step, where on the Xeon ~15%.
AVX2_COSTS = StepCosts(((1, 1.0), (2, 1.25), (3, 1.53), (5, 2.25), (9, 3.75), (17, 6.33)),
                       0.06)
# A build without figures of its own (plain AVX-512), or no build (GPUs, where `auto` does not
# draft), takes the VNNI figures.
STEP_COSTS_BY_KERNELS = {"avx512vnni": VNNI_COSTS, "avx2": AVX2_COSTS}


def step_costs_for(kernels: str | None) -> StepCosts:
    """The step costs of a C kernel build (rewind.kernels.native.chosen_isa())."""
    return STEP_COSTS_BY_KERNELS.get(kernels or "", VNNI_COSTS)


FIRST_PRIOR = 0.8  # a row's acceptance before anything was verified in this engine
PRIOR_WEIGHT = 5.0  # the prior counts as this many drafted tokens' evidence
PRIOR_DECAY = 0.98  # the engine-wide evidence behind the prior: about the last 50 drafts
FADE = 0.9  # the estimate's evidence kept each time a row is held back from drafting


@dataclass
class RowDrafts:
    """One sequence's drafting state."""

    index: NgramIndex
    length: int = FIRST_DRAFT  # tokens to draft next time
    misses: int = 0  # drafts in a row with nothing accepted
    paused_until: int = 0  # the scheduler step before which it does not draft
    drafted: int = 0
    accepted: int = 0
    # The evidence of the acceptance estimate: drafted tokens the model agreed with, and drafts
    # that ended at one it did not; both fade while the row is held back from drafting, so a
    # row's old misses do not keep it from ever drafting again.
    agreed: float = 0.0
    disagreed: float = 0.0
    prior: float = FIRST_PRIOR  # the engine's recent acceptance when the row began
    model_row: Any = None  # rewind.engine.draft_model.DraftRow where a draft model drafts

    @property
    def acceptance(self) -> float:
        """The chance that the model agrees with a drafted token after agreeing with those
        before it: agreed tokens over agreed tokens and first disagreements (the estimate for
        drafts that stop at the first disagreement), from the engine's recent acceptance as a
        prior worth PRIOR_WEIGHT tokens: an agent's answers are short, and a row must not spend
        them learning what the rows before it showed."""
        return ((self.agreed + PRIOR_WEIGHT * self.prior)
                / (self.agreed + self.disagreed + PRIOR_WEIGHT))

    def expected_kept(self, length: int) -> float:
        """Tokens a draft of `length` is expected to keep: p + p^2 + ... + p^length."""
        p = self.acceptance
        return p * (1 - p ** length) / (1 - p) if p < 1 else float(length)


@dataclass
class SpeculationCounters:
    steps: int = 0  # decode steps that verified at least one draft
    drafts: int = 0  # drafts verified (a row's call with drafted tokens)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    by_row: list[float] = field(default_factory=list)  # acceptance of finished rows that drafted


class Speculator:
    """Drafts for the rows of one engine's decode batch."""

    def __init__(self, mode: str, max_draft: int = 16, step_tokens: int = 32,
                 pool_tokens: int = 65536, weighs_cost: bool = True,
                 draft_model: Any = None, costs: StepCosts = VNNI_COSTS) -> None:
        if mode not in ("ngram", "suffix", "draft"):
            raise ValueError(f"speculation mode must be one of ngram, suffix, draft, not {mode!r}")
        if (mode == "draft") != (draft_model is not None):
            raise ValueError("the draft mode drafts from a draft model, and only it does")
        self.mode = mode
        # rewind.engine.draft_model.DraftModel: a row's drafts come from it, not from its text.
        self.draft_model = draft_model
        # `auto` feeds only drafts expected to pay (`worth_drafting`); a mode named explicitly
        # feeds every draft found, as long as its row's adaptive length allows.
        self.weighs_cost = weighs_cost
        self.costs = costs  # what `worth_drafting` prices a step at: the kernels' own figures
        self.max_draft = max_draft
        self.step_tokens = step_tokens
        self.pool = DraftPool(pool_tokens) if mode == "suffix" else None
        self.counters = SpeculationCounters()
        self._agreed = 0.0  # the evidence behind new rows' prior, fading with each draft
        self._disagreed = 0.0

    @property
    def prior(self) -> float:
        """The acceptance a new row starts from: this engine's recent drafts, from FIRST_PRIOR."""
        return ((self._agreed + PRIOR_WEIGHT * FIRST_PRIOR)
                / (self._agreed + self._disagreed + PRIOR_WEIGHT))

    def start(self, prompt: list[int]) -> RowDrafts:
        model_row = self.draft_model.new_row() if self.draft_model is not None else None
        return RowDrafts(NgramIndex(prompt), prior=self.prior, model_row=model_row)

    def propose(self, drafts: RowDrafts, tenant: str, step: int, limit: int) -> list[int]:
        """The draft of a row whose context is `drafts.index.tokens` (prompt and generated
        tokens, its next input last), at most `limit` tokens."""
        if step < drafts.paused_until:
            return []
        limit = min(limit, drafts.length, self.max_draft)
        context = drafts.index.tokens
        if self.draft_model is not None:
            return self.draft_model.propose(drafts.model_row, context, limit)
        found = drafts.index.continuation(context, limit)
        if not found and self.pool is not None:
            found = self.pool.continuation(tenant, context, limit)
        return found

    def feed(self, drafts: RowDrafts, found: int, tokens: float, positions: int, rows: int
             ) -> tuple[int, float, int]:
        """How much of a `found`-token draft a row feeds this step (`worth_drafting` where
        this speculator weighs cost, else all of it), and the step's expected tokens and
        positions with it."""
        if self.weighs_cost:
            return self.worth_drafting(drafts, found, tokens, positions, rows, self.costs)
        return found, tokens + drafts.expected_kept(found), positions + found

    @staticmethod
    def worth_drafting(drafts: RowDrafts, found: int, tokens: float, positions: int, rows: int,
                       costs: StepCosts = VNNI_COSTS) -> tuple[int, float, int]:
        """How much of a `found`-token draft a row should feed, in a step of `rows` rows that
        so far computes `positions` positions and emits `tokens` (expected): the length that
        gives the step the most tokens a unit of its cost (`costs`), 0 where none gives
        more than the step has (the row's evidence then fades toward the prior). Returns
        (length, tokens, positions) of the step with it."""
        best = (0, tokens, positions)
        best_rate = tokens / costs.cost(positions, rows)
        for length in range(1, found + 1):
            with_draft = tokens + drafts.expected_kept(length)
            rate = with_draft / costs.cost(positions + length, rows)
            if rate > best_rate:
                best, best_rate = (length, with_draft, positions + length), rate
        if found and not best[0]:
            drafts.agreed *= FADE
            drafts.disagreed *= FADE
        return best

    def record(self, drafts: RowDrafts, step: int, drafted: int, accepted: int) -> None:
        """After a verification: `accepted` of `drafted` tokens were the model's."""
        drafts.drafted += drafted
        drafts.accepted += accepted
        drafts.agreed += accepted
        drafts.disagreed += accepted < drafted
        self._agreed = self._agreed * PRIOR_DECAY + accepted
        self._disagreed = self._disagreed * PRIOR_DECAY + (accepted < drafted)
        counters = self.counters
        counters.drafts += 1
        counters.drafted_tokens += drafted
        counters.accepted_tokens += accepted
        if accepted == drafted:
            drafts.length = min(max(drafts.length, drafted) * 2, self.max_draft)
        else:
            drafts.length = max(1, min(accepted + 1, self.max_draft))
        if accepted > 0:
            drafts.misses = 0
            return
        drafts.misses += 1
        if drafts.misses >= MISSES_TO_PAUSE:
            drafts.paused_until = step + min(1 << (drafts.misses - 1), PAUSE_STEPS_MAX)

    def finished(self, drafts: RowDrafts | None, tenant: str, answer: list[int]) -> None:
        if drafts is not None:
            drafts.model_row = None  # the row's draft-model cache goes with it
        if drafts is not None and drafts.drafted:
            self.counters.by_row.append(drafts.accepted / drafts.drafted)
            del self.counters.by_row[:-1000]
        if self.pool is not None and answer:
            self.pool.add(tenant, answer)


def resolve_mode(mode: str, rows_decode_alone: bool) -> str:
    """The mode that runs: `auto` is `suffix` where rows decode on caches of their own through
    the CPU kernels and off elsewhere (see the module's docstring)."""
    if mode not in MODES:
        raise ValueError(f"speculation mode must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "auto":
        return "suffix" if rows_decode_alone else "off"
    return mode


def tenant_of(extras: Any) -> str:
    """The pool a request drafts from: its cache salt (one per API key unless shared)."""
    return str(getattr(extras, "salt", "") or "")
