"""Trainer of specdec's default target/draft pair (specdec/assets/default_pair/), CPU-only and reproducible.

1. data.py: the Python standard library's own *.py files, a fixed sorted list; every 20th file is held out
   (losses, prompts). A SentencePiece BPE tokenizer (Llama-style ids, byte fallback, exact round-trip of code).
2. train.py, target: a LlamaForCausalLM trained with AdamW + cosine on BOS-prefixed windows.
3. train.py, greedy pool: the trained target's greedy continuations of real prefixes, with its top-k next-token
   probabilities at every position: exactly what greedy speculative decoding asks the draft to predict.
4. train.py, draft: a much shallower LlamaForCausalLM trained on the pool only (cross-entropy against the
   target's top-k distribution and against its argmax), so distillation needs no target forward.
5. evaluate.py: held-out losses of the saved bfloat16 pair, teacher-forced agreement, and greedy speculative
   decoding at batch 1 in specdec's runtime (`specdec.LLM`, eqspec: acceptance at k = 5, overall and by draft
   position, tokens per target call) on the held-out prompts and, with --specbench, on SpecBench prompts.
6. checkpoint.py saves both as ordinary HF directories (bfloat16 safetensors, config, tokenizer files);
   report.py writes docs/default_pair.md from template.md with every number of the run, which is also kept as
   results.json (`--report-only` renders the doc again from it).

speed.py (`python -m bench.default_pair.speed`) measures the shipped pair in specdec's own runtime: forward
times of target and draft at batch 1, AR vs a speculative method end to end (docs/benchmarks.md).

Step and sequence counts are fitted to the --minutes-* budgets on the machine that runs it (the machine may be
shared), unless given with --target-steps / --pool-seqs / --draft-steps: then a run is deterministic given
--seed, up to floating-point nondeterminism of multi-threaded CPU kernels.

The shipped pair (from the repository root; 73 minutes on two shared
CPU cores: budgets of 55 + 8 + 12 minutes for target, pool and draft, plus tokenizer and evaluation):

    python -m bench.default_pair --specbench /path/to/spec_bench/question.jsonl

Draft-only retrain (keeps the saved target and its tokenizer, writes only draft/, the doc and the results, which
then list both runs; the target's record is read from --target-results and checked by sha256):

    python -m bench.default_pair --reuse-target specdec/assets/default_pair/target --draft-arch ... \\
        [--draft-init target] [--pool-cache /tmp/pool.npz] --specbench /path/to/spec_bench/question.jsonl

Smoke test (about a minute, writes only under /tmp):

    python -m bench.default_pair --out /tmp/dp/pair --prompts-out /tmp/dp/prompts.txt --doc /tmp/dp/doc.md \\
        --results /tmp/dp/results.json --max-chars 300000 --target-steps 4 --pool-seqs 8 --pool-batch 4 \\
        --pool-new-tokens 16 --draft-steps 4 --eval-windows 8 --num-prompts 4 --new-tokens 16
"""
