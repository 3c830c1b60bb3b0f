"""The small draft's data and losses: the target's loss, the pool of the target's greedy continuations and
the draft's distillation loss on it (the optimiser loop is loop.py)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .loop import budgeted_count, log
from .stdlib_corpus import PAD, Windows

def lm_loss(model, x: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on a batch of windows [B, T]."""
    x = x.to(model.device)
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
        seq = torch.from_numpy(np.stack([data.row(int(s), P) for s in picks])).to(target.device)  # [n, P]
        cache = DynamicCache()
        tops = [target(input_ids=seq, cache=cache, use_cache=True).logits.float().log_softmax(-1).topk(top_k, -1)]
        for _ in range(new_tokens):
            nxt = tops[-1].indices[:, -1, :1]  # [n, 1] the greedy token: top-1 after the last position
            seq = torch.cat([seq, nxt], 1)
            tops.append(target(input_ids=nxt, cache=cache, use_cache=True).logits.float().log_softmax(-1)
                        .topk(top_k, -1))
        ids = torch.cat([t.indices for t in tops], 1)[:, :-1]  # [n, len - 1, K]: after positions 0..len-2
        values = torch.cat([t.values for t in tops], 1)[:, :-1]  # [n, len - 1, K]
        seq, ids, values = seq.cpu(), ids.cpu(), values.cpu()
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

    def state_dict(self) -> dict:
        return {"gen": self.gen.get_state(), "order": self.order, "pos": self.pos, "passes": self.passes}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["gen"])
        self.order, self.pos, self.passes = state["order"], state["pos"], state["passes"]


def make_distill_loss(pool: Pool, alpha: float):
    """alpha x cross-entropy against the target's top-K distribution (renormalised) + (1 - alpha) x
    cross-entropy on the target's argmax, over every real position of the pool rows (prefix included)."""
    def distill_loss(model, picked: np.ndarray) -> torch.Tensor:
        L = int(pool.lengths[picked].max())
        dev = model.device
        x = torch.from_numpy(pool.tokens[picked, :L]).to(dev)  # [B, L]
        ids = torch.from_numpy(pool.top_ids[picked, : L - 1]).to(dev)  # [B, L-1, K]
        teacher = torch.from_numpy(pool.top_logp[picked, : L - 1]).to(dev).softmax(-1)  # [B, L-1, K] renormalised
        lengths = torch.from_numpy(pool.lengths[picked]).to(dev)  # [B]
        real = torch.arange(L - 1, device=dev)[None, :] < lengths[:, None] - 1  # [B, L-1]
        logp = model(input_ids=x).logits[:, :-1].float().log_softmax(-1)  # [B, L-1, V]
        top_logp = logp.gather(-1, ids)  # [B, L-1, K]
        soft = -(teacher * top_logp).sum(-1)  # [B, L-1]
        hard = -top_logp[..., 0]  # the target's argmax is its top-1
        per_token = alpha * soft + (1 - alpha) * hard
        return per_token[real].mean()

    return distill_loss


class WindowBatches:
    """`size` seeded random training windows per call (the target's batches)."""

    def __init__(self, data: Windows, size: int):
        self.data, self.size = data, size

    def __call__(self) -> torch.Tensor:
        return self.data.batch(self.size)

    def state_dict(self) -> dict:
        d = self.data
        return {"gen": d.gen.get_state(), "order": d.order, "pos": d.pos, "epoch": d.epoch}

    def load_state_dict(self, state: dict) -> None:
        d = self.data
        d.gen.set_state(state["gen"])
        d.order, d.pos, d.epoch = state["order"], state["pos"], state["epoch"]

