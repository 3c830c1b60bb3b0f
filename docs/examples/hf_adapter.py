"""Wire a model we did not write into specdec: a `transformers` causal LM behind a thin adapter.

The runtime needs only the model protocol of docs/api.md: `vocab_size`, `new_cache(batch, capacity,
layout)` and `forward(input_ids, cache, num_new=None, logits="all")`. This adapter keeps no K/V at all:
it stores each row's token ids in a one-layer, one-head, one-dim `KVCache`, so the runtime's machinery
(scatter at per-row columns, realignment, compaction, continuous-batching refills) moves the tokens like
any K/V, and every forward re-runs the HF model over each row's whole sequence. Slow, but exactly the
HF model's computation, and a check of the protocol: speculative output must equal AR output.

Run: python docs/examples/hf_adapter.py
"""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec import LLM, SamplingParams
from specdec.kernels.kv_append import kv_append
from specdec.models import KVCache


class TransformersAdapter:
    def __init__(self, hf_model):
        self.hf = hf_model.eval()
        self.vocab_size = hf_model.config.vocab_size
        self.max_position_embeddings = hf_model.config.max_position_embeddings
        self.dtype = next(hf_model.parameters()).dtype

    def new_cache(self, batch_size: int, capacity: int, layout: str = "ragged") -> KVCache:
        # one "layer" whose K holds token ids: [1, B, 1, C, 1]
        return KVCache.allocate(1, batch_size, 1, capacity, 1, torch.float64, torch.device("cpu"), layout)

    @torch.no_grad()
    def forward(self, input_ids, cache: KVCache, num_new=None, logits: str = "all"):
        B, T = input_ids.shape
        plan = cache.plan(T, num_new)  # positions [B, T], columns [B, T], mask [B, T, W]
        ids = input_ids.to(torch.float64)[:, :, None, None].expand(B, T, 2, 1)  # [B, T, 2 H_kv, D]: K and V
        kv_append(cache.kv[0], ids, plan.columns)  # layer 0's [2, B, 1, C, 1]
        out = torch.zeros(B, T, self.vocab_size, dtype=self.dtype)  # [B, T, V]; padding stays 0
        for i in range(B):
            start, real = int(cache.start[i]), int(cache.length[i] + plan.num_new[i])
            tokens = cache.k[0, i, 0, start: start + real, 0].long()[None]  # [1, n] the row's sequence
            row_logits = self.hf(tokens).logits[0]  # [n, V]
            for j in range(T):
                index = int(plan.positions[i, j])
                is_real = (j >= T - int(plan.num_new[i])) if cache.left_padded else (j < int(plan.num_new[i]))
                if is_real:
                    out[i, j] = row_logits[index]
        if logits == "last":
            last = torch.full_like(plan.num_new, T - 1) if cache.left_padded else plan.num_new - 1
            out = out[torch.arange(B), last][:, None]  # [B, 1, V]
        cache.advance(plan)
        return out


def tiny_llama(seed: int, perturb: float = 0.0) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float64)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.15 * torch.randn(p.shape, generator=g, dtype=torch.float64) + (1.0 if p.dim() == 1 else 0.0))
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(perturb * p.std() * torch.randn(p.shape, generator=g, dtype=torch.float64))
    return model


def main() -> dict:
    target = TransformersAdapter(tiny_llama(0))
    draft = TransformersAdapter(tiny_llama(0, perturb=0.02))
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17], [18]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    reference = LLM(target, method="ar", batch_size=1).generate(prompt_token_ids=prompts, sampling_params=params)
    results = {}
    for method in ("eqspec", "ragged"):
        outs = LLM(target, draft, method=method, num_speculative_tokens=3, batch_size=3).generate(
            prompt_token_ids=prompts, sampling_params=params)
        same = all(o.token_ids == r.token_ids for o, r in zip(outs, reference))
        results[method] = (same, outs.metrics.acceptance_rate)
        print(f"{method}: identical to AR: {same}; acceptance {outs.metrics.acceptance_rate:.2f}")
    return results


if __name__ == "__main__":
    main()
