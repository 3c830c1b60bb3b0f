"""The summary table the CLIs print: one row per run (method, batch, k, tokens/s, acceptance...)."""
from __future__ import annotations


def summary_table(rows: list[dict]) -> str:
    header = ["method", "batch", "k", "tokens/s", "acceptance", "tokens/step", "realign share", "speed-up vs AR",
              "drafter"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append(f"| {r['method']} | {r['batch_size']} | {r['k']} | {r['tokens_per_s']:.1f} | {r['acceptance']} | "
                     f"{r['tokens_per_step']:.2f} | {r['realign_share']} | {r['speedup']} | {r['drafter']} |")
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
    return {"method": metrics.method, "drafter": metrics.drafter or "-", "batch_size": metrics.batch_size, "k": k_summary(metrics, k_setting),
            "tokens_per_s": metrics.tokens_per_s,
            "acceptance": f"{metrics.acceptance_rate:.1%}" if speculative and metrics.proposed_drafts else "-",
            "tokens_per_step": metrics.mean_tokens_per_step,
            "realign_share": f"{metrics.realign_share:.1%}" if metrics.profiled and speculative else "-",
            "speedup": f"{metrics.tokens_per_s / ar_tps:.2f}x" if ar_tps else "-"}
