"""Peak memory of `load_model`: this tree's loader against an earlier revision's (--before), on a random
checkpoint of a real model's shape, or on a GGUF file (--gguf; dtype `stored` keeps its blocks as the file
has them, the CPU default). Every measurement runs in a fresh subprocess, interleaved, reporting peak RSS
(ru_maxrss, the kernel's high-water mark) after import, after loading and after reading every weight, and
the resident memory once loaded (docs/benchmarks/loader-memory.md). The driver never imports torch: a child
inherits its parent's peak RSS.

    python -m bench.loader_memory --shape qwen3-0.6b --repeats 2
    python -m bench.loader_memory --gguf FILE.gguf --dtypes stored --loaders head,now --before REV
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench.common import REPO, HelpFormatter, command_line, md_table

SHAPES = {  # Qwen3 dense checkpoints (config.json of the Hugging Face releases)
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
}
BEFORE_MODULES = ("loader", "transformer", "config", "errors", "cache")


def checkpoint_shapes(c: dict) -> dict[str, list[int]]:
    E, I, V, D = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    H, Hkv = c["num_attention_heads"], c["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": [V, E], "model.norm.weight": [E]}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": [E], p + "post_attention_layernorm.weight": [E],
                       p + "self_attn.q_proj.weight": [H * D, E], p + "self_attn.k_proj.weight": [Hkv * D, E],
                       p + "self_attn.v_proj.weight": [Hkv * D, E], p + "self_attn.o_proj.weight": [E, H * D],
                       p + "self_attn.q_norm.weight": [D], p + "self_attn.k_norm.weight": [D],
                       p + "mlp.gate_proj.weight": [I, E], p + "mlp.up_proj.weight": [I, E],
                       p + "mlp.down_proj.weight": [E, I]})
    return shapes  # tied embeddings: no lm_head.weight


def build_checkpoint(directory: str, shape: str) -> int:
    """config.json + model.safetensors (bf16, N(0, 0.02), norms 1) written one tensor at a time; returns bytes."""
    import torch

    c = SHAPES[shape]
    os.makedirs(directory, exist_ok=True)
    config = dict(c, architectures=["Qwen3ForCausalLM"], model_type="qwen3", tie_word_embeddings=True,
                  max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1000000.0, hidden_act="silu",
                  torch_dtype="bfloat16", eos_token_id=2, bos_token_id=1)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    shapes = checkpoint_shapes(c)
    header, offset = {}, 0
    for key, s in shapes.items():
        n = 2 * int(torch.tensor(s).prod())
        header[key] = {"dtype": "BF16", "shape": s, "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    g = torch.Generator().manual_seed(0)
    with open(os.path.join(directory, "model.safetensors"), "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for key, s in shapes.items():
            t = torch.ones(s) if key.endswith("norm.weight") else torch.randn(s, generator=g) * 0.02
            f.write(t.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    return os.path.getsize(os.path.join(directory, "model.safetensors"))


def head_loader_package(root: str, revision: str, every_module: bool = False) -> str:
    """`revision`'s models/ as package `models_head` under `root`: the safetensors loader's modules (their
    forward-only imports stubbed out), or `every_module` of it, as they are (the GGUF loader's imports; its
    absolute imports, specdec.kernels among them, resolve to this tree)."""
    package = os.path.join(root, "models_head")
    os.makedirs(package, exist_ok=True)
    names = BEFORE_MODULES
    if every_module:
        listing = subprocess.run(["git", "ls-tree", "--name-only", f"{revision}:models"], cwd=REPO,
                                 capture_output=True, text=True, check=True).stdout.split()
        names = [n[:-3] for n in listing if n.endswith(".py") and n != "__init__.py"]
    for name in names:
        text = subprocess.run(["git", "show", f"{revision}:models/{name}.py"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout
        if not every_module:  # an old revision's kernels imports, which this tree no longer has
            text = text.replace("from specdec.kernels.kv_append import kv_append", "kv_append = None")
            text = text.replace("from specdec.kernels.positions import StepPlan, step_plan",
                                "StepPlan = step_plan = None")
            text = text.replace("from specdec.kernels.positions import StepPlan", "StepPlan = None")
        with open(os.path.join(package, f"{name}.py"), "w") as f:
            f.write(text)
    open(os.path.join(package, "__init__.py"), "w").close()
    return root


def measure(loader: str, directory: str, dtype: str) -> dict:
    """In this (fresh) process: load once, report peak RSS at each stage and the resident memory once loaded
    (dtype `stored`: a GGUF's blocks as stored, load_model's default)."""
    import torch

    def peak_mib() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB

    if loader == "head":
        from models_head.loader import load_model
    else:
        from specdec.models import load_model
    import torch._dynamo  # noqa: F401  (load_state_dict pulls it in, and with it libtriton: not model memory)

    torch.ones(1).sum()
    baseline, baseline_rss = peak_mib(), resident_mib()
    t0 = time.perf_counter()
    model = load_model(directory, dtype=None if dtype == "stored" else dtype,
                       **({"check_weights": True} if loader == "check" else {}))
    load_s = time.perf_counter() - t0
    after_load, loaded_rss = peak_mib(), resident_mib()
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}  # a quantized model's blocks are buffers
    model_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    checksum = sum(float(chunk.double().sum()) for t in tensors.values()
                   for chunk in t.detach().reshape(-1).split(1 << 22))  # reads every weight once; 32 MiB temporaries
    after_touch = peak_mib()
    return {"loader": loader, "dtype": dtype, "baseline_mib": baseline, "baseline_rss_mib": baseline_rss,
            "after_load_mib": after_load, "loaded_rss_mib": loaded_rss, "after_touch_mib": after_touch,
            "model_mib": model_bytes / 2**20, "load_s": load_s, "checksum": checksum,
            "check_s": getattr(model, "weights_check_s", None)}


def resident_mib() -> float:
    """This process's resident memory now (VmRSS), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b", help="the random checkpoint's shape")
    p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "specdec-loader-memory"),
                   help="where the checkpoint is built")
    p.add_argument("--dtypes", default=None, help="comma-separated load dtypes (default bfloat16,float32; with "
                   "--gguf stored); 'stored': a GGUF's blocks as the file has them (load_model's CPU default)")
    p.add_argument("--repeats", type=int, default=2, help="measurements per (loader, dtype), interleaved")
    p.add_argument("--loaders", default=None, help="comma-separated (default head,now; with --gguf now): head = "
                   "the loader of --before, now = this tree's, check = this tree's with check_weights=True (the "
                   "NaN/inf scan, timed)")
    p.add_argument("--before", default="5fd8984", help="git revision whose loader is 'head'")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint")
    p.add_argument("--reuse", action="store_true", help="use the checkpoint a --keep run left in --dir")
    p.add_argument("--gguf", default=None, metavar="FILE",
                   help="measure loading this .gguf file (nothing built or deleted; 'head' runs --before's models/)")
    p.add_argument("--measure", nargs=3, metavar=("LOADER", "DIR", "DTYPE"), help=argparse.SUPPRESS)
    p.add_argument("--build", nargs=2, metavar=("DIR", "SHAPE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return
    if args.build:
        print(build_checkpoint(*args.build))
        return

    print("command: " + command_line("bench.loader_memory"))
    print(f"load average before: {os.getloadavg()}")
    if args.gguf:
        if not os.path.isfile(args.gguf):
            p.error(f"--gguf {args.gguf}: no such file")
        args.keep = True  # nothing of ours to delete
    args.loaders = args.loaders or ("now" if args.gguf else "head,now")
    args.dtypes = args.dtypes or ("stored" if args.gguf else "bfloat16,float32")
    ckpt = args.gguf or os.path.join(args.dir, args.shape)
    t0 = time.perf_counter()
    file = args.gguf or os.path.join(ckpt, "model.safetensors")
    if args.gguf or (args.reuse and os.path.exists(file)):
        build = [sys.executable, "-c", f"import os; print(os.path.getsize({file!r}))"]
    else:
        build = [sys.executable, "-m", "bench.loader_memory", "--build", ckpt, args.shape]
    # in a subprocess, like every measurement: Linux carries a process's peak RSS (ru_maxrss) into the children
    # it forks, so this driver must stay small (it never imports torch)
    size = int(subprocess.run(build, cwd=REPO, capture_output=True, text=True, check=True).stdout.split()[-1])
    print(f"{'using' if args.gguf else 'built'} {ckpt}: {os.path.basename(file)} {size / 2**30:.2f} GiB in "
          f"{time.perf_counter() - t0:.0f} s")
    pkg_root = os.path.join(tempfile.mkdtemp(prefix="specdec-loader-head-"), "head")  # --before's models/
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=pkg_root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    results = []
    try:
        if "head" in args.loaders.split(","):
            head_loader_package(pkg_root, args.before, every_module=bool(args.gguf))
        for repeat in range(args.repeats):
            for dtype in args.dtypes.split(","):
                for loader in args.loaders.split(","):  # interleaved
                    command = [sys.executable, "-m", "bench.loader_memory", "--measure", loader, ckpt, dtype]
                    out = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, check=True).stdout
                    r = json.loads(out.strip().splitlines()[-1])
                    results.append(r)
                    scan = f", of which the NaN/inf scan {r['check_s']:.2f} s" if r["check_s"] is not None else ""
                    print(f"  repeat {repeat} {loader:5} {dtype:8}: baseline {r['baseline_mib']:.0f} MiB, peak after "
                          f"load {r['after_load_mib']:.0f} MiB, resident once loaded {r['loaded_rss_mib']:.0f} MiB, "
                          f"after reading all weights {r['after_touch_mib']:.0f} MiB, model {r['model_mib']:.0f} "
                          f"MiB, load {r['load_s']:.1f} s{scan}", flush=True)
    finally:
        shutil.rmtree(os.path.dirname(pkg_root), ignore_errors=True)
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)
    print(f"\nload average after: {os.getloadavg()}")

    def growth(rs, key):  # peak at `key` less the baseline: median MiB (x model, range)
        mib, model = [r[key] - r["baseline_mib"] for r in rs], rs[0]["model_mib"]
        return (f"{statistics.median(mib):.0f} ({statistics.median(mib) / model:.2f}×, range {min(mib) / model:.2f}–"
                f"{max(mib) / model:.2f})")

    groups = {(loader, dtype): [r for r in results if r["loader"] == loader and r["dtype"] == dtype]
              for dtype in args.dtypes.split(",") for loader in args.loaders.split(",")}
    print(md_table(["loader", "dtype", "model MiB", "peak after load − baseline (× model)",
                    "peak after reading weights − baseline (× model)", "load s"],
                   ([args.before if loader == "head" else loader, dtype, f"{rs[0]['model_mib']:.0f}",
                     growth(rs, "after_load_mib"), growth(rs, "after_touch_mib"),
                     f"{statistics.median(r['load_s'] for r in rs):.1f}"] for (loader, dtype), rs in groups.items())))
    if args.gguf:  # against the file: what loading it costs beyond the process it loads into
        file_mib = size / 2**20

        def of_file(rs, key, base):
            mib = [r[key] - r[base] for r in rs]
            return (f"{statistics.median(mib):.0f} ({statistics.median(mib) / file_mib:.2f}×, range "
                    f"{min(mib) / file_mib:.2f}–{max(mib) / file_mib:.2f})")

        print(f"\nagainst the file ({file_mib:.0f} MiB); baseline = after the imports, before load_model:")
        print(md_table(["loader", "dtype", "baseline MiB", "peak while loading MiB", "resident once loaded MiB",
                        "peak − baseline (× file)", "resident once loaded − baseline (× file)"],
                       ([args.before if loader == "head" else loader, dtype,
                         f"{statistics.median(r['baseline_mib'] for r in rs):.0f}",
                         f"{statistics.median(r['after_load_mib'] for r in rs):.0f}",
                         f"{statistics.median(r['loaded_rss_mib'] for r in rs):.0f}",
                         of_file(rs, "after_load_mib", "baseline_mib"),
                         of_file(rs, "loaded_rss_mib", "baseline_rss_mib")]
                        for (loader, dtype), rs in groups.items())))
    for dtype in args.dtypes.split(","):
        sums = {r["loader"]: f"{r['checksum']:.6g}" for r in results if r["dtype"] == dtype}
        print(f"sum of all weights, {dtype}: {sums}")


if __name__ == "__main__":
    main()
