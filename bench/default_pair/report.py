"""docs/default_pair.md from `template.md` and a run's results (the dict `pipeline.run` returns and saves as
JSON, by default bench/default_pair/results.json)."""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from string import Template

from .data import EXCLUDED_DIRS

TEMPLATE = Path(__file__).with_name("template.md")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def display_path(path: Path, repo: Path) -> str:
    """Relative to the repository when inside it, else as given."""
    path = path.resolve()
    return str(path.relative_to(repo)) if path.is_relative_to(repo) else str(path)


def file_rows(paths: list[Path], repo: Path) -> list[dict]:
    return [{"path": display_path(p, repo), "bytes": p.stat().st_size, "sha256": sha256(p)} for p in paths]


def _arch(a: dict, params: int) -> str:
    return (f"hidden {a['hidden']}, {a['layers']} layers, {a['heads']} heads (head_dim {a['hidden'] // a['heads']}), "
            f"{a['kv_heads']} KV heads, intermediate {a['ffn']} (SwiGLU): **{params / 1e6:.2f}M parameters**")


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def _spec_row(name: str, s: dict | None) -> str:
    if s is None:
        return f"| {name} | not measured (no prompt file given) | | | |"
    return (f"| {name} | {s['prompts']} | **{s['acceptance']:.3f}** ({s['accepted']:,} of {s['proposed']:,}) | "
            f"{s['tokens_per_target_call']:.2f} | {s['matches_greedy']} of {s['prompts']} |")


def render(r: dict) -> str:
    """The markdown text for the results `r` of `pipeline.run`."""
    a, ev, spec, diag, times = r["args"], r["heldout"], r["spec"], r["greedy_agreement"], r["times"]
    tt, dt, pool = r["train_target"], r["train_draft"], r["pool"]
    values = {
        "target_params_m": f"{r['target_params'] / 1e6:.1f}",
        "draft_params_m": f"{r['draft_params'] / 1e6:.1f}",
        "target_loss": f"{ev['target_loss']:.4f}", "target_ppl": f"{math.exp(ev['target_loss']):.2f}",
        "draft_loss": f"{ev['draft_loss']:.4f}", "draft_ppl": f"{math.exp(ev['draft_loss']):.2f}",
        "eval_tokens": f"{ev['tokens']:,}", "eval_windows": ev["windows"],
        "top1_agreement": f"{ev['top1_agreement']:.3f}",
        "k": a["k"], "new_tokens": a["new_tokens"],
        "spec_rows": "\n".join([_spec_row(f"held-out prompts (`{r['prompts_file']}`)", spec["heldout"]),
                                _spec_row(f"SpecBench, first turn of the first {a['specbench_count']}",
                                          spec.get("specbench"))]),
        "greedy_agreement": f"{diag['agreement']:.3f}",
        "near_tie_fraction": f"{diag['near_tie_fraction']:.0%}",
        "agreement_near_ties": f"{diag['agreement_near_ties']:.3f}",
        "agreement_elsewhere": f"{diag['agreement_elsewhere']:.3f}", "near_tie": r["near_tie"],
        "target_mib": f"{r['target_bytes'] / 2**20:.1f}", "draft_mib": f"{r['draft_bytes'] / 2**20:.1f}",
        "pair_mib": f"{r['pair_bytes'] / 2**20:.1f}",
        "t_tokenizer": f"{times['tokenizer']:.0f} s", "t_target": _minutes(times["target"]),
        "t_pool": _minutes(times["pool"]), "t_draft": _minutes(times["draft"]), "t_eval": _minutes(times["eval"]),
        "t_total": _minutes(times["total"]),
        "command": r["command"],
        "target_steps": tt["steps"], "draft_steps": dt["steps"], "pool_seqs": f"{pool['seqs']:,}",
        "pool_seqs_flag": pool["seqs"],
        "seed": a["seed"], "seed1": a["seed"] + 1, "seed2": a["seed"] + 2, "seed3": a["seed"] + 3,
        "seed4": a["seed"] + 4,
        "python": r["env"]["python"], "torch": r["env"]["torch"], "transformers": r["env"]["transformers"],
        "sentencepiece": r["env"]["sentencepiece"], "threads": a["threads"], "cpu": r["env"]["cpu"],
        "stdlib": r["data"]["stdlib"], "excluded": ", ".join(f"`{e}/`" for e in EXCLUDED_DIRS),
        "n_files": r["data"]["n_files"], "total_chars": f"{r['data']['total_chars']:,}",
        "holdout_every": a["holdout_every"], "n_held": r["data"]["n_held"],
        "held_chars": f"{r['data']['held_chars']:,}", "n_train": r["data"]["n_train"],
        "max_chars": f"{a['max_chars']:,}", "file_cap": f"{r['data']['file_cap']:,}",
        "train_chars": f"{r['data']['train_chars']:,}", "train_tokens": f"{r['data']['train_tokens']:,}",
        "chars_per_token": f"{r['data']['train_chars'] / r['data']['train_tokens']:.2f}",
        "n_prompts": r["data"]["n_prompts"], "ctx": a["ctx"], "body": a["ctx"] - 1,
        "spm_settings": ", ".join(f"`{k}={v}`" for k, v in r["spm_settings"].items()),
        "target_arch": _arch(r["target_arch"], r["target_params"]),
        "draft_arch": _arch(r["draft_arch"], r["draft_params"]),
        "weight_decay": a["weight_decay"], "clip": a["clip"],
        "t_batch": tt["batch"], "t_lr": f"{tt['lr']:g}", "t_warmup": tt["warmup"],
        "t_tokens": f"{tt['steps'] * tt['batch'] * a['ctx']:,}",
        "t_epochs": f"{tt['steps'] * tt['batch'] / r['data']['train_windows']:.2f}",
        "t_minutes": f"{a['minutes_target']:g}", "t_loss": f"{tt['final_loss_ema']:.3f}",
        "pool_minutes": f"{a['minutes_pool']:g}", "pool_new": a["pool_new_tokens"],
        "prefix_lo": a["pool_prefix_min"], "prefix_hi": a["pool_prefix_max"], "pool_batch": a["pool_batch"],
        "top_k": a["pool_top_k"], "pool_generated": f"{pool['generated_tokens']:,}",
        "pool_tokens": f"{pool['tokens']:,}", "alpha": f"{a['distill_alpha']:g}",
        "one_minus_alpha": f"{1 - a['distill_alpha']:g}",
        "d_batch": dt["batch"], "d_lr": f"{dt['lr']:g}", "d_warmup": dt["warmup"], "d_passes": r["pool_passes"],
        "d_minutes": f"{a['minutes_draft']:g}", "d_loss": f"{dt['final_loss_ema']:.3f}",
        "files_table": "\n".join(f"| `{f['path']}` | {f['bytes']:,} | `{f['sha256'][:16]}` |" for f in r["files"]),
        "samples": "\n\n".join(f"```python\n{s}\n```" for s in r["samples"]),
    }
    values |= {f"tok_{k}": v for k, v in r["tok_check"].items()}
    return Template(TEMPLATE.read_text(encoding="utf-8")).substitute(values)


def write(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(results), encoding="utf-8")


def rewrite(results_path: Path, doc: Path) -> None:
    """Render the doc again from a saved results file (after editing the template)."""
    write(doc, json.loads(results_path.read_text(encoding="utf-8")))
