"""Evaluation of the saved pair (float32 compute): held-out losses and teacher-forced agreement (transformers),
and greedy speculative decoding at batch 1 in specdec's runtime (acceptance, tokens per target call)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

EVAL_BATCH = 8
NEAR_TIE = 0.02  # target top-2 probability margin below which a position counts as a near-tie


@torch.no_grad()
def heldout_eval(target, draft, windows: list[np.ndarray]) -> dict:
    """Mean next-token cross-entropy (nats/token) of both models and their top-1 agreement on `windows`."""
    loss = {"target": 0.0, "draft": 0.0}
    agree = count = 0
    for i in range(0, len(windows), EVAL_BATCH):
        x = torch.from_numpy(np.stack(windows[i: i + EVAL_BATCH]))  # [b, T]
        labels = x[:, 1:].reshape(-1)  # [b*(T-1)]
        lt = target(input_ids=x).logits[:, :-1].float().flatten(0, 1)  # [b*(T-1), V]
        ld = draft(input_ids=x).logits[:, :-1].float().flatten(0, 1)  # [b*(T-1), V]
        loss["target"] += F.cross_entropy(lt, labels, reduction="sum").item()
        loss["draft"] += F.cross_entropy(ld, labels, reduction="sum").item()
        agree += (lt.argmax(-1) == ld.argmax(-1)).sum().item()
        count += labels.numel()
    return {"target_loss": loss["target"] / count, "draft_loss": loss["draft"] / count,
            "top1_agreement": agree / count, "tokens": count, "windows": len(windows)}


def speculative_acceptance(target_dir, draft_dir, prompt_ids: list[list[int]], k: int, new_tokens: int,
                           batch_size: int = 1):
    """Greedy speculative decoding (eqspec, fixed k, EOS ignored, float32) of every prompt in specdec's
    runtime, `batch_size` rows at a time (a row's acceptance does not depend on the others), against its AR
    decoding: acceptance overall and by draft position (from each request's `accepted_counts`), tokens per
    verification (target) step, and how many outputs equal AR's. Prompts longer than the context leaves are cut
    to their first tokens. Returns (stats, the prompts as run, the target's greedy outputs)."""
    from specdec import LLM, SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    spec = LLM(str(target_dir), str(draft_dir), method="eqspec", num_speculative_tokens=k, batch_size=batch_size,
               dtype="float32")
    ar = LLM(spec.target, method="ar", batch_size=batch_size, dtype="float32", tokenizer=spec.tokenizer)
    limit = spec.max_context - new_tokens - k - 1
    ids = [p[:limit] for p in prompt_ids]
    greedy = [o.token_ids for o in ar.generate(prompt_token_ids=ids, sampling_params=params)]
    outs = spec.generate(prompt_token_ids=ids, sampling_params=params)
    counts = [n for o in outs for n in o.accepted_counts]  # accepted drafts per verification step
    ks = [s for o in outs for s in o.speculative_tokens if s > 0]  # drafts proposed per step
    accepted, proposed = sum(counts), sum(ks)
    stats = {"acceptance": accepted / proposed, "accepted": accepted, "proposed": proposed,
             "acceptance_by_position": [sum(n > i for n in counts) / max(1, sum(s > i for s in ks)) for i in range(k)],
             "target_calls": len(counts), "tokens_per_target_call": (accepted + len(counts)) / len(counts),
             "matches_greedy": sum(o.token_ids == g for o, g in zip(outs, greedy)), "prompts": len(ids),
             "prompts_cut": sum(len(p) > limit for p in prompt_ids), "k": k, "new_tokens": new_tokens}
    return stats, ids, greedy


@torch.no_grad()
def agreement_on_greedy(target, draft, prompt_ids: list[list[int]], outputs: list[list[int]]) -> dict:
    """Teacher-forced top-1 agreement on the target's own greedy continuations, split by whether the target's
    top-2 probabilities are within NEAR_TIE of each other (near-ties are close to coin flips)."""
    margins, agree = [], []
    for ids, out in zip(prompt_ids, outputs):
        x = torch.tensor([ids + out])  # [1, P + N]
        pt = target(input_ids=x).logits[0, len(ids) - 1: -1].float().softmax(-1)  # [N, V]
        pd = draft(input_ids=x).logits[0, len(ids) - 1: -1]  # [N, V]
        top2 = pt.topk(2, -1).values  # [N, 2]
        margins.append(top2[:, 0] - top2[:, 1])
        agree.append((pd.argmax(-1) == pt.argmax(-1)).float())
    m, a = torch.cat(margins), torch.cat(agree)
    near = m < NEAR_TIE
    return {"agreement": a.mean().item(), "near_tie_fraction": near.float().mean().item(),
            "agreement_near_ties": a[near].mean().item() if near.any() else float("nan"),
            "agreement_elsewhere": a[~near].mean().item() if (~near).any() else float("nan")}


def acceptance_table(evaluation: dict) -> str:
    """The acceptance by draft position of each evaluation (name -> `speculative_acceptance` stats), as text."""
    k = max(len(ev["acceptance_by_position"]) for ev in evaluation.values())
    width = max(len(name) for name in evaluation)
    head = f"{'prompts':<{width}}  n   " + " ".join(f"pos {i + 1:>2}" for i in range(k)) + "  overall  tok/call  == AR"
    rows = [head, "-" * len(head)]
    for name, ev in evaluation.items():
        by = " ".join(f"{a:>6.3f}" for a in ev["acceptance_by_position"])
        rows.append(f"{name:<{width}} {ev['prompts']:>3}   {by}  {ev['acceptance']:>7.3f}  "
                    f"{ev['tokens_per_target_call']:>8.2f}  {ev['matches_greedy']}/{ev['prompts']}")
    return "\n".join(rows)


def acceptance_plot(evaluation: dict, path, curve: list[dict] | None = None) -> str:
    """Acceptance by draft position of each evaluation (and, given a training curve of {"step", "top1..."}
    points, the curve beside it) as a PNG at `path`; a line saying why when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return f"plot skipped: matplotlib is not installed (pip install matplotlib) - {path} not written"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if curve else 1
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 3.8), squeeze=False)
    if curve:
        left = axes[0][0]
        steps = [c["step"] for c in curve]
        for key in sorted(k for k in curve[0] if k.startswith("top1")):
            left.plot(steps, [c[key] for c in curve], marker="o", label=key.replace("_", " "))
        left.set(xlabel="training step", ylabel="held-out top-1 = target's next token", title="training curve")
        left.grid(alpha=0.3)
        left.legend()
    right = axes[0][-1]
    for name, ev in evaluation.items():
        by = ev["acceptance_by_position"]
        right.plot(range(1, len(by) + 1), by, marker="o", label=f"{name} (overall {ev['acceptance']:.2f})")
    k = max(len(ev["acceptance_by_position"]) for ev in evaluation.values())
    right.set(xlabel="draft position", ylabel="share of steps accepting it", ylim=(0, 1),
              title=f"greedy acceptance by position, k = {k}")
    right.grid(alpha=0.3)
    right.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return f"wrote {path}"
