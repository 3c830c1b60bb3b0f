"""Training drafts for a target: `python -m specdec.train {small,feature}` (docs/train.md).

- __main__.py: the command line (flags, one clear line per bad input, Ctrl-C and --resume).
- loop.py: the optimiser loop both recipes share (budgeted steps, tqdm bar, checkpoints, bf16 autocast on a GPU).
- small.py: the small distilled draft, the default pair's recipe (stdlib_corpus.py: data and tokenizer,
  llama_files.py: HF checkpoint directories, distill.py: the target's greedy pool and the distillation loss,
  report.py + default_pair_template.md: docs/default_pair.md).
- feature.py: the EAGLE-style feature draft (self_data.py: text the target writes itself).
- user_data.py: --data FILE.jsonl; evaluate.py: acceptance through specdec.LLM, its table and plot;
  records.py: what a run records about itself.
"""
