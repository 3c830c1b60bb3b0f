"""Training: the optimiser loop (steps calibrated from a time budget), the target's loss, the pool of the
target's greedy continuations and the draft's distillation loss on it."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .data import PAD, Windows

CALIBRATION_STEPS = 8  # steps timed before the step count is fixed from the budget
RECHECK_AT = (0.1, 0.25, 0.5, 0.75)  # fractions of the run at which the speed is measured again
FINAL_LR_FRACTION = 0.1  # cosine decay ends at this fraction of the peak


_START = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - _START:7.1f}s] {msg}", flush=True)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to FINAL_LR_FRACTION of the peak at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


def budgeted_count(name: str, done: int, elapsed: float, budget_s: float, total: int | None) -> int:
    """Items that fit in `budget_s` at the speed so far (never fewer than done + 1)."""
    new = max(done + 1, int(budget_s * done / elapsed))
    if total is not None and new != total:
        log(f"{name}: {elapsed / done:.3f} s/item so far -> {new} instead of {total}")
    return new


@dataclass
class TrainConfig:
    batch: int
    lr: float
    warmup: int
    weight_decay: float
    clip: float
    minutes: float  # budget used to calibrate `steps` when it is None
    steps: int | None = None
    log_every: int = 50


def train_loop(name: str, model, next_batch, loss_fn, cfg: TrainConfig, after_step=None) -> dict:
    """AdamW (betas 0.9/0.95, decay on matrices only) + warmup + cosine. `next_batch()` gives a batch,
    `loss_fn(model, batch)` its scalar loss. Without `cfg.steps` the step count is fitted to `cfg.minutes`
    after CALIBRATION_STEPS steps and re-fitted at the fractions RECHECK_AT of the run. `after_step(step,
    total)`, when given, runs after every step (validation points of a training curve; its time counts)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    budget_s = cfg.minutes * 60.0
    total, rechecks = cfg.steps, []
    start, step, loss_ema = time.time(), 0, None
    model.train()
    while total is None or step < total:
        cur_lr = lr_at(step, total or 10**9, cfg.lr, cfg.warmup)
        for group in opt.param_groups:
            group["lr"] = cur_lr
        loss = loss_fn(model, next_batch())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        step += 1
        value = loss.item()
        loss_ema = value if loss_ema is None else 0.95 * loss_ema + 0.05 * value
        elapsed = time.time() - start
        if cfg.steps is None and step == CALIBRATION_STEPS:
            total = max(cfg.warmup + 1, budgeted_count(name, step, elapsed, budget_s, None))
            rechecks = list(RECHECK_AT)
            log(f"{name}: {elapsed / step:.2f} s/step -> {total} steps for {cfg.minutes:g} min")
        while rechecks and step >= max(CALIBRATION_STEPS + 1, int(total * rechecks[0])):
            rechecks.pop(0)
            total = budgeted_count(f"{name} steps", step, elapsed, budget_s, total)
        if after_step is not None:
            after_step(step, total)
            model.train()
        if step % cfg.log_every == 0 or step == total:
            log(f"{name} step {step}/{total} loss {value:.3f} (ema {loss_ema:.3f}) lr {cur_lr:.2e} "
                f"elapsed {elapsed / 60:.1f} min eta {(total - step) * elapsed / step / 60:.1f} min")
    model.eval()
    return dict(steps=step, seconds=time.time() - start, final_loss_ema=loss_ema, batch=cfg.batch, lr=cfg.lr,
                warmup=cfg.warmup)


def lm_loss(model, x: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on a batch of windows [B, T]."""
    return model(input_ids=x, labels=x).loss


# -------------------------------------------------------------------------- the target's greedy pool


@dataclass
class Pool:
    """Target-greedy continuations of real prefixes, with the target's top-K next-token distribution at
    every position: what the draft has to imitate, stored once so distillation needs no target forward."""
    tokens: np.ndarray  # [N, L] int64: BOS + prefix + greedy tokens, PAD after `lengths`
    lengths: np.ndarray  # [N] int64
    prefix_lengths: np.ndarray  # [N] int64 (BOS included)
    top_ids: np.ndarray  # [N, L - 1, K] int64: the target's top-K tokens after position t
    top_logp: np.ndarray  # [N, L - 1, K] float32: their log-probabilities (full softmax)
    seconds: float

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def generated_tokens(self) -> int:
        return int((self.lengths - self.prefix_lengths).sum())


@torch.no_grad()
def generate_pool(target, data: Windows, *, seqs: int | None, minutes: float, batch: int, new_tokens: int,
                  prefix_range: tuple[int, int], top_k: int, seed: int) -> Pool:
    """Batches of `batch` rows: one prefix length per batch drawn from `prefix_range` (tokens, BOS included),
    the prefixes taken from seeded random training windows, then `new_tokens` greedy target tokens (KV cache,
    EOS not special). Without `seqs` the count is fitted to `minutes` after every batch of the first half."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(seed)
    L = prefix_range[1] + new_tokens
    rows, top_ids, top_logp, lengths, prefixes = [], [], [], [], []
    start, target_seqs = time.time(), seqs
    while target_seqs is None or len(rows) < target_seqs:
        n = batch if target_seqs is None else min(batch, target_seqs - len(rows))
        P = int(torch.randint(prefix_range[0], prefix_range[1] + 1, (1,), generator=gen))
        picks = data.starts[torch.randint(len(data), (n,), generator=gen).numpy()]
        seq = torch.from_numpy(np.stack([data.row(int(s), P) for s in picks]))  # [n, P]
        cache = DynamicCache()
        tops = [target(input_ids=seq, cache=cache, use_cache=True).logits.float().log_softmax(-1).topk(top_k, -1)]
        for _ in range(new_tokens):
            nxt = tops[-1].indices[:, -1, :1]  # [n, 1] the greedy token: top-1 after the last position
            seq = torch.cat([seq, nxt], 1)
            tops.append(target(input_ids=nxt, cache=cache, use_cache=True).logits.float().log_softmax(-1)
                        .topk(top_k, -1))
        ids = torch.cat([t.indices for t in tops], 1)[:, :-1]  # [n, len - 1, K]: after positions 0..len-2
        values = torch.cat([t.values for t in tops], 1)[:, :-1]  # [n, len - 1, K]
        pad = L - seq.shape[1]
        rows += list(F.pad(seq, (0, pad), value=PAD).numpy())
        top_ids += list(F.pad(ids, (0, 0, 0, pad), value=PAD).numpy())
        top_logp += list(F.pad(values, (0, 0, 0, pad), value=0.0).numpy())
        lengths += [seq.shape[1]] * n
        prefixes += [P] * n
        if seqs is None and (target_seqs is None or len(rows) <= target_seqs // 2):  # re-fit in the first half
            target_seqs = max(batch, budgeted_count("pool sequences", len(rows), time.time() - start, minutes * 60,
                                                    target_seqs))
        if len(rows) % (4 * batch) == 0 or len(rows) == target_seqs:
            log(f"pool: {len(rows)}/{target_seqs} sequences, {time.time() - start:.0f} s")
    return Pool(np.stack(rows), np.array(lengths), np.array(prefixes), np.stack(top_ids), np.stack(top_logp),
                time.time() - start)


POOL_FIELDS = ("tokens", "lengths", "prefix_lengths", "top_ids", "top_logp")


def save_pool(pool: Pool, path, key: dict) -> None:
    """The pool as an .npz with the settings `key` that made it (ids as int16: the vocabulary is < 32768)."""
    import json

    arrays = {f: getattr(pool, f) for f in POOL_FIELDS}
    arrays["top_ids"] = arrays["top_ids"].astype(np.int16)
    with open(path, "wb") as fh:  # a file object: np.savez would append .npz to a name without it
        np.savez(fh, key=np.array(json.dumps(key, sort_keys=True)), seconds=np.array(pool.seconds), **arrays)


def load_pool(path, key: dict) -> Pool | None:
    """The pool saved at `path` if it was made with exactly the settings `key`, else None."""
    import json

    with np.load(path) as z:
        if json.loads(str(z["key"])) != key:
            return None
        arrays = {f: z[f] for f in POOL_FIELDS}
        arrays["top_ids"] = arrays["top_ids"].astype(np.int64)
        return Pool(**arrays, seconds=float(z["seconds"]))


class PoolBatches:
    """Rows of the pool in a seeded order, reshuffled every pass."""

    def __init__(self, pool: Pool, size: int, seed: int):
        self.pool, self.size = pool, size
        self.gen = torch.Generator().manual_seed(seed)
        self.order, self.pos, self.passes = None, 0, 0

    def __call__(self) -> np.ndarray:
        picked = []
        for _ in range(self.size):
            if self.order is None or self.pos >= len(self.order):
                self.order = torch.randperm(len(self.pool), generator=self.gen).numpy()
                self.pos, self.passes = 0, self.passes + 1
            picked.append(self.order[self.pos])
            self.pos += 1
        return np.array(picked)


def make_distill_loss(pool: Pool, alpha: float):
    """alpha x cross-entropy against the target's top-K distribution (renormalised) + (1 - alpha) x
    cross-entropy on the target's argmax, over every real position of the pool rows (prefix included)."""
    def distill_loss(model, picked: np.ndarray) -> torch.Tensor:
        L = int(pool.lengths[picked].max())
        x = torch.from_numpy(pool.tokens[picked, :L])  # [B, L]
        ids = torch.from_numpy(pool.top_ids[picked, : L - 1])  # [B, L-1, K]
        teacher = torch.from_numpy(pool.top_logp[picked, : L - 1]).softmax(-1)  # [B, L-1, K] renormalised
        real = torch.arange(L - 1)[None, :] < torch.from_numpy(pool.lengths[picked])[:, None] - 1  # [B, L-1]
        logp = model(input_ids=x).logits[:, :-1].float().log_softmax(-1)  # [B, L-1, V]
        top_logp = logp.gather(-1, ids)  # [B, L-1, K]
        soft = -(teacher * top_logp).sum(-1)  # [B, L-1]
        hard = -top_logp[..., 0]  # the target's argmax is its top-1
        per_token = alpha * soft + (1 - alpha) * hard
        return per_token[real].mean()

    return distill_loss


def window_batches(data: Windows, size: int):
    return lambda: data.batch(size)

