#!/usr/bin/env python
"""Train specdec's default target/draft pair (package data under specdec/assets/default_pair/).

Reproducible, CPU-only recipe (float32 training, bfloat16 checkpoints):

1. Data: the Python standard library's own ``*.py`` sources on this machine (code with English
   docstrings and comments). The file list is fixed and sorted; data-table directories are excluded; every
   ``--holdout-every``-th file (by sorted index) is held out for evaluation and prompts.
2. Tokenizer: SentencePiece BPE, Llama style (``tokenizer.model``: unk 0, bos 1, eos 2, pad 3,
   byte_fallback, split_digits), trained with identity normalisation, no dummy prefix and no whitespace
   collapsing so that code round-trips exactly; newlines and tabs are byte pieces (<0x0A>, <0x09>),
   runs of spaces are learned whitespace-only pieces.
3. Target: ``LlamaForCausalLM`` (~12.5M parameters) trained with AdamW + cosine schedule on
   BOS-prefixed 256-token windows.
4. Draft: a ~10x smaller ``LlamaForCausalLM`` distilled from the target's next-token distributions
   (forward KL to the target's softmax, mixed with a little cross-entropy).
5. Evaluation: held-out cross-entropy of both models, teacher-forced top-1 agreement, and the greedy
   speculative-decoding acceptance rate at k=5 on the held-out prompts (``specdec/assets/prompts.txt``).
   Results and the full recipe go to ``docs/default_pair.md``.

The number of optimiser steps is calibrated from ``--minutes-target`` / ``--minutes-draft`` by timing the
first steps, unless ``--target-steps`` / ``--draft-steps`` are given (pass the logged numbers to reproduce a
run exactly, up to floating-point thread nondeterminism).

Example (the shipped pair)::

    python bench/train_default_pair.py

Smoke test (about two minutes, writes to /tmp)::

    python bench/train_default_pair.py --out /tmp/smoke/default_pair --prompts-out /tmp/smoke/prompts.txt \\
        --doc /tmp/smoke/default_pair.md --target-steps 6 --draft-steps 6 --eval-windows 8 --num-prompts 4
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import io
import json
import math
import os
import platform
import shlex
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

# Small per-token forwards on a shared, oversubscribed CPU are ~10x slower with OpenMP's default spin-waiting.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
EXCLUDED_DIRS = ("test", "tests", "idlelib", "lib2to3", "site-packages", "encodings", "pydoc_data")
BOS, EOS, PAD, UNK = 1, 2, 3, 0
PROMPTS_HEADER = (
    "# Held-out prompts for specdec's default pair, written by bench/train_default_pair.py: one prompt per "
    "line; a newline inside a prompt is written as the two characters \\n (prompts never contain a real "
    "backslash); lines starting with # are comments."
)

_T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - _T0:7.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------------------------- data


def stdlib_files(root: Path) -> list[Path]:
    """The fixed, sorted list of stdlib sources used (train + held out)."""
    files = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if set(rel.parts[:-1]) & set(EXCLUDED_DIRS):
            continue
        if rel.parts[0].startswith("config-") or p.name.startswith("_sysconfigdata"):
            continue  # build-configuration files, not library code
        files.append(p)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def read_source(path: Path) -> str:
    text = path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
    return text if text.endswith("\n") or not text else text + "\n"


def truncate_at_line(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    cut = text.rfind("\n", 0, limit)
    return text[: cut + 1] if cut > 0 else text[:limit]


def per_file_cap(lengths: list[int], max_chars: int) -> int:
    """Largest cap c with sum(min(len, c)) <= max_chars ("water filling": big files are cut first)."""
    if sum(lengths) <= max_chars:
        return max(lengths) if lengths else 0
    lo, hi = 0, max(lengths)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(min(n, mid) for n in lengths) <= max_chars:
            lo = mid
        else:
            hi = mid - 1
    return lo


# ---------------------------------------------------------------------------------------- tokenizer

SPM_SETTINGS = dict(
    model_type="bpe",
    vocab_size=4000,
    byte_fallback=True,
    split_digits=True,
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    add_dummy_prefix=False,
    allow_whitespace_only_pieces=True,
    split_by_whitespace=True,
    max_sentencepiece_length=16,
    character_coverage=0.9995,
    unk_id=UNK,
    bos_id=BOS,
    eos_id=EOS,
    pad_id=PAD,
    unk_piece="<unk>",
    bos_piece="<s>",
    eos_piece="</s>",
    pad_piece="<pad>",
    max_sentence_length=16384,
    input_sentence_size=0,
    shuffle_input_sentence=False,
)

TOKENIZER_CONFIG = {
    "tokenizer_class": "LlamaTokenizer",
    "add_bos_token": True,
    "add_eos_token": False,
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "pad_token": "<pad>",
    "legacy": False,
    "add_prefix_space": False,
    "clean_up_tokenization_spaces": False,
    "model_max_length": 256,
}


def train_tokenizer(train_texts: list[str], vocab_size: int, threads: int) -> bytes:
    import sentencepiece as spm

    lines = [line for text in train_texts for line in text.split("\n") if line.strip()]
    settings = dict(SPM_SETTINGS, vocab_size=vocab_size, num_threads=threads)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, minloglevel=2, **settings)
    return buf.getvalue()


# ------------------------------------------------------------------------------------------- models


def model_configs(vocab_size: int, ctx: int):
    from transformers import LlamaConfig

    common = dict(
        vocab_size=vocab_size,
        max_position_embeddings=ctx,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        initializer_range=0.02,
        attention_dropout=0.0,
    )
    target = LlamaConfig(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
                         num_key_value_heads=2, head_dim=64, **common)
    draft = LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, **common)
    return target, draft


def build_model(cfg, seed: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).float()
    return model


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


class Windows:
    """BOS + (ctx-1) token windows over a token stream, starts snapped to line starts, shuffled per epoch."""

    def __init__(self, stream: np.ndarray, newline_id: int, ctx: int, seed: int):
        self.stream, self.body = stream, ctx - 1
        nl = np.flatnonzero(stream == newline_id) + 1
        starts = []
        for s in range(0, len(stream) - self.body, self.body):
            j = np.searchsorted(nl, s)  # first line start at or after s, if close enough
            t = int(nl[j]) if j < len(nl) and nl[j] - s < 64 else s
            if t + self.body <= len(stream):
                starts.append(t)
        self.starts = np.array(starts, dtype=np.int64)
        self.gen = torch.Generator().manual_seed(seed)
        self.order, self.pos, self.epoch = None, 0, 0

    def __len__(self):
        return len(self.starts)

    def batch(self, size: int) -> torch.Tensor:
        rows = []
        for _ in range(size):
            if self.order is None or self.pos >= len(self.order):
                self.order = torch.randperm(len(self.starts), generator=self.gen).numpy()
                self.pos, self.epoch = 0, self.epoch + 1
            s = int(self.starts[self.order[self.pos]])
            self.pos += 1
            rows.append(np.concatenate([[BOS], self.stream[s: s + self.body]]))
        return torch.from_numpy(np.stack(rows).astype(np.int64))


@torch.no_grad()
def generate_pool(target, data: Windows, n_seqs: int, prefix: int, batch: int, seed: int) -> np.ndarray:
    """Target-greedy continuations of real text: BOS + (prefix-1) tokens of a training window, then the target's
    greedy tokens up to the full window length. These are the sequences speculative decoding actually sees."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(seed)
    picks = data.starts[torch.randperm(len(data.starts), generator=gen)[:n_seqs].numpy()]
    out = []
    for i in range(0, len(picks), batch):
        rows = [np.concatenate([[BOS], data.stream[s: s + prefix - 1]]) for s in picks[i: i + batch]]
        seq = torch.from_numpy(np.stack(rows).astype(np.int64))
        cache = DynamicCache()
        logits = target(input_ids=seq, cache=cache, use_cache=True).logits[:, -1]
        while seq.shape[1] < data.body + 1:
            nxt = logits.argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
            if seq.shape[1] < data.body + 1:
                logits = target(input_ids=nxt, cache=cache, use_cache=True).logits[:, -1]
        out.append(seq.numpy())
    return np.concatenate(out)


class MixedBatches:
    """Each batch: round(frac * size) rows from a pool of generated sequences, the rest from real windows."""

    def __init__(self, data: Windows, pool: np.ndarray | None, frac: float, seed: int):
        self.data, self.pool, self.body = data, pool, data.body
        self.n_pool = 0 if pool is None or not len(pool) else frac
        self.gen = torch.Generator().manual_seed(seed)
        self.order, self.pos, self.pool_epochs = None, 0, 0

    @property
    def epoch(self):
        return self.data.epoch

    def batch(self, size: int) -> torch.Tensor:
        k = int(round(self.n_pool * size))
        rows = []
        for _ in range(k):
            if self.order is None or self.pos >= len(self.order):
                self.order = torch.randperm(len(self.pool), generator=self.gen).numpy()
                self.pos, self.pool_epochs = 0, self.pool_epochs + 1
            rows.append(torch.from_numpy(self.pool[self.order[self.pos]].astype(np.int64)))
            self.pos += 1
        real = self.data.batch(size - k) if size > k else None
        parts = ([torch.stack(rows)] if rows else []) + ([real] if real is not None else [])
        return torch.cat(parts, 0)


def lr_at(step: int, total: int, peak: float, warmup: int, final_frac: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def train_loop(name, model, data: Windows, *, batch: int, lr: float, warmup: int, minutes: float,
               steps: int | None, loss_fn, log_every: int, weight_decay: float, clip: float):
    """AdamW + linear warmup + cosine decay to 10%. Steps calibrated from `minutes` unless given."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95), eps=1e-8)
    budget = minutes * 60.0
    total = steps
    calib = 8
    step_times, recheck = [], []
    start = time.time()
    loss_ema = None
    step = 0
    ctx = data.body + 1
    model.train()
    while total is None or step < total:
        t0 = time.time()
        cur_lr = lr_at(step, total or 10**9, lr, warmup, 0.1)
        for group in opt.param_groups:
            group["lr"] = cur_lr
        x = data.batch(batch)
        loss = loss_fn(model, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        step += 1
        step_times.append(time.time() - t0)
        value = loss.item()
        loss_ema = value if loss_ema is None else 0.95 * loss_ema + 0.05 * value
        elapsed = time.time() - start
        if steps is None and step == calib:
            per_step = float(np.median(step_times[2:]))
            total = max(warmup + 1, int(budget / per_step))
            recheck = [0.1, 0.25, 0.5]  # fractions of the run at which the speed is measured again
            log(f"{name}: {per_step:.2f} s/step measured -> {total} steps for {minutes:g} min")
        while steps is None and recheck and step >= max(calib + 1, int(total * recheck[0])):
            # the machine is shared: re-estimate the speed during the first half (the cosine tail stays fixed)
            recheck.pop(0)
            old, total = total, max(step + 1, int(budget * step / elapsed))
            if total != old:
                log(f"{name}: {elapsed / step:.2f} s/step so far -> {total} steps instead of {old}")
        if step % log_every == 0 or step == total:
            eta = (total - step) * elapsed / step if total else float("nan")
            log(f"{name} step {step}/{total} loss {value:.3f} (ema {loss_ema:.3f}) lr {cur_lr:.2e} "
                f"{step * batch * ctx / elapsed:.0f} tok/s elapsed {elapsed / 60:.1f} min eta {eta / 60:.1f} min")
        if steps is None and elapsed > 1.15 * budget and step < total:
            log(f"{name}: WARNING stopping early at step {step}/{total}: over 1.15x the time budget")
            break
    model.eval()
    if steps is None:
        log(f"{name}: trained {step} steps (pass --{name}-steps {step} for a fixed schedule of this length)")
    return dict(steps=step, planned_steps=total, tokens=step * batch * ctx, seconds=time.time() - start,
                final_loss_ema=loss_ema, epochs=data.epoch, batch=batch, lr=lr, warmup=warmup)


def lm_loss(model, x):
    return model(input_ids=x, labels=x).loss


def make_kd_loss(teacher, alpha: float, temperature: float):
    def kd_loss(model, x):
        with torch.no_grad():
            t_logits = teacher(input_ids=x).logits[:, :-1].float()
        s_logits = model(input_ids=x).logits[:, :-1].float()
        v = s_logits.shape[-1]
        t_logp = F.log_softmax(t_logits / temperature, -1).reshape(-1, v)
        s_logp = F.log_softmax(s_logits / temperature, -1).reshape(-1, v)
        kl = F.kl_div(s_logp, t_logp, log_target=True, reduction="batchmean") * temperature**2
        if alpha >= 1.0:
            return kl
        ce = F.cross_entropy(s_logits.reshape(-1, v), x[:, 1:].reshape(-1))
        return alpha * kl + (1 - alpha) * ce

    return kd_loss


# ----------------------------------------------------------------------------------------- prompts


def extract_prompts(held_texts: list[str], count: int, max_chars: int = 200) -> list[str]:
    """Signature (<= 3 lines) + first docstring line of held-out defs/classes, round-robin over files."""
    per_file = []
    for text in held_texts:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            per_file.append([])
            continue
        lines = text.split("\n")
        found = []
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        for node in sorted(nodes, key=lambda n: n.lineno):
            body0 = node.body[0] if node.body else None
            if not (isinstance(body0, ast.Expr) and isinstance(body0.value, ast.Constant)
                    and isinstance(body0.value.value, str)):
                continue
            head = lines[node.lineno - 1: body0.lineno]  # def/class line(s) .. first docstring line
            if len(head) > 4 or len(head) < 2 or not head[-1].strip().strip("rRbBuU\"'"):
                continue
            snippet = textwrap.dedent("\n".join(head)).rstrip()
            if ("\\" in snippet or "\t" in snippet or len(snippet) > max_chars
                    or not snippet.startswith(("def ", "class ", "async def "))):
                continue
            found.append(snippet)
        per_file.append(found)
    prompts, depth = [], 0
    while len(prompts) < count and any(depth < len(f) for f in per_file):
        for found in per_file:
            if depth < len(found) and len(prompts) < count:
                prompts.append(found[depth])
        depth += 1
    return prompts


def write_prompts(path: Path, prompts: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(PROMPTS_HEADER + "\n")
        for p in prompts:
            f.write(p.replace("\n", "\\n") + "\n")


def read_prompts(path: Path) -> list[str]:
    out = []
    for line in path.read_text(encoding="utf-8").split("\n"):
        if line and not line.startswith("#"):
            out.append(line.replace("\\n", "\n"))
    return out


# -------------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def heldout_eval(target, draft, data: Windows, n_windows: int):
    idx = np.linspace(0, len(data) - 1, num=min(n_windows, len(data))).round().astype(int)
    tot = {"target": 0.0, "draft": 0.0}
    agree = count = 0
    for i in range(0, len(idx), 8):
        rows = [np.concatenate([[BOS], data.stream[s: s + data.body]]) for s in data.starts[idx[i:i + 8]]]
        x = torch.from_numpy(np.stack(rows).astype(np.int64))
        labels = x[:, 1:].reshape(-1)
        lt = target(input_ids=x).logits[:, :-1].float().reshape(-1, target.config.vocab_size)
        ld = draft(input_ids=x).logits[:, :-1].float().reshape(-1, draft.config.vocab_size)
        tot["target"] += F.cross_entropy(lt, labels, reduction="sum").item()
        tot["draft"] += F.cross_entropy(ld, labels, reduction="sum").item()
        agree += (lt.argmax(-1) == ld.argmax(-1)).sum().item()
        count += labels.numel()
    return {"target_loss": tot["target"] / count, "draft_loss": tot["draft"] / count,
            "top1_agreement": agree / count, "eval_tokens": count, "eval_windows": len(idx)}


def _feed(model, cache, seq: list[int]) -> torch.Tensor:
    """Run `model` on the tokens of `seq` that `cache` has not seen yet; logits for those positions."""
    seen = cache.get_seq_length()
    out = model(input_ids=torch.tensor([seq[seen:]]), cache=cache, use_cache=True)
    return out.logits[0]


@torch.no_grad()
def greedy_reference(model, ids: list[int], new_tokens: int) -> list[int]:
    from transformers import DynamicCache

    cache, seq = DynamicCache(), list(ids)
    while len(seq) < len(ids) + new_tokens:
        seq.append(int(_feed(model, cache, seq)[-1].argmax()))
    return seq[len(ids):]


@torch.no_grad()
def speculative_acceptance(target, draft, prompt_ids: list[list[int]], k: int, new_tokens: int):
    """Greedy speculative decoding simulation with KV caches (batch 1, EOS ignored).

    Each step the draft proposes k tokens greedily, one target forward scores them, the longest prefix equal to
    the target's own greedy choices is accepted and the target's next token is appended.
    """
    from transformers import DynamicCache

    proposed = accepted = steps = exact = 0
    samples = []
    for ids in prompt_ids:
        seq = list(ids)
        t_cache, d_cache = DynamicCache(), DynamicCache()
        while len(seq) < len(ids) + new_tokens:
            guess = []
            for _ in range(k):
                guess.append(int(_feed(draft, d_cache, seq + guess)[-1].argmax()))
            # target logits after seq[-1], g1, ..., gk: its greedy choice at each of the k+1 positions
            n_new = len(seq) + k - t_cache.get_seq_length()
            choice = _feed(target, t_cache, seq + guess)[n_new - k - 1:].argmax(-1).tolist()
            n = 0
            while n < k and guess[n] == choice[n]:
                n += 1
            proposed += k
            accepted += n
            steps += 1
            seq += guess[:n] + [choice[n]]
            for cache in (t_cache, d_cache):  # keep only entries for accepted tokens (all but the newest)
                extra = cache.get_seq_length() - (len(seq) - 1)
                if extra > 0:
                    cache.crop(-extra)  # transformers 5: a negative count removes that many newest entries
        gen = seq[len(ids): len(ids) + new_tokens]
        exact += gen == greedy_reference(target, ids, new_tokens)
        samples.append(gen)
    return {"acceptance": accepted / proposed, "mean_accepted_per_step": accepted / steps,
            "tokens_per_target_call": (accepted + steps) / steps, "proposed": proposed, "accepted": accepted,
            "target_calls": steps, "matches_plain_greedy": exact, "prompts": len(prompt_ids)}, samples


# --------------------------------------------------------------------------------------------- save


def save_checkpoint(model, out: Path, tokenizer_model: bytes) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*"):
        if stale.is_file():
            stale.unlink()
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    model.save_pretrained(out, safe_serialization=True)
    model.float()
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dtype"] = "bfloat16"
    cfg["torch_dtype"] = "bfloat16"  # older readers look for this key
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "tokenizer.model").write_bytes(tokenizer_model)
    (out / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {k: TOKENIZER_CONFIG[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")}, indent=2) + "\n")
    # tokenizer.json for the `tokenizers` library, converted by transformers from tokenizer.model
    tok = AutoTokenizer.from_pretrained(out)
    tok.backend_tokenizer.save(str(out / "tokenizer.json"))
    for path in out.iterdir():
        path.chmod(0o644)


def check_tokenizers(ckpt: Path, sp, texts: list[str]) -> dict:
    """sentencepiece, transformers and `tokenizers` must agree on ids, and decoding must round-trip."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(ckpt)
    raw = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    res = {"texts": len(texts), "spm_roundtrip": 0, "hf_ids_match": 0, "tokenizers_ids_match": 0,
           "hf_roundtrip": 0}
    for t in texts:
        ids = sp.encode(t)
        res["spm_roundtrip"] += sp.decode(ids) == t
        hf_ids = hf(t)["input_ids"]
        res["hf_ids_match"] += hf_ids == [BOS] + ids
        res["tokenizers_ids_match"] += raw.encode(t).ids == [BOS] + ids
        res["hf_roundtrip"] += hf.decode(hf_ids, skip_special_tokens=True) == t
    return res


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------------- doc


def write_doc(path: Path, r: dict) -> None:
    a, t, d = r["args"], r["train_target"], r["train_draft"]
    ev, acc = r["heldout"], r["spec"]
    tc, dc = r["target_config"], r["draft_config"]

    def cfg_line(c, n):
        return (f"hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, {c['num_attention_heads']} heads "
                f"(head_dim {c['head_dim']}), {c['num_key_value_heads']} KV heads, intermediate "
                f"{c['intermediate_size']} (SwiGLU), RMSNorm eps {c['rms_norm_eps']}, RoPE theta "
                f"{r['rope_theta']:g}, context {c['max_position_embeddings']}, untied embeddings: "
                f"**{n / 1e6:.2f}M parameters**")

    spm_kv = ", ".join(f"`{k}={v}`" for k, v in r["spm_settings"].items())
    files_md = "\n".join(f"| `{f['path']}` | {f['bytes']:,} | `{f['sha256'][:16]}` |" for f in r["files"])
    samples = "\n\n".join(f"```python\n{s}\n```" for s in r["samples"])
    doc = f"""# The default target/draft pair

`specdec/assets/default_pair/` ships a small Llama-architecture pair so that `python -m specdec.run` works
out of the box on real text: `target/` (~{r['target_params'] / 1e6:.1f}M parameters) and `draft/`
(~{r['draft_params'] / 1e6:.1f}M parameters), trained on Python standard-library source code. The models are
tiny and trained for minutes on two CPU cores: they write plausible-looking Python, not correct Python. Their
purpose is to exercise the runtime with a realistic vocabulary, real text and a draft that agrees with the
target often enough for speculative decoding to pay off.

This file is written by `bench/train_default_pair.py`; rerun the script rather than editing it by hand.

## Results

| | value |
|---|---|
| held-out loss, target (nats/token) | **{ev['target_loss']:.4f}** (perplexity {math.exp(ev['target_loss']):.2f}) |
| held-out loss, draft (nats/token) | **{ev['draft_loss']:.4f}** (perplexity {math.exp(ev['draft_loss']):.2f}) |
| held-out tokens / windows | {ev['eval_tokens']:,} / {ev['eval_windows']} (BOS + 255 tokens each) |
| teacher-forced top-1 agreement draft vs target | {ev['top1_agreement']:.3f} |
| **greedy acceptance, k = {a['k']}** | **{acc['acceptance']:.3f}** ({acc['accepted']:,} of {acc['proposed']:,} drafted tokens) |
| mean accepted drafts per target call | {acc['mean_accepted_per_step']:.2f} (so {acc['tokens_per_target_call']:.2f} tokens per target call) |
| prompts / new tokens per prompt | {acc['prompts']} / {a['new_tokens']} |
| speculative output == plain greedy output | {acc['matches_plain_greedy']} of {acc['prompts']} prompts |
| target / draft checkpoint size | {r['target_bytes'] / 2**20:.1f} MiB / {r['draft_bytes'] / 2**20:.1f} MiB (bfloat16 safetensors) |
| wall time: tokenizer / target / draft / eval / total | {r['time_tokenizer']:.0f} s / {t['seconds'] / 60:.1f} min / {d['seconds'] / 60:.1f} min / {r['time_eval']:.0f} s / {r['time_total'] / 60:.1f} min |

Losses and acceptance are measured with transformers on the **saved bfloat16 weights, computed in
float32**. Acceptance simulates greedy speculative decoding per prompt (batch 1, KV caches, EOS ignored): the draft
proposes {a['k']} tokens greedily, one target forward checks them, the longest matching prefix is accepted
and the target's own next token is appended; acceptance = accepted drafts / proposed drafts over
{a['new_tokens']} new tokens per prompt (the last step may overshoot and is counted in full).

Tokenizer checks on the {r['tok_check']['texts']} held-out files: sentencepiece encode/decode round-trips
{r['tok_check']['spm_roundtrip']} exactly; transformers `AutoTokenizer` gives identical ids (with BOS) on
{r['tok_check']['hf_ids_match']} and decodes {r['tok_check']['hf_roundtrip']} exactly; `tokenizers`
(`tokenizer.json`) gives identical ids on {r['tok_check']['tokenizers_ids_match']}.

## Recipe

Command (run from the repository root):

```
{r['command']}
```

By default the step counts are calibrated from `--minutes-target`/`--minutes-draft` on the machine the script runs
on (timed after 8 steps, re-estimated at 10%, 25% and 50% of the run, because the machine is shared), so they
vary from run to run. For a fixed schedule of the same length as this run, add
`--target-steps {t['steps']} --draft-steps {d['steps']}`. Seeds:
`--seed {a['seed']}` (target init seed {a['seed']}, draft init seed {a['seed'] + 1}, data order seeds
{a['seed'] + 2} / {a['seed'] + 3}); training is deterministic given the seed and step counts up to
floating-point nondeterminism of multi-threaded CPU kernels.

Environment: Python {platform.python_version()}, torch {torch.__version__}, transformers {r['transformers']},
sentencepiece {r['sentencepiece']}, {a['threads']} CPU threads ({platform.processor() or platform.machine()}),
float32 training.

### Data

- Source: `sysconfig.get_paths()["stdlib"]` = `{r['stdlib']}`, all `*.py` files, sorted by relative path.
- Excluded: any file under a directory named {', '.join('`' + e + '/`' for e in EXCLUDED_DIRS)}
  (`encodings/` holds codec tables and `pydoc_data/` one huge string, both data rather than code), plus
  `config-*/` and `_sysconfigdata*` (build configuration). That leaves {r['n_files']} files,
  {r['total_chars']:,} characters.
- Held out: every {a['holdout_every']}th file of that list (index % {a['holdout_every']} == 0): {r['n_held']} files,
  {r['held_chars']:,} characters, used for the held-out loss and the prompts; the other {r['n_train']} files train
  the tokenizer and both models.
- Size cap `--max-chars {a['max_chars']:,}`: every training file is cut (at a line end) to at most
  {r['file_cap']:,} characters, the largest per-file cap keeping the total under the limit, so big files are
  trimmed first and every file contributes. Training text: {r['train_chars']:,} characters =
  {r['train_tokens']:,} tokens ({r['train_chars'] / r['train_tokens']:.2f} characters/token).
- Token stream: each file's tokens followed by EOS, files concatenated. Training windows are BOS + 255 tokens,
  one per 255-token stride, each start moved to the next line start when one is within 64 tokens; windows
  are reshuffled every epoch with a seeded generator. Held-out windows are built the same way from the
  held-out files ({a['eval_windows']} evenly spaced windows at most).
- Prompts: `specdec/assets/prompts.txt`, {r['n_prompts']} prompts from the held-out files: the `def`/`class`
  line(s) of a documented function or class plus the first docstring line, dedented, taken round-robin over
  the held-out files in order; prompts with a backslash or tab, over 200 characters or a signature longer than
  3 lines are skipped. Newlines are written as the two characters `\\n`.

### Tokenizer

SentencePiece {r['sentencepiece']} BPE trained on the non-blank lines of the training text (one line per
sentence, no sampling, no shuffling): {spm_kv}.
Pieces: 0 `<unk>`, 1 `<s>` (BOS), 2 `</s>` (EOS), 3 `<pad>`, then the 256 byte pieces `<0x00>`..`<0xFF>`,
then merges. Because sentencepiece splits training input into lines, a newline is never part of a learned
piece: it encodes as the byte piece `<0x0A>` (tabs as `<0x09>`). Identity normalisation, no dummy prefix and
no whitespace collapsing keep indentation meaningful: runs of spaces are learned whitespace-only pieces
(`▁▁▁▁`, `▁▁▁▁▁▁▁▁`, ...), and decode(encode(x)) == x for any text. Each checkpoint directory has
`tokenizer.model`, `tokenizer_config.json` (`LlamaTokenizer`, `add_bos_token: true`, `legacy: false`,
`add_prefix_space: false`), `special_tokens_map.json` and a `tokenizer.json` converted by transformers.

### Models

Both are `LlamaForCausalLM` (transformers {r['transformers']}), float32 during training, saved with
`save_pretrained(safe_serialization=True)` after `.to(torch.bfloat16)` (`config.json` has `dtype` and
`torch_dtype` "bfloat16"; `generation_config.json` has bos 1, eos 2, pad 3). Initialisation: transformers'
default (normal, std 0.02).

- target: {cfg_line(tc, r['target_params'])}.
- draft: {cfg_line(dc, r['draft_params'])}.

### Training

- Optimiser (both): AdamW, betas (0.9, 0.95), eps 1e-8, weight decay {a['weight_decay']} on matrices (none on
  norms), gradient clipping {a['clip']}, linear warmup then cosine decay to 10% of the peak.
- Target: next-token cross-entropy; batch {t['batch']} x 256 tokens, peak lr {t['lr']:g}, warmup {t['warmup']}
  steps, **{t['steps']} steps** (calibrated for {a['minutes_target']:g} min), {t['tokens']:,} tokens seen
  ({t['epochs']} epoch(s) of windows started), {t['seconds'] / 60:.1f} min, final training loss (EMA)
  {t['final_loss_ema']:.3f}.
- Draft: distillation on the same training windows: loss = {a['kd_alpha']:g} x KL(target softmax || draft
  softmax) (temperature {a['kd_temperature']:g}, forward KL, per token) + {1 - a['kd_alpha']:g} x cross-entropy
  on the data; the target runs in float32 under `no_grad` on each batch. Batch {d['batch']} x 256, peak lr
  {d['lr']:g}, warmup {d['warmup']} steps, **{d['steps']} steps** (calibrated for {a['minutes_draft']:g} min),
  {d['tokens']:,} tokens seen, {d['seconds'] / 60:.1f} min, final training loss (EMA) {d['final_loss_ema']:.3f}.

## Files

| file | bytes | sha256 (prefix) |
|---|---|---|
{files_md}

## Sample (first held-out prompts, target greedy, {a['new_tokens']} tokens)

{samples}
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc, encoding="utf-8")


# --------------------------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "specdec/assets/default_pair",
                   help="output folder; target/ and draft/ checkpoint directories are written inside")
    p.add_argument("--prompts-out", type=Path, default=REPO / "specdec/assets/prompts.txt",
                   help="where to write the held-out prompts (one per line, newlines escaped as \\n)")
    p.add_argument("--doc", type=Path, default=REPO / "docs/default_pair.md",
                   help="where to write the recipe and results (markdown)")
    p.add_argument("--stdlib", type=Path, default=None,
                   help="stdlib directory to read (default: sysconfig.get_paths()['stdlib'])")
    p.add_argument("--seed", type=int, default=0, help="base random seed (model init, data order)")
    p.add_argument("--threads", type=int, default=2, help="torch / sentencepiece CPU threads")
    p.add_argument("--holdout-every", type=int, default=20,
                   help="hold out files whose sorted index is a multiple of this")
    p.add_argument("--max-chars", type=int, default=6_000_000,
                   help="cap on training characters (files are trimmed, largest first, to fit)")
    p.add_argument("--vocab-size", type=int, default=4000, help="SentencePiece vocabulary size")
    p.add_argument("--minutes-target", type=float, default=14.0,
                   help="time budget for target training (used to calibrate --target-steps)")
    p.add_argument("--minutes-draft", type=float, default=11.0,
                   help="time budget for draft distillation (used to calibrate --draft-steps)")
    p.add_argument("--target-steps", type=int, default=None,
                   help="fixed number of target steps (overrides --minutes-target; use for exact reruns)")
    p.add_argument("--draft-steps", type=int, default=None,
                   help="fixed number of draft steps (overrides --minutes-draft; use for exact reruns)")
    p.add_argument("--batch-target", type=int, default=4, help="target batch size (windows of 256 tokens)")
    p.add_argument("--batch-draft", type=int, default=4, help="draft batch size (windows of 256 tokens)")
    p.add_argument("--lr-target", type=float, default=2e-3, help="target peak learning rate")
    p.add_argument("--lr-draft", type=float, default=3e-3, help="draft peak learning rate")
    p.add_argument("--warmup", type=int, default=20, help="linear warmup steps (both models)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay on weight matrices")
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clipping")
    p.add_argument("--kd-alpha", type=float, default=0.9,
                   help="draft loss weight of KL to the target (the rest is cross-entropy on the data)")
    p.add_argument("--kd-temperature", type=float, default=1.0, help="distillation softmax temperature")
    p.add_argument("--eval-windows", type=int, default=256, help="held-out 256-token windows for the losses")
    p.add_argument("--num-prompts", type=int, default=32, help="number of held-out prompts to write and evaluate")
    p.add_argument("--k", type=int, default=5, help="draft tokens proposed per speculative step")
    p.add_argument("--new-tokens", type=int, default=64, help="new tokens per prompt in the acceptance test")
    p.add_argument("--log-every", type=int, default=20, help="log a progress line every this many steps")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import sentencepiece as spm
    import transformers

    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    t_start = time.time()
    ctx = 256
    command = "python " + " ".join(shlex.quote(x) for x in
                                   [os.path.relpath(__file__, REPO)] + (sys.argv[1:] if argv is None else argv))

    # data
    root = Path(args.stdlib or sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    texts = [read_source(p) for p in files]
    held_idx = [i for i in range(len(files)) if i % args.holdout_every == 0]
    train_idx = [i for i in range(len(files)) if i % args.holdout_every != 0]
    cap = per_file_cap([len(texts[i]) for i in train_idx], args.max_chars)
    train_texts = [truncate_at_line(texts[i], cap) for i in train_idx]
    held_texts = [texts[i] for i in held_idx]
    log(f"{len(files)} stdlib files under {root}: {len(train_idx)} train ({sum(map(len, train_texts)):,} chars "
        f"after per-file cap {cap:,}), {len(held_idx)} held out ({sum(map(len, held_texts)):,} chars)")

    # tokenizer
    t0 = time.time()
    sp_model = train_tokenizer(train_texts, args.vocab_size, args.threads)
    sp = spm.SentencePieceProcessor(model_proto=sp_model)
    newline_id = sp.piece_to_id("<0x0A>")
    train_stream = np.array([t for text in train_texts for t in sp.encode(text) + [EOS]], dtype=np.int32)
    held_stream = np.array([t for text in held_texts for t in sp.encode(text) + [EOS]], dtype=np.int32)
    time_tok = time.time() - t0
    log(f"tokenizer: vocab {sp.get_piece_size()}, train {len(train_stream):,} tokens, held-out "
        f"{len(held_stream):,} tokens ({time_tok:.1f} s)")

    prompts = extract_prompts(held_texts, args.num_prompts)
    write_prompts(args.prompts_out, prompts)
    prompts = read_prompts(args.prompts_out)
    log(f"wrote {len(prompts)} prompts to {args.prompts_out}")

    # target
    tcfg, dcfg = model_configs(sp.get_piece_size(), ctx)
    target = build_model(tcfg, args.seed)
    log(f"target: {n_params(target) / 1e6:.2f}M parameters")
    train_data = Windows(train_stream, newline_id, ctx, args.seed + 2)
    log(f"{len(train_data):,} training windows")
    tr_t = train_loop("target", target, train_data, batch=args.batch_target, lr=args.lr_target, warmup=args.warmup,
                      minutes=args.minutes_target, steps=args.target_steps, loss_fn=lm_loss,
                      log_every=args.log_every, weight_decay=args.weight_decay, clip=args.clip)

    # draft
    draft = build_model(dcfg, args.seed + 1)
    log(f"draft: {n_params(draft) / 1e6:.2f}M parameters")
    for p in target.parameters():
        p.requires_grad_(False)
    kd_data = Windows(train_stream, newline_id, ctx, args.seed + 3)
    tr_d = train_loop("draft", draft, kd_data, batch=args.batch_draft, lr=args.lr_draft, warmup=args.warmup,
                      minutes=args.minutes_draft, steps=args.draft_steps,
                      loss_fn=make_kd_loss(target, args.kd_alpha, args.kd_temperature),
                      log_every=args.log_every, weight_decay=args.weight_decay, clip=args.clip)

    # save (bfloat16), then evaluate what was saved
    from transformers import LlamaForCausalLM

    t_dir, d_dir = args.out / "target", args.out / "draft"
    save_checkpoint(target, t_dir, sp_model)
    save_checkpoint(draft, d_dir, sp_model)
    log(f"saved {t_dir} and {d_dir}")
    t0 = time.time()
    target = LlamaForCausalLM.from_pretrained(t_dir, dtype=torch.float32).eval()
    draft = LlamaForCausalLM.from_pretrained(d_dir, dtype=torch.float32).eval()
    tok_check = check_tokenizers(t_dir, sp, held_texts)
    log(f"tokenizer checks: {tok_check}")
    held_data = Windows(held_stream, newline_id, ctx, args.seed)
    heldout = heldout_eval(target, draft, held_data, args.eval_windows)
    log(f"held-out: {heldout}")
    prompt_ids = [[BOS] + sp.encode(p) for p in prompts]
    spec, samples = speculative_acceptance(target, draft, prompt_ids, args.k, args.new_tokens)
    time_eval = time.time() - t0
    log(f"speculative (k={args.k}, {args.new_tokens} new tokens): {spec}")

    files_info = []
    for path in sorted(args.out.rglob("*")) + [args.prompts_out]:
        if path.is_file():
            rel = os.path.relpath(path, REPO) if path.resolve().is_relative_to(REPO) else str(path)
            files_info.append({"path": rel, "bytes": path.stat().st_size, "sha256": sha256(path)})
    results = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "command": command, "stdlib": str(root), "n_files": len(files), "n_train": len(train_idx),
        "n_held": len(held_idx), "total_chars": sum(map(len, texts)), "held_chars": sum(map(len, held_texts)),
        "train_chars": sum(map(len, train_texts)), "file_cap": cap, "train_tokens": int(len(train_stream)),
        "held_tokens": int(len(held_stream)), "n_prompts": len(prompts),
        "spm_settings": dict(SPM_SETTINGS, vocab_size=args.vocab_size), "sentencepiece": spm.__version__,
        "transformers": transformers.__version__,
        "rope_theta": float((getattr(tcfg, "rope_parameters", None) or {}).get("rope_theta", getattr(tcfg, "rope_theta", 10000.0))),
        "target_config": tcfg.to_dict(), "draft_config": dcfg.to_dict(),
        "target_params": n_params(target), "draft_params": n_params(draft),
        "train_target": tr_t, "train_draft": tr_d, "heldout": heldout, "spec": spec, "tok_check": tok_check,
        "target_bytes": (t_dir / "model.safetensors").stat().st_size,
        "draft_bytes": (d_dir / "model.safetensors").stat().st_size,
        "time_tokenizer": time_tok, "time_eval": time_eval, "time_total": time.time() - t_start,
        "files": files_info,
        "samples": [prompts[i] + sp.decode(samples[i]) for i in range(min(3, len(prompts)))],
    }
    write_doc(args.doc, results)
    log(f"wrote {args.doc}")
    print(json.dumps({k: results[k] for k in ("heldout", "spec", "target_params", "draft_params", "target_bytes",
                                              "draft_bytes", "time_tokenizer", "time_eval", "time_total")},
                     indent=2))
    print(json.dumps({"train_target": tr_t, "train_draft": tr_d}, indent=2))
    return results


if __name__ == "__main__":
    main()
