"""What the CLIs say about a run: the summary table (one row per run: method, batch, k, tokens/s, acceptance...)
and what runs the model's steps (`forward_info`: the native or the torch forward, the CPU kernel's instruction
set; the run summary's words for it, `forward_summary`; /metrics's `specdec_forward_info`), with the one warning
for the scalar kernel (`warn_scalar_kernel`)."""
from __future__ import annotations

import sys

# kernels/qmm_cpu.py's scalar variant against AVX2 (issue 57): an 896 x 4864 Q4_K matrix at one row
SCALAR_COST = "~65x slower than AVX2: 7.9 ms against 0.12 ms for an 896 x 4864 Q4_K matrix at one row"
_scalar_warned = False


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


def forward_info(model) -> dict[str, str]:
    """What runs `model`'s steps: `forward` "native" (one C++ call a step) or "torch"; `isa`, the instruction
    set of the CPU quantized kernel it multiplies with ("scalar", "avx2", "avx512-vnni"; "none" for a model
    that does not use it: float weights, or not on the CPU); `reason`, why not native ("" when native)."""
    native = getattr(model, "native", None) is not None
    return {"forward": "native" if native else "torch", "isa": kernel_isa(model),
            "reason": "" if native else (getattr(model, "native_reason", None) or "")}


def forward_summary(model) -> str:
    """Which forward runs the model: 'native forward (avx512-vnni)', or 'torch forward (why not native)'."""
    info = forward_info(model)
    if info["forward"] == "native":
        return f"native forward ({info['isa']})"
    return f"torch forward ({info['reason']})" if info["reason"] else "torch forward"


def kernel_isa(model) -> str:
    """The CPU quantized kernel's instruction set where `model` multiplies with it, else "none"."""
    from specdec.kernels import qmm_cpu

    device = getattr(getattr(model, "device", None), "type", "cpu")
    if getattr(model, "native", None) is None and not (getattr(model, "quantize", None) and device == "cpu"):
        return "none"
    return qmm_cpu.host_isa()


def warn_scalar_kernel(models, file=None) -> bool:
    """Once a process, a line on stderr when a model multiplies with the kernel's scalar variant (no AVX2 on
    this CPU, or a build without it) and what that costs; whether it warned now."""
    global _scalar_warned
    if _scalar_warned or not any(m is not None and kernel_isa(m) == "scalar" for m in models):
        return False
    _scalar_warned = True
    print(f"specdec: warning: the CPU quantized kernel runs its scalar variant here (no AVX2): {SCALAR_COST}",
          file=file or sys.stderr)
    return True


def weights_summary(llm, args) -> str:
    """What the target's weights are, for the summary: 'dtype float32', or its quantized format beside the
    activations' dtype ('weights Q4_K+Q6_K as stored, activations float32')."""
    from specdec.models.quant import QUANTIZED_LINEAR

    fmt = getattr(llm.target, "quantize", None)
    dtype = args.dtype or "float32"
    if not fmt:
        return f"dtype {dtype}"
    types = sorted({p.qtype for m in llm.target.modules() if isinstance(m, QUANTIZED_LINEAR)
                    for _, p in getattr(m, "parts", ())})
    kind = "+".join(types) + (" as stored" if fmt == "gguf" else f" (--quantize {fmt})") if types else fmt
    return f"weights {kind}, activations {dtype}, {forward_summary(llm.target)}"
