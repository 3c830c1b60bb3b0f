"""The small draft (the default pair's recipe), phase by phase: data and tokenizer, target (trained here with
--train-target, else the saved one at --target), the target's greedy pool, the distilled draft, save, evaluate the
saved pair, results (and, with --doc, docs/default_pair.md). See __main__.py for the flags."""
from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import numpy as np
import torch

from specdec.prompts import read_prompts

from . import distill, evaluate, llama_files, report, stdlib_corpus
from .loop import TrainConfig, log, train_loop
from .records import command_line, environment
from .user_data import read_user_data

REPO = Path(__file__).resolve().parents[2]


def target_record(results_path: Path, target_dir: Path) -> dict:
    """The results of the run that trained the target saved in `target_dir` (checked by the weights' sha256)."""
    record = json.loads(results_path.read_text(encoding="utf-8"))
    sha = report.sha256(target_dir / "model.safetensors")
    if not any(f["path"].endswith("target/model.safetensors") and f["sha256"] == sha for f in record["files"]):
        raise SystemExit(f"--target-results {results_path}: no run there saved {target_dir / 'model.safetensors'} "
                         f"(sha256 {sha[:16]}...)")
    return record


def target_runs(record: dict) -> list[dict]:
    """The run(s) that trained the target, from its record (older records have no `runs` list)."""
    runs = record.get("runs") or [{"kind": "full", "command": record["command"], "times": record["times"]}]
    return [r for r in runs if r["kind"] == "full"]


def pool_key(args, target_dir: Path) -> dict:
    """Everything a saved pool depends on: the target's weights, the data and the pool settings."""
    key = {"target_sha256": report.sha256(target_dir / "model.safetensors"), "seed": args.seed,
           "stdlib": str(Path(args.stdlib).resolve()) if not args.data else [str(d) for d in args.data],
           "holdout_every": args.holdout_every, "max_chars": args.max_chars, "ctx": args.ctx}
    key |= {name: getattr(args, name) for name in ("pool_seqs", "pool_batch", "pool_new_tokens", "pool_prefix_min",
                                                  "pool_prefix_max", "pool_top_k")}
    if args.pool_seqs is None:
        key["minutes_pool"] = args.minutes_pool
    return key


def greedy_pool(args, target, windows, target_dir: Path) -> tuple[distill.Pool, bool]:
    """Generate the pool, or load it from --pool-cache when that file was made with the same key; the pool and
    whether it was loaded."""
    key = pool_key(args, target_dir) if args.pool_cache else None
    if key and args.pool_cache.is_file():
        pool = distill.load_pool(args.pool_cache, key)
        if pool is not None:
            log(f"pool: loaded {len(pool)} sequences from {args.pool_cache} (generated in {pool.seconds:.0f} s)")
            return pool, True
        log(f"pool: {args.pool_cache} was made with other settings; generating a new one")
    pool = distill.generate_pool(
        target, windows, seqs=args.pool_seqs, minutes=args.minutes_pool, batch=args.pool_batch,
        new_tokens=args.pool_new_tokens, prefix_range=(args.pool_prefix_min, args.pool_prefix_max),
        top_k=args.pool_top_k, seed=args.seed + 3)
    if key:
        args.pool_cache.parent.mkdir(parents=True, exist_ok=True)
        distill.save_pool(pool, args.pool_cache, key)
    return pool, False


def load_corpus(args) -> stdlib_corpus.Corpus:
    """The stdlib's files, or the user's --data (prompts and texts alike are text to continue)."""
    if not args.data:
        return stdlib_corpus.Corpus.load(Path(args.stdlib), args.holdout_every, args.max_chars)
    user = read_user_data(args.data)
    return stdlib_corpus.Corpus.from_texts(args.data[0], user.prompts + user.texts, args.holdout_every,
                                           args.max_chars)


def held_out_prompts(args, corpus) -> list[str]:
    """Evaluation prompts: documented defs of the held-out stdlib files, or the held-out texts' first lines."""
    if not args.data:
        return stdlib_corpus.extract_prompts(corpus.held_texts, args.num_prompts)
    return [t.strip().split("\n")[0][:200] for t in corpus.held_texts if t.strip()][: args.num_prompts]


def run(args, argv=None) -> dict:
    """The whole recipe for the parsed `args` of `python -m specdec.train small`; the results."""
    import sentencepiece as spm
    import transformers

    command = command_line(argv)
    torch.manual_seed(args.seed)
    t_start = time.time()
    times = {}
    reuse = not args.train_target
    record = target_record(args.target_results, args.target) if reuse and args.target_results else None

    corpus = load_corpus(args)
    t0 = time.time()
    if reuse:
        sp_model = (args.target / "tokenizer.model").read_bytes()
    else:
        sp_model = stdlib_corpus.train_tokenizer(corpus.train_texts, args.vocab_size, args.threads)
    sp = spm.SentencePieceProcessor(model_proto=sp_model)
    newline = sp.piece_to_id("<0x0A>")
    train_stream = stdlib_corpus.token_stream(sp, corpus.train_texts)
    held_stream = stdlib_corpus.token_stream(sp, corpus.held_texts)
    times["tokenizer"] = time.time() - t0
    log(f"{len(corpus.files)} files: {len(corpus.train_texts)} train ({len(train_stream):,} tokens), "
        f"{len(corpus.held_texts)} held out ({len(held_stream):,} tokens); tokenizer {times['tokenizer']:.0f} s")

    prompts = held_out_prompts(args, corpus)
    if args.prompts_out is not None:
        stdlib_corpus.write_prompts(args.prompts_out, prompts)
        prompts = read_prompts(str(args.prompts_out))
    bench_prompts = read_prompts(str(args.specbench))[: args.specbench_count] if args.specbench else []

    # target: trained here (--train-target), or the saved one
    draft_arch = llama_files.parse_arch(args.draft_arch)
    windows = stdlib_corpus.Windows(train_stream, newline, args.ctx, args.seed + 2)
    t_dir, d_dir = args.target, args.out
    if reuse:
        target = llama_files.load_saved(t_dir).to(args.device)
        target_arch = record["target_arch"] if record else llama_files.arch_of(target.config)
        train_target = record["train_target"] if record else None
        log(f"target: {llama_files.n_params(target) / 1e6:.2f}M parameters, loaded from {t_dir} (not trained)")
    else:
        target_arch = llama_files.parse_arch(args.target_arch)
        target = llama_files.build_model(llama_files.llama_config(target_arch, sp.get_piece_size(), args.ctx),
                                         args.seed).to(args.device)
        log(f"target: {llama_files.n_params(target) / 1e6:.2f}M parameters, {len(windows):,} training windows")
        train_target = train_loop(
            "target", target, distill.WindowBatches(windows, args.batch_target), distill.lm_loss,
            TrainConfig(args.batch_target, args.lr_target, args.warmup_target, args.weight_decay, args.clip,
                        args.minutes_target, args.target_steps, args.log_every, device=args.device,
                        progress=not args.no_progress))
        times["target"] = train_target["seconds"]
        # saved now (a later --resume of the draft reuses it), from a copy: saving rounds the weights to bfloat16,
        # and the pool below is the float32 target's, as in the run that made the shipped pair
        llama_files.save_checkpoint(copy.deepcopy(target).cpu(), t_dir, sp_model)
    target.requires_grad_(False)

    # greedy pool, then the draft
    pool, pool_loaded = greedy_pool(args, target, windows, t_dir)
    times["pool"] = pool.seconds
    draft = llama_files.build_model(llama_files.llama_config(draft_arch, sp.get_piece_size(), args.ctx),
                                    args.seed + 1)
    if args.draft_init == "target":
        try:
            copied = llama_files.init_from_target(draft, target)
        except ValueError as err:
            raise SystemExit(str(err)) from None
        log(f"draft: {copied / 1e6:.2f}M parameters copied from the target")
    draft.to(args.device)
    log(f"draft: {llama_files.n_params(draft) / 1e6:.2f}M parameters; pool {len(pool)} sequences, "
        f"{pool.generated_tokens:,} generated tokens ({pool.seconds:.0f} s)")
    batches = distill.PoolBatches(pool, args.batch_draft, args.seed + 4)
    train_draft = train_loop(
        "draft", draft, batches, distill.make_distill_loss(pool, args.distill_alpha),
        TrainConfig(args.batch_draft, args.lr_draft, args.warmup_draft, args.weight_decay, args.clip,
                    args.minutes, args.steps, args.log_every, device=args.device, checkpoint=args.checkpoint,
                    checkpoint_every=args.checkpoint_every, resume=args.resume, progress=not args.no_progress))
    times["draft"] = train_draft["seconds"]

    # save (bfloat16), then evaluate what was saved
    llama_files.save_checkpoint(draft.cpu(), d_dir, sp_model, target_fingerprint=llama_files.fingerprint_of(t_dir))
    log(f"saved {d_dir}" if reuse else f"saved {t_dir} and {d_dir}")
    t0 = time.time()
    target, draft = llama_files.load_saved(t_dir), llama_files.load_saved(d_dir)
    tok_check = llama_files.check_tokenizers(t_dir, sp, corpus.held_texts)
    held_windows = stdlib_corpus.Windows(held_stream, newline, args.ctx, args.seed).evenly_spaced(args.eval_windows)
    heldout = evaluate.heldout_eval(target, draft, held_windows)
    log(f"held-out: {heldout}")
    prompt_ids = [[stdlib_corpus.BOS] + sp.encode(p) for p in prompts]
    spec_held, prompt_ids, outputs = evaluate.speculative_acceptance(t_dir, d_dir, prompt_ids, args.k,
                                                                     args.new_tokens)
    log(f"held-out prompts: {spec_held}")
    spec = {"heldout": spec_held}
    if bench_prompts:
        bench_ids = [[stdlib_corpus.BOS] + sp.encode(p) for p in bench_prompts]
        spec["specbench"] = evaluate.speculative_acceptance(t_dir, d_dir, bench_ids, args.k, args.new_tokens)[0]
        spec["specbench"]["prompt_tokens_median"] = int(np.median([len(p) for p in bench_ids]))
        log(f"SpecBench prompts: {spec['specbench']}")
    greedy_agreement = evaluate.agreement_on_greedy(target, draft, prompt_ids, outputs)
    times["eval"] = time.time() - t0
    times["total"] = time.time() - t_start

    shipped = sorted(p for p in [*d_dir.iterdir(), *t_dir.iterdir()] if p.is_file()) + (
        [args.prompts_out] if args.prompts_out else [])
    this_run = {"kind": "draft-only" if reuse else "full", "command": command, "times": times,
                "pool_loaded": pool_loaded,
                "date": time.strftime("%Y-%m-%d", time.gmtime())}
    results = {
        "args": {k: (str(v) if isinstance(v, Path) else [str(x) for x in v] if isinstance(v, list) else v)
                 for k, v in vars(args).items()},
        "command": command,
        "runs": (target_runs(record) if record else []) + [this_run],  # no record: a target from elsewhere
        "target_args": record["args"] if record else None,
        "env": {**environment(), "transformers": transformers.__version__, "sentencepiece": spm.__version__},
        "data": {"stdlib": str(corpus.root), "n_files": len(corpus.files), "n_train": len(corpus.train_texts),
                 "n_held": len(corpus.held_texts), "total_chars": corpus.total_chars,
                 "held_chars": sum(map(len, corpus.held_texts)), "train_chars": sum(map(len, corpus.train_texts)),
                 "file_cap": corpus.file_cap, "train_tokens": int(len(train_stream)),
                 "held_tokens": int(len(held_stream)), "train_windows": len(windows), "n_prompts": len(prompts)},
        "spm_settings": dict(stdlib_corpus.SPM_SETTINGS, vocab_size=args.vocab_size),
        "target_arch": target_arch, "draft_arch": draft_arch,
        "target_params": llama_files.n_params(target), "draft_params": llama_files.n_params(draft),
        "target_bytes": (t_dir / "model.safetensors").stat().st_size,
        "draft_bytes": (d_dir / "model.safetensors").stat().st_size,
        "pair_bytes": sum(p.stat().st_size for p in shipped if p != args.prompts_out),
        "prompts_file": report.display_path(args.prompts_out, REPO) if args.prompts_out else None,
        "train_target": train_target, "train_draft": train_draft, "pool_passes": batches.passes,
        "pool": {"seqs": len(pool), "generated_tokens": pool.generated_tokens, "tokens": int(pool.lengths.sum()),
                 "seconds": times["pool"], "loaded_from_cache": pool_loaded},
        "heldout": heldout, "spec": spec, "greedy_agreement": greedy_agreement, "near_tie": evaluate.NEAR_TIE,
        "tok_check": tok_check, "times": times, "files": report.file_rows(shipped, REPO),
        "samples": [prompts[i] + sp.decode(outputs[i]) for i in range(min(3, len(prompts)))],
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=2) + "\n")
    if args.doc:
        report.write(args.doc, results)
        log(f"wrote {args.doc}")
    print(evaluate.acceptance_table(spec), flush=True)
    log(evaluate.acceptance_plot(spec, args.plot))
    log(f"wrote {args.results}; total {times['total'] / 60:.1f} min")
    return results
