"""The feature draft (EAGLE-style, reduced vocabulary): `python -m specdec.train feature`, seeded.

1. data: the target writes its own questions and answers them greedily (self_data.py, --questions per round,
   --data-rounds seeded rounds, each cached with its features; a question asked twice is kept once), and/or the
   user's --data JSONL (prompts the target answers greedily, texts trained on as they are).
2. features: one target forward (our runtime's Transformer, float32) over every sequence gives the target's
   last-layer hidden state f_p and greedy next token y_p at every position p.
3. draft vocabulary (FR-Spec): the most frequent next tokens of the training split, as many as cover
   --vocab-coverage of them (the head is most of a one-layer draft's cost).
4. training (loop.py: AdamW, warmup, cosine, steps fitted to --minutes or fixed by --steps): the draft reads
   (token p, f_{p-1}) and is trained to give f_p (smooth L1, in units of f's standard deviation) and y_p
   (cross-entropy over the draft vocabulary), teacher-forced; then a second pass on its own first-pass outputs
   as features (--unroll 2), what it reads when it drafts past the verified tokens.
5. save (models/feature_draft.py format, with the target's fingerprint), then evaluate the saved draft with
   evaluate.py's `speculative_acceptance` (specdec.LLM, greedy, k = --eval-k) on held-out sequences and, with
   --specbench, on SpecBench questions (chat-templated, never trained on).
"""
from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.models import load_model
from specdec.models.feature_draft import FeatureDraft, layer_config, save_feature_draft

from . import self_data
from .evaluate import acceptance_plot, acceptance_table, speculative_acceptance
from .loop import TrainConfig, log, train_loop
from .records import command_line, environment
from .user_data import read_user_data

VAL_EVERY = 20  # every 20th sequence is held out of training (validation loss, held-out acceptance)
EVAL_BATCH = 8  # rows of the acceptance evaluation (greedy: each row's acceptance is its own)


@torch.no_grad()
def target_features(target, sequences: list[list[int]], batch: int = 8) -> dict:
    """Per sequence: the target's hidden states [n, E] and greedy next tokens [n] at every position."""
    feats, labels = [None] * len(sequences), [None] * len(sequences)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))  # similar lengths share a forward
    for start in range(0, len(order), batch):
        idx = order[start: start + batch]
        lengths = [len(sequences[i]) for i in idx]
        ids = torch.zeros(len(idx), max(lengths), dtype=torch.int64, device=target.device)  # [b, T], ragged
        for row, i in enumerate(idx):
            ids[row, : lengths[row]] = torch.tensor(sequences[i])
        cache = target.new_cache(len(idx), max(lengths))
        _, hidden = target.forward(ids, cache, num_new=lengths, logits="last", hidden="all")  # [b, T, E]
        for row, i in enumerate(idx):
            feats[i] = hidden[row, : lengths[row]].float().cpu()  # [n, E]
            labels[i] = target.head(hidden[row, : lengths[row]]).argmax(-1).cpu()  # [n]
        if start // batch % 25 == 0:
            log(f"features: {start + len(idx)}/{len(sequences)} sequences")
    return {"features": feats, "labels": labels}


def training_text(target, args) -> tuple[dict, dict, float, float]:
    """The self-written text of --data-rounds seeded rounds (round r: seed --seed + r; none when --questions is
    0), each with its features, both cached per round in --cache; a question an earlier round already asked is
    dropped. Then the user's --data: prompts answered greedily by the target, texts as they are (cut into
    --max-len token pieces). Returns the text ({"questions", "sequences", "prompt_lengths"}), the per-sequence
    {"features", "labels", "prompt_lengths"}, and the seconds the text and the features took when made."""
    text = {"questions": [], "sequences": [], "prompt_lengths": []}
    data = {"features": [], "labels": [], "prompt_lengths": text["prompt_lengths"]}
    seconds_text = seconds_features = 0.0

    def add(questions, part, feats):
        asked = set(text["questions"])
        for i, question in enumerate(questions):
            if question is None or question not in asked:
                text["questions"].append(question)
                text["sequences"].append(part["sequences"][i])
                text["prompt_lengths"].append(part["prompt_lengths"][i])
                data["features"].append(feats["features"][i])
                data["labels"].append(feats["labels"][i])

    for r in range(args.data_rounds if args.questions else 0):
        seed = args.seed + r
        cfg = self_data.SelfDataConfig(questions=args.questions, answer_tokens=args.answer_tokens, seed=seed)
        part = self_data.load_or_generate(args.target, cfg, args.cache / f"self_data_seed{seed}.pt", log)

        def timed_features():
            t0 = time.time()
            return target_features(target, part["sequences"]) | {"seconds": time.time() - t0}

        feats = self_data.keyed_cache(args.cache / f"features_seed{seed}.pt", part["key"], timed_features,
                                      "features", log)
        seconds_text += part["seconds"]
        seconds_features += feats.get("seconds", 0.0)
        add(part["questions"], part, feats)
    if args.data:
        t0 = time.time()
        part = user_sequences(args, read_user_data(args.data))
        seconds_text += time.time() - t0
        t0 = time.time()
        add(part["questions"], part, target_features(target, part["sequences"]))
        seconds_features += time.time() - t0
    text["questions"] = [q for q in text["questions"] if q is not None]
    return text, data, seconds_text, seconds_features


def user_sequences(args, user) -> dict:
    """The user's prompts, chat-templated and answered greedily by the target, then the user's texts (ids cut
    into --max-len pieces, trained on at every position). {"questions" (None for a text), "sequences",
    "prompt_lengths"}."""
    from specdec import LLM

    llm = LLM(str(args.target), method="ar", batch_size=self_data.SelfDataConfig.batch_size)
    part = {"questions": [], "sequences": [], "prompt_lengths": []}
    if user.prompts:
        answered = self_data.answer(llm, user.prompts, args.answer_tokens, log)
        part = {"questions": list(user.prompts), **answered}
    for ids in llm.encode(user.texts):
        for start in range(0, len(ids) - 1, args.max_len):
            piece = ids[start: start + args.max_len]
            if len(piece) >= 2:
                part["questions"].append(None)
                part["sequences"].append(piece)
                part["prompt_lengths"].append(1)
    log(f"--data: {len(user.prompts)} prompts answered, {len(user.texts)} texts "
        f"({len(part['sequences'])} sequences in all)")
    return part


def draft_vocabulary(labels: list[torch.Tensor], coverage: float, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The most frequent next tokens covering `coverage` of `labels` (sorted ids), and the coverage reached."""
    counts = torch.bincount(torch.cat(labels), minlength=vocab_size)  # [V]
    ranked = counts.argsort(descending=True)
    share = counts[ranked].cumsum(0).double() / counts.sum()  # [V]
    n = int((share < coverage).sum()) + 1
    n = min(vocab_size, math.ceil(n / 256) * 256)  # whole tiles
    return ranked[:n].sort().values, float(share[n - 1])


class SequenceBatches:
    """Seeded shuffled batches of training sequences, cut to --max-len: (ids [B, T], features [B, T, E],
    labels [B, T] (-100: padding or a token outside the draft vocabulary, mapped to draft-vocabulary indices))."""

    def __init__(self, sequences, data, train_ids, vocab_index, batch: int, max_len: int, seed: int):
        self.sequences, self.data, self.ids = sequences, data, list(train_ids)
        self.vocab_index, self.batch, self.max_len = vocab_index, batch, max_len
        self.rng = random.Random(seed)
        self.queue: list[int] = []

    def __call__(self):
        if len(self.queue) < self.batch:
            self.rng.shuffle(self.ids)
            self.queue += self.ids
        picks, self.queue = self.queue[: self.batch], self.queue[self.batch:]
        return collate(self.sequences, self.data, picks, self.vocab_index, self.max_len)

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate(), "ids": list(self.ids), "queue": list(self.queue)}

    def load_state_dict(self, state: dict) -> None:
        self.rng.setstate(state["rng"])
        self.ids, self.queue = list(state["ids"]), list(state["queue"])


def collate(sequences, data, picks, vocab_index, max_len):
    """Padded tensors of the sequences `picks` (with data's features, labels and prompt lengths); next-token
    labels only where the target answers (from the last prompt token on): what a draft is asked to predict
    when it decodes."""
    T = min(max_len, max(len(sequences[i]) for i in picks))
    E = data["features"][picks[0]].shape[1]
    ids = torch.zeros(len(picks), T, dtype=torch.int64)  # [B, T]
    f = torch.zeros(len(picks), T, E)  # [B, T, E]
    y = torch.full((len(picks), T), -100, dtype=torch.int64)  # [B, T]
    valid = torch.zeros(len(picks), T, dtype=torch.bool)  # [B, T] positions that exist
    for row, i in enumerate(picks):
        n = min(T, len(sequences[i]))
        ids[row, :n] = torch.tensor(sequences[i][:n])
        f[row, :n] = data["features"][i][:n]
        y[row, :n] = vocab_index[data["labels"][i][:n]]
        y[row, : max(0, data["prompt_lengths"][i] - 1)] = -100
        valid[row, :n] = True
    return ids, f, y, valid


def train_forward(draft: FeatureDraft, ids, features_before):
    """The draft's outputs h [B, T, E] for tokens ids [B, T] read with features_before [B, T, E], causal
    attention over the sequence (no cache: the training form of `FeatureDraft.forward`)."""
    B, T = ids.shape
    positions = torch.arange(T, device=ids.device)[None].expand(B, T)  # [B, T]
    tables = draft.rope_heads(positions)  # cos, sin [B, T, H + 2 H_kv, D], perm [D]
    h = draft.embed(ids, features_before)  # [B, T, E]
    for layer in draft.layers:
        attn = layer.self_attn
        q, k, v = attn.qkv(layer.input_layernorm(h), *tables)  # [B, H, T, D], [B, H_kv, T, D] x 2
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        o = attn.o_proj(o.transpose(1, 2).reshape(B, T, -1))  # [B, T, E]
        h = h + (o if attn.sandwich is None else attn.sandwich(o))  # GLM-4 norms the output first
        h = layer.mlp(layer.post_attention_layernorm(h), h)  # residual + MLP
    return h


def shift_right(f):
    """Features before each position: f_{p-1}, zeros before position 0. [B, T, E] -> [B, T, E]."""
    return F.pad(f[:, :-1], (0, 0, 1, 0))


def make_loss(scale: float, unroll: int, noise: float, reg_weight: float, stats: dict):
    """Cross-entropy on the target's next token + reg_weight * smooth L1 to the target's features (in units of
    `scale`), teacher-forced; passes 2.. read the previous pass's outputs as features."""

    def loss_fn(draft, batch):
        ids, f, y, mask = (t.to(draft.device) for t in batch)
        before = shift_right(f)
        total = 0.0
        for step in range(unroll):
            if noise and draft.training:
                before = before + noise * scale * torch.randn_like(before)
            h = train_forward(draft, ids, before)  # [B, T, E]
            logits = F.linear(draft.norm(h), draft.lm_head.weight)  # [B, T, V']
            ce = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=-100)
            reg = F.smooth_l1_loss(h[mask].float() / scale, f[mask] / scale)
            total = total + (ce + reg_weight * reg) / (1 + step)
            with torch.no_grad():
                hit = (logits.argmax(-1) == y)[y != -100].float().mean().item()
                stats.setdefault(f"top1_pass{step + 1}", []).append(hit)
            before = shift_right(h)
        return total

    return loss_fn


@torch.no_grad()
def validation(draft, sequences, data, val_ids, vocab_index, scale, unroll) -> dict:
    """Mean loss and top-1 agreement with the target's next token per pass on the held-out sequences."""
    draft.eval()
    stats: dict = {}
    loss_fn = make_loss(scale, unroll, 0.0, 1.0, stats)
    losses = []
    for j in range(0, len(val_ids), 8):
        batch = collate(sequences, data, val_ids[j: j + 8], vocab_index, 10**9)
        losses.append(loss_fn(draft, batch).item())
    return {"loss": sum(losses) / len(losses), **{k: sum(v) / len(v) for k, v in stats.items()}}


def init_draft(target, vocab: torch.Tensor, layers: int) -> FeatureDraft:
    """fc reads [e, f] as e + f; the layers start as copies of the target's last ones."""
    draft = FeatureDraft(layer_config(target.cfg, layers), target, vocab)
    E = target.cfg.hidden_size
    with torch.no_grad():
        draft.fc.weight.copy_(torch.cat([torch.eye(E), torch.eye(E)], dim=1))  # [E, 2E]
        draft.fc.bias.zero_()
        for mine, theirs in zip(draft.layers, target.layers[-layers:]):
            mine.load_state_dict(theirs.state_dict())
    draft.requires_grad_(True)
    draft.lm_head.weight.requires_grad_(False)
    return draft


def shared_ngrams(texts: list[str], held_out: list[str], n: int = 8) -> int:
    """How many of `texts` share a run of n words with any held-out text (the held-out check of the data)."""
    def grams(t):
        w = t.lower().split()
        return {tuple(w[i: i + n]) for i in range(len(w) - n + 1)}

    held = set().union(*(grams(t) for t in held_out))
    return sum(bool(grams(t) & held) for t in texts)


def specbench_chat_ids(llm_tokenizer, path: Path, count: int) -> list[list[int]]:
    from specdec.prompts import read_prompts

    prompts = read_prompts(str(path))[:count]
    return [llm_tokenizer.encode(llm_tokenizer.apply_chat_template([{"role": "user", "content": p}])) for p in prompts]




def run(args, argv=None) -> dict:
    """The whole recipe for the parsed `args` of `python -m specdec.train feature` (__main__.py); the results."""
    t_start, times = time.time(), {}
    target = load_model(args.target, dtype="float32", device=args.device)
    data_text, data, times["self_data"], times["features"] = training_text(target, args)
    sequences = data_text["sequences"]
    val_ids = list(range(0, len(sequences), VAL_EVERY))
    train_ids = [i for i in range(len(sequences)) if i % VAL_EVERY]
    if not train_ids:
        raise SystemExit(f"{len(sequences)} training sequence(s): need at least 2 (one is held out); give more "
                         f"--questions or more --data")
    answers = [data["labels"][i][data["prompt_lengths"][i] - 1:] for i in train_ids]  # the next tokens it answers
    vocab, coverage = (draft_vocabulary(answers, args.vocab_coverage, target.vocab_size) if args.vocab_coverage < 1
                       else (torch.arange(target.vocab_size), 1.0))
    vocab_index = torch.full((target.vocab_size,), -100, dtype=torch.int64)
    vocab_index[vocab] = torch.arange(len(vocab))
    scale = float(torch.cat([data["features"][i] for i in train_ids[:200]]).std())
    n_train_tokens = sum(len(sequences[i]) for i in train_ids)
    log(f"data: {len(train_ids)} train / {len(val_ids)} held-out sequences, {n_train_tokens:,} train tokens; "
        f"draft vocabulary {len(vocab)} ids covering {coverage:.4f}; feature std {scale:.3f}")

    torch.manual_seed(args.seed)
    draft = init_draft(target, vocab.to(target.device), args.layers)
    stats: dict = {}
    extra = {"curve": []}
    if not args.resume:
        extra["curve"].append({"step": 0, **validation(draft, sequences, data, val_ids, vocab_index, scale,
                                                        args.unroll)})
        log(f"validation before training: {extra['curve'][0]}")
    loss_fn = make_loss(scale, args.unroll, args.noise, 1.0, stats)
    batches = SequenceBatches(sequences, data, train_ids, vocab_index, args.batch, args.max_len, args.seed)

    def after_step(step, total):  # the training curve: validation at each eighth of the run
        if total is not None and (step % max(1, total // 8) == 0 or step == total):
            extra["curve"].append({"step": step, **validation(draft, sequences, data, val_ids, vocab_index, scale,
                                                               args.unroll)})

    tc = TrainConfig(args.batch, args.lr, warmup=30, weight_decay=0.0, clip=1.0, minutes=args.minutes,
                     steps=args.steps, log_every=25, device=args.device, checkpoint=args.checkpoint,
                     checkpoint_every=args.checkpoint_every, resume=args.resume, progress=not args.no_progress)
    trained = train_loop("feature draft", draft, batches, loss_fn, tc, after_step, extra,
                         top1=lambda: stats["top1_pass1"][-1] if stats.get("top1_pass1") else None)
    times["train"] = trained["seconds"]
    log(f"validation: {extra['curve'][-1]}")
    draft.requires_grad_(False)
    command = command_line(argv)
    save_feature_draft(draft, args.out, target, meta={"target_name": args.target_name or Path(args.target).name,
                                                      "trained_by": command})
    log(f"saved {args.out} ({sum(f.stat().st_size for f in args.out.iterdir()) / 1e6:.1f} MB)")
    del target, draft

    t0 = time.time()
    evaluation, overlap = {}, None
    held = [sequences[i][: max(1, data_text["prompt_lengths"][i])] for i in val_ids][: args.eval_prompts]
    if args.eval_prompts:
        evaluation["held-out"] = speculative_acceptance(args.target, args.out, held, args.eval_k,
                                                        args.eval_tokens, EVAL_BATCH)[0]
    if args.specbench and args.eval_prompts:
        from specdec.models import load_tokenizer
        from specdec.prompts import read_prompts

        overlap = shared_ngrams(data_text["questions"], read_prompts(str(args.specbench)))
        log(f"held-out check: {overlap} of {len(data_text['questions'])} training questions share 8 words in a row "
            f"with a SpecBench question")
        bench_ids = specbench_chat_ids(load_tokenizer(args.target), args.specbench, args.eval_prompts)
        evaluation["specbench"] = speculative_acceptance(args.target, args.out, bench_ids, args.eval_k,
                                                         args.eval_tokens, EVAL_BATCH)[0]
    times["eval"] = time.time() - t0
    times["total"] = time.time() - t_start
    results = {"command": command, "args": {k: str(v) for k, v in vars(args).items()}, "env": environment(),
               "date": time.strftime("%Y-%m-%d", time.gmtime()), "times": times,
               "data": {"questions": len(data_text["questions"]), "sequences": len(sequences),
                        "train_sequences": len(train_ids), "held_out_sequences": len(val_ids),
                        "train_tokens": n_train_tokens, "draft_vocab": len(vocab), "vocab_coverage": coverage,
                        "sample_questions": data_text["questions"][:5],
                        "questions_sharing_8_words_with_specbench": overlap},
               "train": trained, "curve": extra["curve"],
               "train_top1_last": {k: v[-50:] and sum(v[-50:]) / len(v[-50:]) for k, v in stats.items()},
               "evaluation": evaluation, "draft_bytes": sum(f.stat().st_size for f in args.out.iterdir())}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=2) + "\n")
    if evaluation:
        print(acceptance_table(evaluation), flush=True)
        log(acceptance_plot(evaluation, args.plot, extra["curve"]))
    log(f"wrote {args.results}; total {times['total'] / 60:.1f} min")
    return results
