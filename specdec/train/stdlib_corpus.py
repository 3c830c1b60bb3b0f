"""Data of the small draft (the default pair's recipe): the fixed stdlib file list (or the user's texts), the
tokenizer, token windows and the prompts."""
from __future__ import annotations

import ast
import io
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

EXCLUDED_DIRS = ("test", "tests", "idlelib", "lib2to3", "site-packages", "encodings", "pydoc_data")
UNK, BOS, EOS, PAD = 0, 1, 2, 3
SNAP_TOKENS = 64  # a window start moves to the next line start when one is this close
PROMPTS_HEADER = (
    "# Held-out prompts for specdec's default pair, written by bench/default_pair: one prompt per "
    "line; a newline inside a prompt is written as the two characters \\n (prompts never contain a real "
    "backslash); lines starting with # are comments."
)

SPM_SETTINGS = dict(
    model_type="bpe",
    vocab_size=4000,
    byte_fallback=True,
    split_digits=True,
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    add_dummy_prefix=False,
    allow_whitespace_only_pieces=True,
    split_by_whitespace=True,
    max_sentencepiece_length=16,
    character_coverage=0.9995,
    unk_id=UNK,
    bos_id=BOS,
    eos_id=EOS,
    pad_id=PAD,
    unk_piece="<unk>",
    bos_piece="<s>",
    eos_piece="</s>",
    pad_piece="<pad>",
    max_sentence_length=16384,
    input_sentence_size=0,
    shuffle_input_sentence=False,
)


# ------------------------------------------------------------------------------------------- files


def stdlib_files(root: Path) -> list[Path]:
    """The fixed list of stdlib sources (train + held out), sorted by relative path."""
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if set(rel.parts[:-1]) & set(EXCLUDED_DIRS):
            continue
        if rel.parts[0].startswith("config-") or path.name.startswith("_sysconfigdata"):
            continue  # build configuration, not library code
        files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def read_source(path: Path) -> str:
    text = path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
    return text if text.endswith("\n") or not text else text + "\n"


def truncate_at_line(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    cut = text.rfind("\n", 0, limit)
    return text[: cut + 1] if cut > 0 else text[:limit]


def per_file_cap(lengths: list[int], max_chars: int) -> int:
    """Largest cap c with sum(min(len, c)) <= max_chars ("water filling": big files are cut first)."""
    if sum(lengths) <= max_chars:
        return max(lengths, default=0)
    lo, hi = 0, max(lengths)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(min(n, mid) for n in lengths) <= max_chars:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass
class Corpus:
    root: Path
    files: list[Path]
    train_texts: list[str]  # capped per file
    held_texts: list[str]  # whole files
    file_cap: int
    total_chars: int

    @classmethod
    def load(cls, root: Path, holdout_every: int, max_chars: int) -> "Corpus":
        """Every `holdout_every`-th file (by sorted index) is held out; the rest is capped to `max_chars`."""
        files = stdlib_files(root)
        if not files:
            raise SystemExit(f"--stdlib {root}: no *.py files found")
        texts = [read_source(p) for p in files]
        train = [t for i, t in enumerate(texts) if i % holdout_every != 0]
        held = [t for i, t in enumerate(texts) if i % holdout_every == 0]
        cap = per_file_cap([len(t) for t in train], max_chars)
        return cls(root, files, [truncate_at_line(t, cap) for t in train], held, cap, sum(map(len, texts)))

    @classmethod
    def from_texts(cls, source: Path, texts: list[str], holdout_every: int, max_chars: int) -> "Corpus":
        """The user's texts (`--data`) in place of the stdlib's files, held out and capped the same way."""
        train = [t for i, t in enumerate(texts) if i % holdout_every != 0]
        held = [t for i, t in enumerate(texts) if i % holdout_every == 0]
        if not train:
            raise SystemExit(f"--data {source}: {len(texts)} text(s) leave none to train on after holding out "
                             f"every {holdout_every}th (give more texts or a larger --holdout-every)")
        cap = per_file_cap([len(t) for t in train], max_chars)
        return cls(source, [source] * len(texts), [truncate_at_line(t, cap) for t in train], held, cap,
                   sum(map(len, texts)))


# --------------------------------------------------------------------------------------- tokenizer


def train_tokenizer(train_texts: list[str], vocab_size: int, threads: int) -> bytes:
    """SentencePiece BPE on the non-blank lines of the training text; returns the serialized model."""
    import sentencepiece as spm

    lines = [line for text in train_texts for line in text.split("\n") if line.strip()]
    settings = dict(SPM_SETTINGS, vocab_size=vocab_size, num_threads=threads)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, minloglevel=2, **settings)
    return buf.getvalue()


def token_stream(sp, texts: list[str]) -> np.ndarray:
    """Each text's tokens followed by EOS, concatenated: [N] int32."""
    return np.array([t for text in texts for t in sp.encode(text) + [EOS]], dtype=np.int32)


# ----------------------------------------------------------------------------------------- windows


class Windows:
    """BOS + (ctx - 1) token windows over a token stream, one per (ctx - 1) stride, each start moved to the
    next line start when one is within SNAP_TOKENS; `batch` draws them in a seeded order reshuffled per epoch."""

    def __init__(self, stream: np.ndarray, newline_id: int, ctx: int, seed: int):
        self.stream, self.body = stream, ctx - 1
        line_starts = np.flatnonzero(stream == newline_id) + 1
        starts = []
        for s in range(0, len(stream) - self.body, self.body):
            j = np.searchsorted(line_starts, s)
            t = int(line_starts[j]) if j < len(line_starts) and line_starts[j] - s < SNAP_TOKENS else s
            if t + self.body <= len(stream):
                starts.append(t)
        self.starts = np.array(starts, dtype=np.int64)
        self.gen = torch.Generator().manual_seed(seed)
        self.order, self.pos, self.epoch = None, 0, 0

    def __len__(self) -> int:
        return len(self.starts)

    def row(self, start: int, length: int | None = None) -> np.ndarray:
        """BOS + the `length - 1` (default ctx - 1) tokens from `start`."""
        body = self.body if length is None else length - 1
        return np.concatenate([[BOS], self.stream[start: start + body]]).astype(np.int64)

    def batch(self, size: int) -> torch.Tensor:
        rows = []
        for _ in range(size):
            if self.order is None or self.pos >= len(self.order):
                self.order = torch.randperm(len(self.starts), generator=self.gen).numpy()
                self.pos, self.epoch = 0, self.epoch + 1
            rows.append(self.row(int(self.starts[self.order[self.pos]])))
            self.pos += 1
        return torch.from_numpy(np.stack(rows))  # [size, ctx]

    def evenly_spaced(self, count: int) -> list[np.ndarray]:
        """`count` windows spread evenly over the stream (deterministic; for evaluation)."""
        idx = np.linspace(0, len(self) - 1, num=min(count, len(self))).round().astype(int)
        return [self.row(int(self.starts[i])) for i in idx]


# ----------------------------------------------------------------------------------------- prompts


def extract_prompts(held_texts: list[str], count: int, max_chars: int = 200) -> list[str]:
    """Signature (<= 3 lines) + first docstring line of documented defs/classes, round-robin over the files."""
    per_file = []
    for text in held_texts:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            per_file.append([])
            continue
        lines = text.split("\n")
        found = []
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        for node in sorted(nodes, key=lambda n: n.lineno):
            body0 = node.body[0] if node.body else None
            if not (isinstance(body0, ast.Expr) and isinstance(body0.value, ast.Constant)
                    and isinstance(body0.value.value, str)):
                continue
            head = lines[node.lineno - 1: body0.lineno]  # def/class line(s) .. first docstring line
            if len(head) > 4 or len(head) < 2 or not head[-1].strip().strip("rRbBuU\"'"):
                continue
            snippet = textwrap.dedent("\n".join(head)).rstrip()
            if ("\\" in snippet or "\t" in snippet or len(snippet) > max_chars
                    or not snippet.startswith(("def ", "class ", "async def "))):
                continue
            found.append(snippet)
        per_file.append(found)
    prompts, depth = [], 0
    while len(prompts) < count and any(depth < len(f) for f in per_file):
        for found in per_file:
            if depth < len(found) and len(prompts) < count:
                prompts.append(found[depth])
        depth += 1
    return prompts


def write_prompts(path: Path, prompts: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(PROMPTS_HEADER + "\n")
        for p in prompts:
            f.write(p.replace("\n", "\\n") + "\n")
