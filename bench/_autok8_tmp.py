"""Instrumented auto k at batch 8 on the real model: per step B, k, offers, measured vs predicted, scales."""
import sys, time, json, statistics, torch
torch.set_num_threads(2)
from specdec import LLM, SamplingParams
from specdec import autok
from specdec.models import load_model, load_tokenizer
from bench.quantized import chat_prompts
path = ".cache/real_model/SmolLM2-135M-Instruct.Q4_1.gguf"
quant = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "f32" else None
method = sys.argv[2] if len(sys.argv) > 2 else "eqspec"
B = int(sys.argv[3]) if len(sys.argv) > 3 else 8
tok = load_tokenizer(path)
target = load_model(path, quantize=quant)
prompts = chat_prompts("/work/shared/data/spec_bench/question.jsonl", tok, 16)
params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
common = dict(target=target, tokenizer=tok, batch_size=B, device="cpu", cost_cache="", packed_weights=quant is None)
log = []
orig_choose, orig_observe = autok.KChooser.choose, autok.KChooser.observe
def choose(self, batch, offers=None):
    k = orig_choose(self, batch, offers)
    alphas = [self.alpha(r) for r in batch.requests]
    log.append(dict(B=len(batch), k=k, offers=offers, rates=[round(x, 1) for x in self.rates(alphas, len(batch), offers=offers)[:4]],
                    scale={f"{b}{'s' if s else 'z'}": round(v, 2) for (b, s), v in self.scale.items()},
                    alpha=round(statistics.mean(alphas), 2)))
    return k
def observe(self, seconds):
    p = orig_observe(self, seconds)
    log[-1]["ms"] = round(seconds * 1e3, 1); log[-1]["pred_ms"] = round(p * 1e3, 1)
    return p
autok.KChooser.choose, autok.KChooser.observe = choose, observe
ar = LLM(method="ar", **common)
sx = LLM(draft="suffix", method=method, **common)
warm = prompts[:B]
for llm in (ar, sx):
    llm.generate(prompt_token_ids=warm, sampling_params=SamplingParams(max_tokens=8, ignore_eos=True))
res = {}
for rnd in range(2):
    for name, llm in (("ar", ar), ("suffix", sx)):
        if name == "suffix":
            log.clear()
            if llm.suffix_store is not None: llm.suffix_store.clear()
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - t0
        m = llm.last_metrics if hasattr(llm, "last_metrics") else None
        ntok = sum(len(o.token_ids) for o in outs)
        res.setdefault(name, []).append(ntok / wall)
        print(name, "round", rnd, "tok/s %.1f" % (ntok / wall), flush=True)
print({k: [round(x, 1) for x in v] for k, v in res.items()})
ks = [e["k"] for e in log]
print("k hist", {k: ks.count(k) for k in sorted(set(ks))})
for e in log[::6]: print(json.dumps(e))
