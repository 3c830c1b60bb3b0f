"""Evaluation of the saved pair (transformers, float32 compute): held-out losses, teacher-forced agreement,
and greedy speculative decoding simulated at batch 1 (acceptance, tokens per target call)."""
from __future__ import annotations

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


def _feed(model, cache, seq: list[int]) -> torch.Tensor:
    """Run `model` on the tokens of `seq` that `cache` has not seen yet; their logits [n, V]."""
    seen = cache.get_seq_length()
    return model(input_ids=torch.tensor([seq[seen:]]), cache=cache, use_cache=True).logits[0]


@torch.no_grad()
def greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    """Plain greedy decoding with a KV cache (EOS not special)."""
    from transformers import DynamicCache

    cache, seq = DynamicCache(), list(ids)
    while len(seq) < len(ids) + new_tokens:
        seq.append(int(_feed(model, cache, seq)[-1].argmax()))
    return seq[len(ids):]


@torch.no_grad()
def speculative_acceptance(target, draft, prompt_ids: list[list[int]], k: int, new_tokens: int):
    """Greedy speculative decoding per prompt (batch 1, KV caches, EOS ignored): the draft proposes k tokens
    greedily, one target forward scores them, the longest prefix equal to the target's own greedy choices is
    accepted and the target's next token appended. Returns (stats, generated token lists); the output is
    checked against plain greedy decoding of the target."""
    from transformers import DynamicCache

    proposed = accepted = calls = exact = 0
    outputs = []
    for ids in prompt_ids:
        seq = list(ids)
        t_cache, d_cache = DynamicCache(), DynamicCache()
        while len(seq) < len(ids) + new_tokens:
            guess = []
            for _ in range(k):
                guess.append(int(_feed(draft, d_cache, seq + guess)[-1].argmax()))
            fed = len(seq) + k - t_cache.get_seq_length()
            choice = _feed(target, t_cache, seq + guess)[fed - k - 1:].argmax(-1).tolist()  # after seq[-1], g1..gk
            n = 0
            while n < k and guess[n] == choice[n]:
                n += 1
            proposed, accepted, calls = proposed + k, accepted + n, calls + 1
            seq += guess[:n] + [choice[n]]
            for cache in (t_cache, d_cache):  # keep entries for accepted tokens only (all but the newest)
                extra = cache.get_seq_length() - (len(seq) - 1)
                if extra > 0:
                    cache.crop(-extra)  # transformers 5: a negative count drops that many newest entries
        out = seq[len(ids): len(ids) + new_tokens]
        exact += out == greedy(target, ids, new_tokens)
        outputs.append(out)
    stats = {"acceptance": accepted / proposed, "accepted": accepted, "proposed": proposed, "target_calls": calls,
             "tokens_per_target_call": (accepted + calls) / calls, "matches_greedy": exact,
             "prompts": len(prompt_ids), "k": k, "new_tokens": new_tokens}
    return stats, outputs


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
