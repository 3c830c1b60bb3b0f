#!/usr/bin/env bash
# GPU check of the Triton kernels: native kernel tests, microbenchmarks (JSON) and end-to-end runs.
#
#   bash bench/gpu_check.sh [RESULTS_DIR] [GROUP]     # default ./gpu_results, group "base"
#
# GROUP "base" (about 6-9 minutes on an H200): the kernel tests, realign/rejection/quant benchmarks and the
# throughput runs below. GROUP "bi" (issue #42; under 9 minutes with GPU_CHECK_BUDGET_S=540): the
# batch-invariant kernels natively (tests/test_bi_kernels.py, the quant kernel's tests), their microbenchmarks
# against cuBLAS / SDPA / torch at Llama-7B/8B shapes with a tile sweep, the end-to-end cost and exactness of
# the mode on a 7B-shaped pair (bench/bi_gpu.py) and the model-level invariance tests on CUDA; every ratio
# against its bar in bi_summary.md. GROUP "all": both (longer than one 10-minute call).
#
# Installs nothing from the network: torch and triton must already be there (the repository is installed with
# `pip install -e . --no-deps --no-index --no-build-isolation --use-pep517` only if `specdec` does not import). Every step has its own
# timeout inside an overall budget ($GPU_CHECK_BUDGET_S, default 520 s); a failing step does not stop the
# others, and the exit status is non-zero if any step failed. Results in RESULTS_DIR:
#   env.txt                 versions, GPU, git revision
#   status.txt              one line per step: name, exit code, seconds
# base:
#   kernel_tests.log/.xml   python -m pytest tests/test_kernel*.py tests/test_quant_kernel.py, compiled kernels
#                           (TRITON_INTERPRET=0)
#   invariant_tests.log/.xml  tests/test_batch_invariant.py natively: bitwise batch invariance on CUDA
#   bench_realign.json/.log, bench_rejection.json/.log, bench_quant_matmul.json/.log
#                           microbenchmarks (pytest-benchmark JSON; GB/s etc. in each "extra_info")
#   bench_summary.md        realign GB/s vs torch copy, in place vs ping-pong; rejection times
#   throughput.log + files  python -m bench.throughput --device cuda --dtype bfloat16 --quick --out RESULTS_DIR
#   throughput_compiled.log the same with --compile (inductor kernels; CUDA graphs are --cuda-graphs'), into RESULTS_DIR/compiled
# bi:
#   bi_kernel_tests.log/.xml  tests/test_bi_kernels.py (its slow sm_90 compile test included), tests/test_quant_kernel.py
#   bench_bi_linear.json, bench_bi_attention.json (+ RMSNorm), bench_quant_matmul.json (+ .log each)
#   bi_e2e.log, bi_e2e/bi_e2e.jsonl, bi_e2e/bi_e2e.md   python -m bench.bi_gpu (cost off/on, exactness vs AR@1, auto)
#   bi_invariant_tests.log/.xml  the CUDA/Triton cases of tests/test_batch_invariant.py, and tests/test_bi_mode.py
#   bi_summary.md           every ratio against its bar (invariant matmul >= 0.85x cuBLAS at 1-64 rows; int4 >= 2x,
#                           int8 >= 1.5x bf16 cuBLAS at 1-8 rows; end to end on/off <= 1.15x; rows equal to AR 100%)
# Group "step" (bash bench/gpu_check.sh DIR step, about 5 minutes): issue #41's decode step, bench/gpu_step.py
#   gpu_step.log, gpu_step/gpu_step.jsonl, gpu_step/gpu_step.md   every method (CUDA graphs) and AR without graphs
#                           against transformers' generate and assisted generation at B 1/8/32; kernels a step,
#                           GPU busy and HBM roofline share of AR at B 1
# GPU_CHECK_ALLOW_CPU=1 dry-runs the script itself on a machine without a GPU (kernel tests skip, CPU benchmarks).
set -euo pipefail

cd "$(dirname "$0")/.."
OUT_DIR="$(mkdir -p "${1:-./gpu_results}" && cd "${1:-./gpu_results}" && pwd)"
GROUP="${2:-base}"
case "$GROUP" in base|bi|step|all) ;; *) echo "group must be base, bi, step or all, got $GROUP" >&2; exit 2;; esac
want() { [[ "$GROUP" == all || "$GROUP" == "$1" ]]; }
BUDGET="${GPU_CHECK_BUDGET_S:-520}"
START=$SECONDS
FAILED=0
: > "$OUT_DIR/status.txt"

export TRITON_INTERPRET=0  # compiled kernels (tests/conftest.py only sets a default)
export PYTHONUNBUFFERED=1
unset SPECDEC_BENCH_QUICK

remaining() { echo $(( BUDGET - (SECONDS - START) )); }

# step NAME CAP_SECONDS LOGFILE CMD...: run CMD with timeout min(CAP, time left), log to LOGFILE, record status
step() {
    local name="$1" cap="$2" log="$3"
    shift 3
    local left
    left=$(remaining)
    if (( left < 20 )); then
        echo "$name skipped (budget of ${BUDGET}s spent)" | tee -a "$OUT_DIR/status.txt"
        FAILED=1
        return 1
    fi
    local limit=$(( cap < left ? cap : left ))
    local t0=$SECONDS rc=0
    echo "== $name (timeout ${limit}s)"
    timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1 || rc=$?
    tail -n 15 "$log"
    echo "$name rc=$rc ${limit}s-limit $(( SECONDS - t0 ))s" | tee -a "$OUT_DIR/status.txt"
    if (( rc != 0 )); then
        FAILED=1
    fi
    return $rc
}

# -- environment -----------------------------------------------------------------------------------------
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" && [[ "${GPU_CHECK_ALLOW_CPU:-0}" != 1 ]]; then
    echo "no CUDA device visible to torch: this script is for a GPU machine" | tee -a "$OUT_DIR/status.txt"
    exit 2
fi
# specdec must import from this checkout (an install of another checkout would test other kernels)
HERE_CHECK='import os, specdec.kernels.realign as m; assert os.path.realpath(m.__file__).startswith(os.path.realpath("."))'
if ! python -c "$HERE_CHECK" 2>/dev/null; then
    # offline: build the editable install in this environment (no isolated build, which would fetch setuptools)
    echo "specdec not importable from this checkout: pip install -e . (offline, no build isolation)"
    python -m pip install -q -e . --no-deps --no-index --no-build-isolation --use-pep517 || true
    python -c "$HERE_CHECK" || { echo "specdec still not importable from this checkout" >&2; exit 2; }
fi
{
    date -u
    git rev-parse HEAD 2>/dev/null || true
    git status --short 2>/dev/null | head -n 20 || true
    python - <<'EOF' || true
import sys, torch, triton
print(sys.version)
print("torch", torch.__version__, "cuda", torch.version.cuda, "| triton", triton.__version__)
print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
EOF
    nvidia-smi 2>/dev/null || true
} > "$OUT_DIR/env.txt" 2>&1
head -n 8 "$OUT_DIR/env.txt"

if want base; then
# -- 1. kernel tests, natively (no interpreter), Triton forced -----------------------------------------------
step kernel_tests 150 "$OUT_DIR/kernel_tests.log" \
    env SPECDEC_KERNELS=triton python -m pytest -q -rs tests/test_kernel*.py tests/test_quant_kernel.py --junitxml="$OUT_DIR/kernel_tests.xml" || true

# -- 1b. batch-invariant mode natively (Triton matmul/attention on CUDA): bitwise equal logits across B, T, layout
step invariant_tests 120 "$OUT_DIR/invariant_tests.log" \
    python -m pytest -q -rs tests/test_batch_invariant.py --junitxml="$OUT_DIR/invariant_tests.xml" || true

# -- 2. microbenchmarks: realign and rejection apart (a timeout loses one JSON, not both); the quick grid
#       if the full one did not finish
bench_part() {
    local part="$1" cap="$2"
    if ! step "bench_$part" "$cap" "$OUT_DIR/bench_$part.log" python -m pytest -q bench/bench_kernels.py \
        --benchmark-only -k "test_$part" --benchmark-json="$OUT_DIR/bench_$part.json"; then
        step "bench_${part}_quick" 60 "$OUT_DIR/bench_${part}_quick.log" env SPECDEC_BENCH_QUICK=1 \
            python -m pytest -q bench/bench_kernels.py --benchmark-only -k "test_$part" \
            --benchmark-json="$OUT_DIR/bench_$part.json" || true
    fi
}
bench_part realign 100
bench_part rejection 60
bench_part quant_matmul 90
if [[ -s "$OUT_DIR/bench_realign.json" || -s "$OUT_DIR/bench_rejection.json" ]]; then
    if python - "$OUT_DIR"/bench_realign.json "$OUT_DIR"/bench_rejection.json > "$OUT_DIR/bench_summary.md" <<'EOF'
import json, os, sys
runs = [b for f in sys.argv[1:] if os.path.exists(f) and os.path.getsize(f) for b in json.load(open(f))["benchmarks"]]
print("| realign B | context | layers | impl | ms (p50) | GB/s | copy GB/s | of copy |")
print("|---|---|---|---|---|---|---|---|")
for b in runs:
    e = b["extra_info"]
    if "impl" in e:
        ms = e.get("do_bench_ms_p50", b["stats"]["median"] * 1e3)
        print(f"| {e['batch']} | {e['context']} | {e['layers']} | {e['impl']} | {ms:.3f} | {e['gbps']:.1f} | "
              f"{e['copy_gbps']:.1f} | {e['fraction_of_copy']:.2f} |")
print()
print("| rejection B | k | vocab | mode | ms (p50) | torch ref ms | speedup |")
print("|---|---|---|---|---|---|---|")
for b in runs:
    e = b["extra_info"]
    if "mode" in e:
        ms = e.get("do_bench_ms_p50", b["stats"]["median"] * 1e3)
        print(f"| {e['batch']} | {e['k']} | {e['vocab']} | {e['mode']} | {ms:.3f} | "
              f"{e.get('reference_ms', float('nan')):.3f} | {e.get('speedup_vs_reference', float('nan')):.1f} |")
EOF
    then head -n 30 "$OUT_DIR/bench_summary.md"; else echo "bench summary failed"; fi
fi

# -- 3. end-to-end throughput ----------------------------------------------------------------------------
if [[ -f bench/throughput.py ]]; then
    step throughput 90 "$OUT_DIR/throughput.log" \
        python -m bench.throughput --device cuda --dtype bfloat16 --quick --out "$OUT_DIR" || true
else
    echo "throughput skipped: bench/throughput.py does not exist (yet)" | tee -a "$OUT_DIR/status.txt"
fi

# -- 4. the same, compiled (CUDA graphs over the batch-size buckets; compile time in the log)
if [[ -f bench/throughput.py ]]; then
    step throughput_compiled 90 "$OUT_DIR/throughput_compiled.log" \
        python -m bench.throughput --device cuda --dtype bfloat16 --quick --compile --out "$OUT_DIR/compiled" || true
fi

fi

if want bi; then
# -- bi 1. the batch-invariant kernels natively: bitwise rows alone and in batches of 3/8/48 with tl.dot
step bi_kernel_tests 120 "$OUT_DIR/bi_kernel_tests.log" \
    env SPECDEC_KERNELS=triton python -m pytest -q -rs tests/test_bi_kernels.py tests/test_quant_kernel.py \
    --junitxml="$OUT_DIR/bi_kernel_tests.xml" || true

# -- bi 2. microbenchmarks: linear (+ tile sweep) first, the headline bar; each part its own JSON
bi_bench() {
    local name="$1" cap="$2" filter="$3"
    step "bench_$name" "$cap" "$OUT_DIR/bench_$name.log" python -m pytest -q bench/bench_kernels.py \
        --benchmark-only -k "$filter" --benchmark-json="$OUT_DIR/bench_$name.json" || true
}
bi_bench bi_linear 110 "test_bi_linear"

# -- bi 3. end to end: the mode's cost and exactness on the 7B-shaped pair, and what "auto" picks
left=$(remaining)
e2e_cap=$(( left > 230 ? 190 : left - 40 ))
e2e_quick=()
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || e2e_quick=(--quick)  # CPU dry run
step bi_e2e "$e2e_cap" "$OUT_DIR/bi_e2e.log" python -m bench.bi_gpu --out "$OUT_DIR/bi_e2e" "${e2e_quick[@]}" \
    --budget-s $(( e2e_cap > 60 ? e2e_cap - 45 : 20 )) || true

bi_bench bi_attention 60 "test_bi_attention or test_bi_rms_norm"
bi_bench quant_matmul 70 "test_quant_matmul"

# -- bi 4. the model-level tests on CUDA (logits bitwise batch-invariant with the new kernels) and auto's logic
step bi_invariant_tests 80 "$OUT_DIR/bi_invariant_tests.log" \
    python -m pytest -q -rs tests/test_batch_invariant.py tests/test_bi_mode.py -k "cuda or triton or auto or rule" \
    --junitxml="$OUT_DIR/bi_invariant_tests.xml" || true

# -- bi summary: every measured ratio against its bar
python - "$OUT_DIR" > "$OUT_DIR/bi_summary.md" <<'EOF' || echo "bi summary failed"
import json, os, sys
out = sys.argv[1]

def runs(name):
    path = os.path.join(out, f"bench_{name}.json")
    if not (os.path.exists(path) and os.path.getsize(path)):
        return []
    return [b for b in json.load(open(path))["benchmarks"]]

def ms(b):
    return b["extra_info"].get("do_bench_ms_p50", b["stats"]["median"] * 1e3)

print("# Issue #42 on the GPU: batch-invariant kernels and mode\n")
lin = runs("bi_linear")
pairs = {}
for b in lin:
    e = b["extra_info"]
    if e.get("impl") in ("invariant", "ordinary"):
        pairs.setdefault((e["shape"], e["rows"]), {})[e["impl"]] = (ms(b), e)
if pairs:
    print("## bi matmul vs cuBLAS (bfloat16): speed ratio = cuBLAS time / invariant time (bar >= 0.85)\n")
    rows = sorted({r for _, r in pairs})
    print("| shape | config | " + " | ".join(f"M={r}" for r in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    for shape in dict.fromkeys(s for s, _ in pairs):
        cells, cfg = [], ""
        for r in rows:
            p = pairs.get((shape, r), {})
            if "invariant" in p and "ordinary" in p:
                ratio = p["ordinary"][0] / p["invariant"][0]
                cfg = p["invariant"][1].get("config") or cfg
                cells.append(f"{ratio:.2f}{'' if ratio >= 0.85 else ' (!)'} ({p['invariant'][0] * 1e3:.0f} us)")
            else:
                cells.append("-")
        c = f"{cfg['block_m']}x{cfg['block_n']}x{cfg['block_k']} s{cfg['num_stages']}" if cfg else "-"
        print(f"| {shape} | {c} | " + " | ".join(cells) + " |")
    print()
sweep = [b for b in lin if b["extra_info"].get("impl") == "config"]
if sweep:
    print("## tile sweep (bfloat16; any of these keeps the invariance): best vs the default config\n")
    print("| shape | M | best | best us | default us |")
    print("|---|---|---|---|---|")
    groups = {}
    for b in sweep:
        e = b["extra_info"]
        groups.setdefault((e["shape"], e["rows"]), []).append((ms(b), e["config"], e["default"]))
    for (shape, r), cands in groups.items():
        cands.sort(key=lambda c: c[0])
        best = cands[0]
        default = [c for c in cands if c[2]]
        c = best[1]
        print(f"| {shape} | {r} | {c['block_m']}x{c['block_n']}x{c['block_k']} s{c['num_stages']} | "
              f"{best[0] * 1e3:.1f} | {default[0][0] * 1e3 if default else float('nan'):.1f} |")
    print()
att = runs("bi_attention")
groups = {}
for b in att:
    e = b["extra_info"]
    key = ("attention", e.get("model"), e.get("batch"), e.get("T"), e.get("context")) if "T" in e else \
        ("rms_norm", e.get("rows"), e.get("residual"))
    groups.setdefault(key, {})[e["impl"]] = ms(b)
if groups:
    print("## attention vs SDPA, RMSNorm vs torch: speed ratio = ordinary time / invariant time\n")
    print("| case | invariant us | ordinary us | ratio |")
    print("|---|---|---|---|")
    for key, p in groups.items():
        if "invariant" in p and "ordinary" in p:
            print(f"| {' '.join(map(str, key))} | {p['invariant'] * 1e3:.1f} | {p['ordinary'] * 1e3:.1f} | "
                  f"{p['ordinary'] / p['invariant']:.2f} |")
    print()
quant = runs("quant_matmul")
groups = {}
for b in quant:
    e = b["extra_info"]
    groups.setdefault((e["fmt"], f"{e['N']}x{e['K']}", e["rows"]), {})[e["impl"]] = ms(b)
if groups:
    print("## weight-only kernel vs bfloat16 cuBLAS: speedup = bf16 time / kernel time (bar at 1-8 rows: int4 >= 2,"
          " int8 >= 1.5)\n")
    print("| fmt | N x K | M | kernel us | speedup | row-major codes speedup |")
    print("|---|---|---|---|---|---|")
    for (fmt, shape, r), p in sorted(groups.items()):
        if "kernel" in p and "bf16" in p:
            s = p["bf16"] / p["kernel"]
            bar = 2.0 if fmt == "int4" else 1.5
            flag = " (!)" if r <= 8 and s < bar else ""
            nm = f"{p['bf16'] / p['kernel_nmajor']:.2f}" if "kernel_nmajor" in p else "-"
            print(f"| {fmt} | {shape} | {r} | {p['kernel'] * 1e3:.1f} | {s:.2f}{flag} | {nm} |")
    print()
e2e = os.path.join(out, "bi_e2e", "bi_e2e.md")
if os.path.exists(e2e):
    print(open(e2e).read())
EOF
head -n 60 "$OUT_DIR/bi_summary.md" || true
fi

if want step; then
# -- step: issue #41's decode step on the 7B-shaped pair: every method with CUDA graphs (and AR without) against
#    transformers' generate and assisted generation; kernels a step, GPU busy, HBM roofline share
left=$(remaining)
step_cap=$(( left > 320 ? 300 : left - 20 ))
step_quick=()
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || step_quick=(--quick)  # CPU dry run
step gpu_step "$step_cap" "$OUT_DIR/gpu_step.log" python -m bench.gpu_step --out "$OUT_DIR/gpu_step" \
    "${step_quick[@]}" --budget-s $(( step_cap > 60 ? step_cap - 40 : 20 )) || true
fi

echo "== done in $(( SECONDS - START ))s; results in $OUT_DIR"
cat "$OUT_DIR/status.txt"
exit $FAILED
