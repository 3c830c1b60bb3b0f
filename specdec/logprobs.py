"""Log-probabilities of the generated tokens (`SamplingParams.logprobs`; the server's `logprobs` and
`top_logprobs`).

**What.** For every token a request emits: the log-probability the *target* gave it at its position, and
the `logprobs` most likely tokens there with theirs. The distribution is the target's raw one: log_softmax
of its logits before temperature, top-k and top-p (vLLM's default, "raw_logprobs"), computed in the
sampling dtype (float32; float64 for a float64 model). So a token's logprob does not depend on how it was
sampled, and greedy requests get meaningful numbers.

**Never the draft's.** Every emitted token -- an accepted draft, the correction at the first rejection,
the bonus token, a prefill's first token, a target-only step's token -- sits at a position the target
scored in that step's forward (the verify pass's [B, k+1, V], a target-only step's or a prefill's [B, V]),
so its logprob is read from those logits: the same logits AR has for the same token after the same prefix
(bit for bit with `batch_invariant=True`, within rounding otherwise; tests/test_logprobs.py).

**Cost.** Computed on the device only for the rows that ask (`RowParams.logprob_rows`, built when the
rows change): their log_softmax over the vocabulary, the top entries (`topk`) and the emitted tokens'
values, brought to the host in the step's one read (`read_back`: one float64 tensor instead of the usual
int64 one). A step where no row asks computes and reads nothing more. The commit (specdec/commit.py,
`Request.commit`) keeps a token's entry with the token, so they are cut exactly where stops and
`max_tokens` cut the tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability under the target, and the most likely tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob) of the `logprobs` most likely, most likely first


class StepLogprobs:
    """The log-probabilities of one forward's positions for the rows that ask, waiting for the tokens the
    step emits there (`gather`)."""

    def __init__(self, logits, rows, top: int, dtype):
        """logits [B, T, V] (the target's, cut to the vocabulary); rows [R] int64 on the device; top: the
        most top entries any of those rows asks for."""
        self.batch_size, self.rows, self.top = logits.shape[0], rows, min(top, logits.shape[-1])
        self.logprobs = logits.index_select(0, rows).to(dtype).log_softmax(dim=-1)  # [R, T, V]
        self.top_values, self.top_ids = (self.logprobs.topk(top, dim=-1) if top else
                                         (self.logprobs[..., :0], self.logprobs[..., :0].long()))  # [R, T, top]

    @classmethod
    def of(cls, logits, params, dtype) -> "StepLogprobs | None":
        """For logits [B, T, V] (or [B, V]: one position) of a batch with `params` (RowParams); None when no
        row asks (nothing is computed)."""
        if params.logprob_rows is None:
            return None
        if logits.dim() == 2:
            logits = logits[:, None]
        return cls(logits, params.logprob_rows, max(n for n in params.host_logprobs if n is not None), dtype)

    @property
    def width(self) -> int:
        """Values per position: the token's logprob, the top values, the top ids."""
        return 1 + 2 * self.top

    def gather(self, tokens) -> torch.Tensor:
        """[B, T * width] float64 for the tokens emitted at each position, tokens [B, T] int64 (-1
        placeholders past a row's last token are read as token 0 and never used); zeros for rows that do
        not ask."""
        if tokens.dim() == 1:
            tokens = tokens[:, None]
        chosen = self.logprobs.gather(-1, tokens.index_select(0, self.rows).clamp(min=0)[..., None])  # [R, T, 1]
        per_row = torch.cat([chosen.double(), self.top_values.double(), self.top_ids.double()], dim=-1)  # [R, T, W]
        out = per_row.new_zeros(self.batch_size, per_row.shape[1] * self.width)  # [B, T * W]
        return out.index_copy_(0, self.rows, per_row.flatten(1))

    def parse(self, values: list[list[float]], tokens: list[list[int]], asked: list[int | None]) -> list:
        """Per row: a TokenLogprob for each of its emitted `tokens` (row i's values from `read_back`, its
        top cut to what it asked: `asked[i]`), or None for a row that does not ask."""
        out = []
        width, top = self.width, self.top
        for vals, toks, n in zip(values, tokens, asked):
            if n is None:
                out.append(None)
                continue
            n = min(n, top)  # a vocabulary smaller than what was asked for: all of it
            entries = []
            for j, token in enumerate(toks):
                v = vals[j * width:(j + 1) * width]
                entries.append(TokenLogprob(token, v[0], tuple((int(v[1 + top + i]), v[1 + i]) for i in range(n))))
            out.append(entries)
        return out


def read_back(ints, logprobs: StepLogprobs | None, tokens) -> tuple[list[list[int]], list[list[float]] | None]:
    """The step's one read of the device: `ints` [B, W] int64 (emitted tokens, counts, flags) and, when some
    row asks, the log-probabilities of `tokens` ([B, T] or [B], the emitted tokens at each position) --
    one tensor, one `.tolist()`. Returns (the int rows, each row's logprob values or None)."""
    if logprobs is None:
        return ints.tolist(), None
    extra = logprobs.gather(tokens)  # [B, T * width] float64: ids and counts are exact in float64
    rows = torch.cat([ints.to(torch.float64), extra], dim=1).tolist()
    W = ints.shape[1]
    return [[int(x) for x in row[:W]] for row in rows], [row[W:] for row in rows]
