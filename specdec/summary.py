"""The summary table the CLIs print: one row per run (method, batch, k, tokens/s, acceptance...)."""
from __future__ import annotations


def summary_table(rows: list[dict]) -> str:
    """The rows as a markdown table; the realign share (timed only with --profile) is a column only when
    some row has one."""
    columns = [("method", "method"), ("batch", "batch_size"), ("k", "k"), ("tokens/s", "tokens_per_s"),
               ("acceptance", "acceptance"), ("tokens/step", "tokens_per_step"), ("realign share", "realign_share"),
               ("speed-up vs AR", "speedup"), ("drafter", "drafter")]
    if all(r["realign_share"] == "-" for r in rows):
        columns.remove(("realign share", "realign_share"))
    formats = {"tokens_per_s": "{:.1f}", "tokens_per_step": "{:.2f}"}
    lines = ["| " + " | ".join(title for title, _ in columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(formats.get(key, "{}").format(r[key]) for _, key in columns) + " |")
    return "\n".join(lines)


def k_summary(metrics, k_setting) -> str:
    """The k a run used: fixed, or "auto" with the mean chosen k and the share of steps without the draft."""
    if metrics.method == "ar":
        return "-"
    if k_setting != "auto":
        return str(k_setting)
    steps = sum(metrics.k_histogram.values())
    if not steps:
        return "auto"
    mean = sum(k * n for k, n in metrics.k_histogram.items()) / steps
    return f"auto: {mean:.1f} ({metrics.k_histogram.get(0, 0) / steps:.0%} k=0)"


def metrics_row(metrics, k_setting, ar_tps: float | None) -> dict:
    speculative = metrics.method != "ar"
    # the rows that could run at once: a batch size of 8 over 1 request decodes at batch 1
    batch = min(metrics.batch_size, metrics.num_requests) if metrics.num_requests else metrics.batch_size
    return {"method": metrics.method, "drafter": metrics.drafter or "-", "batch_size": batch,
            "k": k_summary(metrics, k_setting), "tokens_per_s": metrics.tokens_per_s,
            "acceptance": f"{metrics.acceptance_rate:.1%}" if speculative and metrics.proposed_drafts else "-",
            "tokens_per_step": metrics.mean_tokens_per_step,
            "realign_share": f"{metrics.realign_share:.1%}" if metrics.profiled and speculative else "-",
            "speedup": f"{metrics.tokens_per_s / ar_tps:.2f}x" if ar_tps else "-"}
