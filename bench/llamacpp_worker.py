"""llama.cpp (llama-cpp-python) as a worker process for the benchmarks: its OpenMP runtime and torch's crash
in one process (a segfault in `llama_decode`, seen here), so it runs apart, without torch.

    python -m bench.llamacpp_worker FILE.gguf --threads 2 --context 1024 [--lookup 10]

Reads one JSON request per stdin line, {"prompts": [[ids]], "max_tokens": N}, and answers one JSON line:
{"wall", "prefill", "decode", "tokens"}: greedy (temperature 0), the sequences one at a time; prefill is
the time to each first token, decode the rest. Prints {"ready": true} once the file is loaded.
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("gguf", help="the GGUF file")
    p.add_argument("--threads", type=int, default=2, help="n_threads and n_threads_batch")
    p.add_argument("--context", type=int, default=2048, help="n_ctx")
    p.add_argument("--lookup", type=int, default=0, help="prompt-lookup decoding with this many drafted tokens "
                   "(LlamaPromptLookupDecoding; 0 = plain decoding)")
    args = p.parse_args(argv)
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=args.lookup) if args.lookup else None
    llm = llama_cpp.Llama(model_path=args.gguf, n_threads=args.threads, n_threads_batch=args.threads,
                          n_ctx=args.context, n_batch=512, verbose=False, draft_model=draft,
                          logits_all=draft is not None)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        prefill = decode = 0.0
        outs = []
        t0 = time.perf_counter()
        for ids in request["prompts"]:
            llm.reset()
            start, first, tokens = time.perf_counter(), None, []
            for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
                if first is None:
                    first = time.perf_counter()
                tokens.append(int(tok))
                if len(tokens) == request["max_tokens"]:
                    break
            prefill += first - start
            decode += time.perf_counter() - first
            outs.append(tokens)
        print(json.dumps({"wall": time.perf_counter() - t0, "prefill": prefill, "decode": decode, "tokens": outs}),
              flush=True)


if __name__ == "__main__":
    main()
