#!/usr/bin/env bash
# GPU check of the Triton kernels: native kernel tests, microbenchmarks (JSON) and an end-to-end throughput run.
#
#   bash bench/gpu_check.sh [RESULTS_DIR]        # default ./gpu_results; about 6-9 minutes on an H200
#
# Installs nothing from the network: torch and triton must already be there (the repository is installed with
# `pip install -e . --no-deps --no-index --no-build-isolation --use-pep517` only if `specdec` does not import). Every step has its own
# timeout inside an overall budget ($GPU_CHECK_BUDGET_S, default 520 s); a failing step does not stop the
# others, and the exit status is non-zero if any step failed. Results in RESULTS_DIR:
#   env.txt                 versions, GPU, git revision
#   kernel_tests.log/.xml   python -m pytest tests/test_kernel*.py tests/test_quant_kernel.py, compiled kernels
#                           (TRITON_INTERPRET=0)
#   invariant_tests.log/.xml  tests/test_batch_invariant.py natively: bitwise batch invariance on CUDA
#   bench_realign.json/.log, bench_rejection.json/.log, bench_quant_matmul.json/.log
#                           microbenchmarks (pytest-benchmark JSON; GB/s etc. in each "extra_info")
#   bench_summary.md        realign GB/s vs torch copy, in place vs ping-pong; rejection times
#   throughput.log + files  python -m bench.throughput --device cuda --dtype bfloat16 --quick --out RESULTS_DIR
#   throughput_compiled.log the same with --compile (CUDA graphs, "reduce-overhead"), into RESULTS_DIR/compiled
#   status.txt              one line per step: name, exit code, seconds
# GPU_CHECK_ALLOW_CPU=1 dry-runs the script itself on a machine without a GPU (kernel tests skip, CPU benchmarks).
set -euo pipefail

cd "$(dirname "$0")/.."
OUT_DIR="$(mkdir -p "${1:-./gpu_results}" && cd "${1:-./gpu_results}" && pwd)"
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
if ! python -c "import specdec.kernels.realign" 2>/dev/null; then
    # offline: build the editable install in this environment (no isolated build, which would fetch setuptools)
    echo "specdec not importable: pip install -e . (offline, no build isolation)"
    python -m pip install -q -e . --no-deps --no-index --no-build-isolation --use-pep517 || true
    python -c "import specdec.kernels.realign" || { echo "specdec still not importable" >&2; exit 2; }
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

echo "== done in $(( SECONDS - START ))s; results in $OUT_DIR"
cat "$OUT_DIR/status.txt"
exit $FAILED
