"""Automatic k: every step, the number of drafts that maximises expected tokens per second.

- **Cost model.** A forward's time as a function of M = rows x new tokens, for the target and for the
  draft, measured on the machine the job runs on: a few timed forwards at start-up (bounded by a time
  budget), timed and cached by the start-up measurement (specdec/startup.py: one warm-up per model, one
  cache file keyed by host, model pair, dtype and threads, here also by forward variant, batch size, k_max
  and context), and interpolated piecewise-linearly in M. A cached table is trusted only while a spot check
  agrees with it (one target and one draft forward at the batch size, each within a factor 1.5 of the
  table: a table measured while the machine was busy, or before a driver/library change, is measured
  again). A step of k drafts on B rows then costs `t_draft(B * T0) + (k - 1) * t_draft(B) + t_target(B * (k + 1))`
  (T0: the first draft forward's length, 2 or more after steps without the draft), a step of k = 0
  `t_target(B)`, each times a factor learned online from the steps' own wall times (measured over
  predicted, the median of the last few steps, per B for k > 0 and for k = 0): it covers the rest of
  the step (sampling, acceptance, bookkeeping) and the table's own error.
- **Acceptance model.** Per request, a decayed count of accepted and offered drafts (a draft after the
  first rejection is never tested, so a step of k with a accepted counts a successes out of
  a + [a < k] trials), shrunk towards the run's pooled acceptance: alpha_i. A step of k is expected to
  emit E_i(k) = 1 + alpha_i + ... + alpha_i^k tokens in row i.
- **Choice.** k* = argmax over 0..k_max of sum_i E_i(k) / t(B, k), at steady state (T0 = 2). k = 0 is a
  target-only step of the same strategy: when verifying costs more per token than the drafts gain,
  speculation switches itself off. A draft that has fallen behind (after k = 0 steps, or never prefilled:
  with auto k the draft's prefill waits until the chooser drafts, `DecodeContext.prefills_draft`) must
  first catch up on T0 > 2 tokens per row, a one-off cost: k* > 0 is kept only if drafting saves more
  than that over the tokens the batch has left to produce. With a lookup proposer, a step where k = 0 wins
  even if every row offered k drafts (and no exploration is due) is taken without asking the lookup to plan
  (`settled_at_zero`).
- **Exploration.** Until some drafts have been offered, and after `explore_every` steps in a row at
  k = 0, one step with the best k >= 1 measures the acceptance (new requests would otherwise never be
  measured) -- but only where a good draft (acceptance EXPLORE_ACCEPTANCE) could pay back the catch-up
  over the tokens left: where even a good draft cannot win (a large batch on a compute-bound target), the
  run costs exactly what AR costs, the draft never runs. And the mirror image (`measures_zero`): after each
  drafting step while fewer than ZERO_SAMPLES k = 0 steps have been timed, then after `explore_every`
  drafting steps in a row, one step takes k = 0 to measure what it costs (unmeasured, it borrows the
  drafting steps' scale, and a table that underprices a verify would keep a large batch drafting for good).

Everything the chooser reads is on the host (lengths, accepted counts already read back, wall times):
it adds no synchronisation.
"""
from __future__ import annotations

import bisect
import copy
import statistics
import time
from collections import deque

from specdec import startup
from specdec.batch import DRAFT_LAG
from specdec.startup import StartupMeasurement, forward_variant, model_identity

DEFAULT_BUDGET_S = 2.0
COST_MODEL_VERSION = 3  # in the cache key: tables of an older grid are measured again (3: smaller
# batches' one-token forwards always timed)
CATCH_UP_TOKENS = 64  # the draft is also timed at this many tokens per row (capped by the context): a catch-up
EXPLORE_ACCEPTANCE = 0.8  # exploring is worth it only where a draft accepting this often would pay
SCALE_WINDOW = 9  # steps in the robust (median) estimate of measured over predicted step time
ZERO_SAMPLES = 3  # k = 0 steps timed before its scale is trusted (a median of one is the first step's outlier)
# why a step was chosen without drafts (the summary's and /metrics' words for it)
DOES_NOT_PAY = "drafting does not pay at the measured costs and acceptance"
CATCH_UP = "the draft's catch-up would not pay back over the tokens left"
MEASURING = "timing a step without drafts (the cost model's k = 0)"
NOTHING_OFFERED = "no row had drafts on offer"
K0_REASONS = (DOES_NOT_PAY, CATCH_UP, MEASURING, NOTHING_OFFERED)
CONFIDENCE_BINS = 10  # the draft's top probability, binned: what a draft's acceptance is learned by
CALIBRATION_PRIOR = 4.0  # pseudo-trials of each bin's prior (acceptance = the bin's probability)
CALIBRATION_DECAY = 0.995  # per recorded draft: recent acceptance weighs more
MAX_STOP_THRESHOLD = 0.9  # drafting never stops at a higher chance of acceptance than this


# -------------------------------------------------------------------------------------------- cost table
class CostTable:
    """Measured forward times (seconds) of the target and the draft by M = rows x new tokens."""

    def __init__(self, target: dict[int, float], draft: dict[int, float]):
        self.target = {int(m): float(t) for m, t in target.items()}
        self.draft = {int(m): float(t) for m, t in draft.items()}

    @staticmethod
    def _interpolate(table: dict[int, float], m: int) -> float:
        """Piecewise-linear in M; flat below the first point, linear through the last two above."""
        ms = sorted(table)
        if m <= ms[0] or len(ms) == 1:
            return table[ms[0]] if m <= ms[0] else table[ms[0]] * m / ms[0]
        i = bisect.bisect_left(ms, m)
        if i < len(ms) and ms[i] == m:
            return table[m]
        lo, hi = (ms[i - 1], ms[i]) if i < len(ms) else (ms[-2], ms[-1])
        slope = (table[hi] - table[lo]) / (hi - lo)
        return max(table[lo] + slope * (m - lo), 0.0)

    def target_time(self, m: int) -> float:
        return self._interpolate(self.target, m)

    def draft_time(self, m: int) -> float:
        """0 for a proposer without a model (an empty draft table): its proposal costs no forward."""
        return self._interpolate(self.draft, m) if self.draft else 0.0

    def forwards_time(self, B: int, k: int, first_draft_tokens: int = 2, draft_forwards: int | None = None) -> float:
        """Time of the forwards of one step verifying k drafts: `draft_forwards` draft forwards (default k; more
        where rows stopped drafting early, the forward that found them unsure included; 0 where a lookup drafted
        every row), the first feeding `first_draft_tokens` per row, then the target's k + 1 tokens per row."""
        drafts = k if draft_forwards is None else draft_forwards
        if k == 0:
            return self.target_time(B)
        forwards = (self.draft_time(B * first_draft_tokens) + (drafts - 1) * self.draft_time(B)) if drafts else 0.0
        return forwards + self.target_time(B * (k + 1))

    def as_dict(self) -> dict:
        return {"target": {str(m): t for m, t in sorted(self.target.items())},
                "draft": {str(m): t for m, t in sorted(self.draft.items())}}

    @classmethod
    def from_dict(cls, entry: dict) -> "CostTable":
        """The table `as_dict` wrote (a KeyError, TypeError or ValueError for anything else)."""
        return cls(entry["target"], entry["draft"])


def grid(batch_size: int, k_max: int, context: int = 2) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(rows, new tokens) shapes to time, most useful first: target at T = 1 and 2 of a full batch, at
    T = 1 for every smaller power-of-two batch (a run's tail, where fewer rows remain: below its smallest
    point the table is flat, so without them a verify of k + 1 tokens per row there would cost what one
    token per row costs, and drafting would look free), then the longer verify lengths of a full batch;
    draft at T = 1 and 2 of a full batch, a catch-up of up to CATCH_UP_TOKENS per row, then T = 1 for
    every power-of-two batch."""
    sizes = sorted({min(2 ** i, batch_size) for i in range(batch_size.bit_length() + 1)})
    target = ([(batch_size, t) for t in range(1, min(k_max + 1, 2) + 1)] + [(b, 1) for b in sizes if b < batch_size]
              + [(batch_size, t) for t in range(3, k_max + 2)])
    catch_up = min(context, CATCH_UP_TOKENS)
    draft = [(batch_size, 1), (batch_size, 2)] + ([(batch_size, catch_up)] if catch_up > 2 else [])
    draft += [(b, 1) for b in sizes if b < batch_size] + [(1, 2)]
    return target, draft


def calibrate(target, draft, batch_size: int, k_max: int, context: int, vocab: int, measurement: StartupMeasurement,
              budget_s: float = DEFAULT_BUDGET_S) -> CostTable:
    """Time the grid's shapes with `measurement`, most useful first, until the budget is spent (at least the
    target at T = 1 and 2 of a full batch and at T = 1 of every smaller batch, and the draft's first three
    shapes). Three repeats per shape, one if the forwards are slow. Prefills and warm-ups do not count against
    the budget: with compile=True the first forward of a new shape compiles, which is not what a step costs."""
    t_grid, d_grid = grid(batch_size, k_max, context)
    if draft is None:  # a proposer without a model: its drafts cost no forward (an empty draft table)
        d_grid = []
    tables: dict[str, dict[int, float]] = {"target": {}, "draft": {}}
    start, excluded = time.perf_counter(), 0.0
    t_required = sum(T <= 2 for _, T in t_grid)  # a full batch's T = 1 and 2, every smaller batch's T = 1
    plan = ([("target", target, s, "all") for s in t_grid[:t_required]]
            + [("draft", draft, s, "last") for s in d_grid[:3]])
    required = len(plan)  # always timed, whatever the budget (the smaller batches' one-token forwards are cheap)
    plan += ([("target", target, s, "all") for s in t_grid[t_required:]]
             + [("draft", draft, s, "last") for s in d_grid[3:]])
    for i, (name, model, (rows, T), logits) in enumerate(plan):
        spent = time.perf_counter() - start - excluded
        if i >= required and spent > budget_s:
            break
        repeats = 3 if spent < budget_s / 2 else 1
        m = rows * T
        t, before = measurement.time_forward(model, rows, T, context, repeats, logits, vocab=vocab)
        excluded += before
        tables[name][m] = min(t, tables[name].get(m, float("inf")))
    return CostTable(monotone(tables["target"]), monotone(tables["draft"]))


def agrees(table: CostTable, target, draft, batch_size: int, context: int, vocab: int,
           measurement: StartupMeasurement, factor: float = startup.SPOT_CHECK_FACTOR) -> bool:
    """Whether one target and one draft forward of one token per row (median of 3, timed by `measurement`)
    are within `factor` of what the table predicts: the check a cached table passes before it is used."""
    for model, predicted, logits in ((target, table.target_time(batch_size), "all"),
                                     (draft, table.draft_time(batch_size), "last")):
        if model is None:
            continue
        measured, _ = measurement.time_forward(model, batch_size, 1, context, 3, logits, vocab=vocab)
        if not startup.within_factor(measured, predicted, factor):
            return False
    return True


def monotone(table: dict[int, float]) -> dict[int, float]:
    """The closest non-decreasing fit in M (pool adjacent violators): more work never costs less, and a
    noisy timing on a shared machine must not make the chooser prefer a larger verify."""
    blocks: list[list] = []  # [mean, weight, [m...]]
    for m in sorted(table):
        blocks.append([table[m], 1, [m]])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            b = blocks.pop()
            a = blocks[-1]
            a[0] = (a[0] * a[1] + b[0] * b[1]) / (a[1] + b[1])
            a[1] += b[1]
            a[2] += b[2]
    return {m: mean for mean, _, ms in blocks for m in ms}


# ------------------------------------------------------------------------------------------- cost cache
def cache_key(target_id: str, draft_id: str, dtype, device, batch_size: int, k_max: int, context: int,
              variant: str = "eager") -> str:
    """The start-up measurement's cache entry of a cost table (`startup.cache_key`: host, models, dtype,
    threads), by the grid's version, the forwards' variants, batch size, k_max and power-of-two context."""
    return startup.cache_key("auto-k", [target_id, draft_id], dtype, device, f"grid=v{COST_MODEL_VERSION}", variant,
                             f"B={batch_size}", f"k={k_max}", f"ctx={context_bucket(context)}")


def context_bucket(context: int) -> int:
    """The power of two >= `context` (at least 2): a cost table is cached per bucket of contexts."""
    return 1 << max(context - 1, 1).bit_length()


def describe_costs(table: CostTable, batch_size: int, context: int) -> str:
    """What a cost table holds, for the start-up summary: its batch size and context bucket (a run may measure
    a table per bucket: each is its own line) and the forwards' token counts (M) of each model."""
    def span(times: dict[int, float]) -> str:
        return f"{min(times)}-{max(times)} tokens" if times else "none (no draft model)"

    return (f"auto-k costs at B={batch_size}, context <= {context_bucket(context)}: target {span(table.target)}, "
            f"draft {span(table.draft)}")


# ------------------------------------------------------------------------------------------------ chooser
class KChooser:
    """Chooses k per step (see the module docstring). `costs` may be set later (`prepare`)."""

    def __init__(self, k_max: int, costs: CostTable | None = None, prior: float = 0.6, prior_weight: float = 2.0,
                 decay: float = 0.7, explore_every: int = 64):
        self.k_max = k_max
        self.costs = costs
        self.prior_weight = prior_weight  # pseudo-trials of the pooled acceptance in each row's estimate
        self.decay = decay  # per step, on each row's counts: recent acceptance weighs more
        self.explore_every = explore_every
        self.pooled = [prior * 4.0, 4.0]  # [accepted, offered] over the run (decayed slowly)
        self.offered = 0  # drafts offered so far: until some are, the prior alone must not switch drafting off
        self.scale: dict[tuple[int, bool], float] = {}  # (B, k > 0) -> median of the recent measured / forwards
        self.scale_samples: dict[tuple[int, bool], deque] = {}
        self.zero_streak = 0
        self.zero_timed = 0  # k = 0 steps whose wall time has been observed (ZERO_SAMPLES: its scale is its own)
        self.drafted_since_zero = 0  # steps observed at k > 0 since the last k = 0 step
        self.last = (0, 0, 2, 0.0, None)  # the last step: (B, k, first draft tokens, predicted s, draft forwards)
        self.reason: str | None = None  # why the last choice was k = 0 (one of K0_REASONS), None where it drafted
        self.key: str | None = None  # the cost cache entry `costs` came from
        # drafts that stop when unsure: the chance a draft is accepted (its row's drafts before it were) by the draft's
        # top probability, in CONFIDENCE_BINS bins, [accepted, tried] decayed, from a calibrated prior
        self.calibration = [[(i + 0.5) / CONFIDENCE_BINS * CALIBRATION_PRIOR, CALIBRATION_PRIOR]
                            for i in range(CONFIDENCE_BINS)]

    # ---------------------------------------------------------------------------------- estimates
    def alpha(self, request) -> float:
        """The request's acceptance estimate: its own (decayed) record, `Request.acceptance`, shrunk towards
        the pooled one."""
        accepted, offered = request.acceptance
        pooled = self.pooled[0] / self.pooled[1]
        return min(max((accepted + self.prior_weight * pooled) / (offered + self.prior_weight), 0.0), 0.999)

    def step_time(self, B: int, k: int, first_draft_tokens: int = 2, draft_forwards: int | None = None) -> float:
        return max(self.costs.forwards_time(B, k, first_draft_tokens, draft_forwards) * self._scale(B, k), 1e-9)

    def _scale(self, B: int, k: int) -> float:
        """Measured step time over the forwards' predicted time, learned online: the rest of the step
        (sampling, acceptance, bookkeeping) and the table's own error (a calibration on a busier or
        quieter machine is off by a factor for every shape). One value per B for every k > 0 and one for
        k = 0 (the forwards carry k; learned per k, a few noisy early steps made one k look cheap for good);
        the median of the last SCALE_WINDOW steps (one step slowed by another process must not hold the
        chooser at k = 0, where the speculative scale is no longer measured). Unseen: the nearest seen B
        of the same kind, else of the other kind (a table measured 5x too slow must not keep drafting off
        before a single draft was measured), else 1."""
        kind = k > 0
        if (B, kind) in self.scale:
            return self.scale[(B, kind)]
        for wanted in (kind, not kind):
            seen = [b for (b, s) in self.scale if s == wanted]
            if seen:
                return self.scale[(min(seen, key=lambda b: (abs(b - B), b)), wanted)]
        return 1.0

    @staticmethod
    def expected_tokens(alphas: list[float], k: int, offers: list[int] | None = None) -> float:
        """Expected tokens of a step of k: 1 + alpha + .. + alpha^k per row, or up to the row's offer
        (`offers`: drafts each row has, for proposers that may have fewer than k)."""
        if offers is None:
            return sum((1 - a ** (k + 1)) / (1 - a) for a in alphas)
        return sum((1 - a ** (min(k, o) + 1)) / (1 - a) for a, o in zip(alphas, offers))

    @staticmethod
    def verify_k(k: int, offers: list[int] | None) -> int:
        """The verify width a step of k has: k, or the longest offer if shorter."""
        return k if offers is None else min(k, max(offers, default=0))

    def rates(self, alphas: list[float], B: int, first_draft_tokens: int = 2, offers=None,
              free: bool = False) -> list[float]:
        """Expected tokens per second of every k in 0..k_max (`free`: drafts that cost no forward, a lookup's)."""
        return [self.expected_tokens(alphas, k, offers) / self.step_time(B, self.verify_k(k, offers), first_draft_tokens,
                                                                          0 if free else None)
                for k in range(self.k_max + 1)]

    def best_k(self, alphas: list[float], B: int, first_draft_tokens: int = 2, least: int = 0, offers=None,
               free: bool = False) -> int:
        """The k >= least with the highest expected tokens per second (ties: the smaller k)."""
        rates = self.rates(alphas, B, first_draft_tokens, offers, free)
        return max(range(least, self.k_max + 1), key=lambda k: (rates[k], -k))

    def pays_back(self, alphas: list[float], B: int, k: int, first_draft_tokens: int, tokens: int, offers=None) -> bool:
        """Whether drafting at k (steady state) produces `tokens` tokens sooner than k = 0 by more than the
        one-off cost of catching the draft up on `first_draft_tokens` per row, if `alphas` are the rows'
        acceptances."""
        rate_0 = self.expected_tokens(alphas, 0) / self.step_time(B, 0)
        width = self.verify_k(k, offers)
        rate_k = self.expected_tokens(alphas, k, offers) / self.step_time(B, width)
        catch_up = self.costs.forwards_time(B, width, first_draft_tokens) - self.costs.forwards_time(B, width)
        if catch_up <= 0:
            return rate_k > rate_0
        return tokens / rate_0 - tokens / rate_k > catch_up

    def draft_prefill_pays(self, requests, catch_up: int) -> bool:
        """Whether drafting for these newcomers (a batch of their own) pays back their draft's prefill,
        `catch_up` tokens per row, over the tokens they may produce, at their acceptance (a new request's: the
        pooled one) and the measured costs: `pays_back` with that prefill as the catch-up."""
        if self.costs is None or not requests:
            return True  # nothing measured to price it with: as with a fixed k
        B = len(requests)
        alphas = [self.alpha(r) for r in requests]
        tokens = sum(max(r.params.max_tokens - len(r.output_ids), 1) for r in requests)
        return self.pays_back(alphas, B, self.best_k(alphas, B, least=1), catch_up, tokens)

    @property
    def drafting(self) -> bool:
        """Whether the last step drafted (new rows then get their draft prefilled at once)."""
        return self.last[1] > 0

    # ------------------------------------------------------------------------------------- choice
    def explores(self, alphas: list[float], B: int, zero_streak: int, first_draft_tokens: int, tokens: int,
                 offers=None) -> bool:
        """Whether a k = 0 step (the `zero_streak`-th in a row) turns into an exploration step: while acceptance
        is still unmeasured, then every `explore_every` steps, and only where a good draft (acceptance
        EXPLORE_ACCEPTANCE) could pay back its catch-up over `tokens`."""
        if self.offered >= 4 * self.k_max and zero_streak < self.explore_every:
            return False
        hopeful = [max(a, EXPLORE_ACCEPTANCE) for a in alphas]
        return self.pays_back(hopeful, B, self.best_k(hopeful, B, least=1, offers=offers), first_draft_tokens,
                              tokens, offers)

    def settled_at_zero(self, batch) -> bool:
        """Whether the next step is k = 0 whatever a lookup proposer would offer, so that it need not plan (its
        tries cost 12.6 ms of a 225 ms step at batch 32 on SmolLM2, every step): no k >= 1 wins even with
        every row offering k drafts, nor would an exploration step pay with such offers. Offers only lower the
        odds: a step whose rows offer fewer drafts verifies `verify_k` columns and expects at most the tokens
        of a full offer of that width, so its rate is at most `rates(...)[width]`. For a lookup (no draft
        model: nothing to catch up) `choose` then returns 0; the step is recorded as `choose` records it."""
        B = len(batch)
        alphas = [self.alpha(r) for r in batch.requests]
        # first with every row at the best row's acceptance (one row's rates stand for all: B x the tokens at
        # the same cost): a row's expected tokens grow with its acceptance, so if no k >= 1 wins there, none
        # wins for the rows as they are -- the common case at a settled zero, without B x (k_max + 1) terms
        # per step; only if that bound fails are the rows weighed one by one
        if not self._zero_wins([max(alphas, default=0.0)], B) and not self._zero_wins(alphas, B):
            return False
        self.zero_streak += 1
        self.last = (B, 0, 2, self.step_time(B, 0), 0)
        self.reason = DOES_NOT_PAY
        return True

    def _zero_wins(self, alphas: list[float], B: int) -> bool:
        """k = 0 beats every k >= 1 for rows of acceptances `alphas` (on B rows: a lookup's full offers, at
        steady state), and no exploration step at the next streak would pay either (no catch-up)."""
        return not self.best_k(alphas, B) and not self.explores(alphas, B, self.zero_streak + 1,
                                                                 first_draft_tokens=2, tokens=0)

    def choose(self, batch, offers: list[int] | None = None, free: bool = False) -> int:
        """k for the next step of `batch`; `offers`: the drafts each row has (a lookup proposer), None
        when every row can offer k (a draft model). `free`: the offers are a lookup's beside a draft model that
        will not run (every row takes them: proposers/combined.py): a step costs its verify alone."""
        B = len(batch)
        if offers is not None and not any(offers):
            self.last = (B, 0, 2, self.step_time(B, 0), 0)
            self.reason = NOTHING_OFFERED
            return 0  # nothing on offer: nothing to weigh (the exploration streak is not advanced either)
        if free:  # no draft forward, so no catch-up to weigh: the best k of the verify's price alone
            alphas = [self.alpha(r) for r in batch.requests]
            k = self.best_k(alphas, B, offers=offers, free=True)
            self.zero_streak = 0 if k else self.zero_streak + 1
            width = self.verify_k(k, offers)
            self.last = (B, width, 2, self.step_time(B, width, 2, 0), 0)
            self.reason = None if k else DOES_NOT_PAY
            return k
        # the next draft forward's length (a proposer without a model has no draft cache: no catch-up)
        first = batch.draft_lag()[0] if batch.draft_cache is not None else DRAFT_LAG
        alphas = [self.alpha(r) for r in batch.requests]
        left = sum(max(r.params.max_tokens - len(r.output_ids), 1) for r in batch.requests)  # at most
        k = self.best_k(alphas, B, offers=offers)  # at steady state: a catch-up is paid once, weighed next
        self.reason = None if k else DOES_NOT_PAY
        if k and first > 2 and not self.pays_back(alphas, B, k, first, left, offers):
            k, self.reason = 0, CATCH_UP
        measuring = bool(k) and self.measures_zero()
        if measuring:
            k, self.reason = 0, MEASURING
        if k == 0:
            self.zero_streak += 1
            if not measuring and self.explores(alphas, B, self.zero_streak, first, left, offers):
                k = self.best_k(alphas, B, least=1, offers=offers)
        if k:
            self.zero_streak, self.reason = 0, None
        width = self.verify_k(k, offers)
        self.last = (B, width, first, self.step_time(B, width, first), None)
        return k

    def measures_zero(self) -> bool:
        """Whether a step that would draft takes k = 0 instead, to measure it: after each drafting step while
        fewer than ZERO_SAMPLES k = 0 steps have been timed, then after `explore_every` drafting steps in a
        row (the mirror of exploration). Unmeasured, k = 0 borrows the drafting steps' scale, so a table that
        underprices a verify -- one noisy calibration forward on a shared machine -- kept a batch of 32
        drafting at 0.57x AR; measured once, the first decoding step's outlier (0.8-0.9 s against 0.19 s
        after it, SmolLM2 at batch 32) made k = 0 look 8x dearer for the rest of the run (0.71x AR). A k = 0
        step costs what an AR step costs."""
        return self.drafted_since_zero >= (self.explore_every if self.zero_timed >= ZERO_SAMPLES else 1)

    def drafted(self, width: int, draft_forwards: int) -> None:
        """The step chosen last verified `width` drafts after `draft_forwards` draft forwards (fewer than chosen
        where rows stopped drafting when unsure, or none where a lookup drafted every row): what `observe` prices."""
        B, _, first, _, _ = self.last
        self.last = (B, width, first, self.step_time(B, width, first, draft_forwards), draft_forwards)

    def observe(self, seconds: float) -> float:
        """The last chosen step's measured wall time refines the cost model's scale (`_scale`). Returns the
        time that was predicted for it."""
        B, k, first_draft_tokens, predicted, draft_forwards = self.last
        if k:
            self.drafted_since_zero += 1
        else:
            self.zero_timed, self.drafted_since_zero = self.zero_timed + 1, 0
        samples = self.scale_samples.setdefault((B, k > 0), deque(maxlen=SCALE_WINDOW))
        samples.append(seconds / max(self.costs.forwards_time(B, k, first_draft_tokens, draft_forwards), 1e-9))
        self.scale[(B, k > 0)] = statistics.median(samples)
        return predicted

    # ------------------------------------------------------------------------- drafts that stop when unsure
    def calibrated(self, confidence):
        """The chance a draft is accepted (given its row's drafts before it were), by the draft's top probability
        `confidence` (a tensor [B]): the bin's learned acceptance."""
        import torch

        table = torch.tensor([a / n for a, n in self.calibration], dtype=torch.float32)  # [bins]
        index = (confidence.float() * CONFIDENCE_BINS).long().clamp_(0, CONFIDENCE_BINS - 1)  # [B]
        return table.to(confidence.device)[index]

    def stop_threshold(self, batch, k: int) -> float:
        """Where a row stops drafting: the chance that its drafts so far are all accepted below which one more
        draft does not pay. One more draft forward and one more verified position cost (at this batch's scale)
        `extra` seconds; a row's next draft adds its chance of acceptance in expected tokens; the step's expected
        rate is `rate` tokens a second: drafting on pays while chance * B >= rate * extra (the marginal token is
        worth at least the step's average)."""
        B = len(batch)
        if self.costs is None or k < 1:
            return 0.0
        alphas = [self.alpha(r) for r in batch.requests]
        rate = self.expected_tokens(alphas, k) / self.step_time(B, k)
        extra = (self.costs.draft_time(B) + self.costs.target_time(B * (k + 1))
                 - self.costs.target_time(B * k)) * self._scale(B, k)
        return min(max(rate * extra / B, 0.0), MAX_STOP_THRESHOLD)

    def record_confidence(self, confidences: list[list[float]], offered: list[int], counts: list[int]) -> None:
        """Row i's drafts had top probabilities confidences[i], it offered offered[i] of them and accepted counts[i]:
        every draft that was tested (those up to the first rejection) calibrates its bin."""
        for row, length, accepted in zip(confidences, offered, counts):
            for j, confidence in enumerate(row[:min(length, accepted + 1)]):
                cell = self.calibration[min(int(confidence * CONFIDENCE_BINS), CONFIDENCE_BINS - 1)]
                cell[0] = CALIBRATION_DECAY * cell[0] + (j < accepted)
                cell[1] = CALIBRATION_DECAY * cell[1] + 1

    def record_acceptance(self, requests, lengths: list[int], counts: list[int]) -> None:
        """Row i offered lengths[i] drafts and accepted counts[i] of them."""
        for request, length, a in zip(requests, lengths, counts):
            offered = a + (a < length)
            self.offered += offered
            stats = request.acceptance  # [accepted, offered], on the request: no other engine's business
            stats[0] = self.decay * stats[0] + a
            stats[1] = self.decay * stats[1] + offered
            self.pooled[0] = 0.99 * self.pooled[0] + a
            self.pooled[1] = 0.99 * self.pooled[1] + offered

    def for_engine(self) -> "KChooser":
        """A chooser for one Engine: this one's settings and costs, and its own run state (learned scale,
        pooled acceptance, the last choice), so that two engines on one LLM never see each other's steps.
        A subclass (a test's scripted chooser) is copied whole."""
        chooser = copy.deepcopy(self)
        chooser.zero_streak = chooser.drafted_since_zero = chooser.zero_timed = 0
        chooser.last = (0, 0, 2, 0.0, None)  # not drafting: the first prefill leaves the draft for the chooser
        return chooser


# The answer length costs are measured for when max_tokens is larger: a cap such as a chat's "until EOS, within the
# context" (thousands of tokens) is no answer length, and timing every shape on top of a prefix of half the context
# took minutes (SmolLM2, 8k context: 390 s before a chat's first answer; the per-step scale auto k learns corrects
# the costs of a longer context as it grows).
ANSWER_GUESS = 128


def make_chooser(llm) -> KChooser:
    """The chooser of an LLM with num_speculative_tokens="auto"; its costs are measured at the first
    `generate` (`prepare_chooser`), when the prompt lengths are known."""
    return KChooser(llm.options.speculation.max_speculative_tokens)


def prepare_chooser(llm, chooser: KChooser, requests, target_spec, draft_spec, batch_size: int) -> None:
    """Calibrate (or read cached) costs for this batch size and the requests' typical context (the median prompt
    and half its answer, an answer of max_tokens up to ANSWER_GUESS): once per (batch size, context bucket) in the
    run, timed and cached by the LLM's start-up measurement (`llm.startup`)."""
    speculation = llm.options.speculation
    context = int(statistics.median(len(r.prompt_ids) + min(r.params.max_tokens, ANSWER_GUESS) // 2 for r in requests))
    context = max(1, min(context, llm.max_context - speculation.k_max - 2))
    # a proposer without a model is named by its kind: the table then holds the target alone
    draft_id = model_identity(llm.draft, draft_spec) if llm.draft is not None else "no-draft-model"
    ids = model_identity(llm.target, target_spec), draft_id
    variant = "/".join(forward_variant(m) for m in (llm.target, llm.draft) if m is not None)
    key = cache_key(ids[0] or "object", ids[1] or "object", llm.target.dtype, llm.device, batch_size,
                    speculation.k_max, context, variant)
    if chooser.costs is not None and chooser.key in (None, key):  # costs given by the caller, or already these
        return
    measurement = llm.startup
    chooser.costs, _ = measurement.measure(
        key if None not in ids else None,
        lambda: calibrate(llm.target, llm.draft, batch_size, speculation.k_max, context, llm.vocab_size, measurement),
        decode=CostTable.from_dict,
        describe=lambda table: describe_costs(table, batch_size, context), encode=CostTable.as_dict,
        check=lambda table: agrees(table, llm.target, llm.draft, batch_size, context, llm.vocab_size, measurement))
    chooser.key = key
