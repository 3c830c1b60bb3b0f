"""The optimiser loop both recipes share: AdamW + warmup + cosine, steps fitted to a time budget or fixed, a
tqdm bar with the loss and top-1, a checkpoint every N steps that `resume` continues exactly, Ctrl-C keeping
the last checkpoint, and bfloat16 autocast on a GPU."""
from __future__ import annotations

import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

CALIBRATION_STEPS = 8  # steps timed before the step count is fixed from the budget
RECHECK_AT = (0.1, 0.25, 0.5, 0.75)  # fractions of the run at which the speed is measured again
FINAL_LR_FRACTION = 0.1  # cosine decay ends at this fraction of the peak
CHECKPOINT_VERSION = 1

_START = time.time()


def log(msg: str) -> None:
    """A progress line with the seconds since the program started (tqdm-safe: it goes above the bar)."""
    from tqdm import tqdm

    tqdm.write(f"[{time.time() - _START:7.1f}s] {msg}")


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
    device: str = "cpu"
    checkpoint: Path | None = None  # where the training state is written every `checkpoint_every` steps
    checkpoint_every: int = 0  # 0: never
    resume: bool = False  # continue from `checkpoint`
    progress: bool = True  # the tqdm bar


class Interrupted(Exception):
    """Ctrl-C during training: the last checkpoint (step `step`, or none) is kept at `path`."""

    def __init__(self, step: int | None, path: Path | None):
        super().__init__(step, path)
        self.step, self.path = step, path


@dataclass
class LoopState:
    """Everything a resumed run needs besides the model and optimizer: the step, the schedule, the seconds
    spent, the loss average, the torch RNG, the batch iterator's state and the caller's `extra` (a curve)."""
    step: int = 0
    total: int | None = None
    rechecks: list = field(default_factory=list)
    seconds: float = 0.0
    loss_ema: float | None = None
    extra: dict = field(default_factory=dict)


def autocast(device: str):
    """bfloat16 autocast on a GPU; nothing on the CPU (float32 there, as the recipes were tuned)."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else nullcontext()


def save_state(path: Path, model, opt, state: LoopState, batches) -> None:
    """The training state, written atomically (a temporary file renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    blob = {"version": CHECKPOINT_VERSION, "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
            "optimizer": opt.state_dict(), "loop": vars(state).copy(), "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "batches": batches.state_dict() if hasattr(batches, "state_dict") else None}
    tmp = path.with_name(path.name + ".tmp")
    torch.save(blob, tmp)
    os.replace(tmp, path)


def load_state(path: Path, model, opt, batches) -> LoopState:
    """Restore what `save_state` wrote into `model`, `opt` and `batches`; the loop state."""
    try:
        blob = torch.load(path, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, EOFError) as err:
        raise SystemExit(f"--resume: cannot read the checkpoint {path} ({err})") from None
    if not isinstance(blob, dict) or blob.get("version") != CHECKPOINT_VERSION:
        raise SystemExit(f"--resume: {path} is not a specdec.train checkpoint")
    try:
        model.load_state_dict(blob["model"])
        opt.load_state_dict(blob["optimizer"])
    except (RuntimeError, ValueError) as err:
        raise SystemExit(f"--resume: {path} was written for another draft shape ({str(err).splitlines()[0]})") from None
    torch.set_rng_state(blob["torch_rng"])
    if blob["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(blob["cuda_rng"])
    if blob["batches"] is not None:
        batches.load_state_dict(blob["batches"])
    return LoopState(**blob["loop"])


def make_optimizer(model, cfg: TrainConfig):
    """AdamW (betas 0.9/0.95), weight decay on matrices only."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def train_loop(name: str, model, next_batch, loss_fn, cfg: TrainConfig, after_step=None, extra: dict | None = None,
               top1=None) -> dict:
    """AdamW + warmup + cosine. `next_batch()` gives a batch (with `state_dict()` / `load_state_dict()` when a
    run must resume exactly), `loss_fn(model, batch)` its scalar loss. Without `cfg.steps` the step count is
    fitted to `cfg.minutes` after CALIBRATION_STEPS steps and re-fitted at the fractions RECHECK_AT of the run.
    `after_step(step, total)`, when given, runs after every step (validation points of a curve kept in `extra`,
    which the checkpoint saves and restores). `top1()`, when given, is the latest batch's top-1 for the bar.

    Every `cfg.checkpoint_every` steps the state goes to `cfg.checkpoint`; `cfg.resume` starts from it. Ctrl-C
    raises `Interrupted` naming the last checkpoint, which is kept as it was (a step cut in half is not saved)."""
    from tqdm import tqdm

    opt = make_optimizer(model, cfg)
    extra = {} if extra is None else extra
    state = LoopState(total=cfg.steps, extra=extra)
    if cfg.resume:
        state = load_state(cfg.checkpoint, model, opt, next_batch)
        extra.clear()
        extra.update(state.extra)
        state.extra = extra
        if cfg.steps is not None:
            state.total = cfg.steps
        log(f"{name}: resumed from {cfg.checkpoint} at step {state.step}")
    budget_s = cfg.minutes * 60.0
    last_saved = state.step if cfg.resume else None
    bar = tqdm(total=state.total, initial=state.step, desc=name, unit="step", disable=not cfg.progress,
               dynamic_ncols=True, leave=True)
    model.train()
    start = time.time() - state.seconds
    try:
        while state.total is None or state.step < state.total:
            step = state.step
            cur_lr = lr_at(step, state.total or 10**9, cfg.lr, cfg.warmup)
            for group in opt.param_groups:
                group["lr"] = cur_lr
            with autocast(cfg.device):
                loss = loss_fn(model, next_batch())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            opt.step()
            state.step = step = step + 1
            value = loss.item()
            state.loss_ema = value if state.loss_ema is None else 0.95 * state.loss_ema + 0.05 * value
            elapsed = state.seconds = time.time() - start
            if cfg.steps is None and step == CALIBRATION_STEPS and state.total is None:
                state.total = max(cfg.warmup + 1, budgeted_count(name, step, elapsed, budget_s, None))
                state.rechecks = list(RECHECK_AT)
                log(f"{name}: {elapsed / step:.2f} s/step -> {state.total} steps for {cfg.minutes:g} min")
            while state.rechecks and step >= max(CALIBRATION_STEPS + 1, int(state.total * state.rechecks[0])):
                state.rechecks.pop(0)
                state.total = budgeted_count(f"{name} steps", step, elapsed, budget_s, state.total)
            if after_step is not None:
                after_step(step, state.total)
                model.train()
            if bar.total != state.total:
                bar.total = state.total
            shown = {"loss": f"{value:.3f}", "lr": f"{cur_lr:.1e}"}
            if top1 is not None and top1() is not None:
                shown["top1"] = f"{top1():.3f}"
            bar.set_postfix(shown, refresh=False)
            bar.update(1)
            if not cfg.progress and (step % cfg.log_every == 0 or step == state.total):
                log(f"{name} step {step}/{state.total} loss {value:.3f} (ema {state.loss_ema:.3f}) lr {cur_lr:.2e}")
            if cfg.checkpoint is not None and cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                save_state(cfg.checkpoint, model, opt, state, next_batch)
                last_saved = step
    except KeyboardInterrupt:
        bar.close()
        raise Interrupted(last_saved, cfg.checkpoint) from None
    bar.close()
    if cfg.checkpoint is not None and cfg.checkpoint_every and last_saved != state.step:
        save_state(cfg.checkpoint, model, opt, state, next_batch)  # the finished run, for a later look
    model.eval()
    return dict(steps=state.step, seconds=state.seconds, final_loss_ema=state.loss_ema, batch=cfg.batch, lr=cfg.lr,
                warmup=cfg.warmup)
