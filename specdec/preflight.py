"""What can be refused (or warned about) from the checkpoints' files before any weights load: loading takes
seconds to minutes (a 1.5B GGUF ~10 s), and a refusal after it wastes them. Reads config.json
(models/config.py) or a GGUF header (models/gguf.py `open_gguf`, `config_from_metadata`), never a weight.

- `check_vocabularies(target, draft)`: a draft whose vocabulary differs from the target's, by the rules `LLM`
  applies after loading (its `_shared_vocab`): two tokenizers must be the same tokenizer; without two, the
  embeddings must have as many rows. Two GGUF files are compared by their token counts and BOS/EOS ids (the
  header only: reading the token strings of a 150k vocabulary costs ~0.8 s a file), an HF directory by its
  tokenizer files (the same bytes, else the loaded tokenizers' fingerprints). What this lets through (two
  GGUF tokenizers of one size whose pieces differ) `LLM` still refuses after loading.
- `check_max_tokens(max_tokens, k_max, target, draft, flag)`: an answer length no prompt can have within the
  models' context (`options.positions_needed` of a one-token prompt).
- `dtype_warning(dtype, device)`: the line to print when float16/bfloat16 runs on a CPU without native
  arithmetic for it.
"""
from __future__ import annotations

import filecmp
import os
from dataclasses import dataclass

from .options import LOOKUPS, positions_needed

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


@dataclass(frozen=True)
class Metadata:
    """What a checkpoint's files say without its weights."""

    path: str
    gguf: bool
    vocab_size: int  # embedding rows (config.json's vocab_size, the GGUF's)
    context: int  # max_position_embeddings (a GGUF's {arch}.context_length)
    tokens: int | None  # a GGUF's tokenizer: its token count (None: no tokenizer in the file)
    special: tuple  # a GGUF's (BOS id, EOS id)


def is_checkpoint(spec) -> bool:
    """Whether `spec` names checkpoint files this module reads: a path, not a lookup drafter's name, a model
    object or a feature draft (which borrows the target's embedding, vocabulary and all)."""
    if not isinstance(spec, (str, os.PathLike)) or os.fspath(spec) in LOOKUPS:
        return False
    from specdec.models.feature_draft import is_feature_draft

    return not is_feature_draft(spec)


def read_metadata(spec) -> Metadata:
    """The checkpoint's config from config.json or the GGUF header (CheckpointError naming the file)."""
    from specdec.models import is_gguf

    path = os.fspath(spec)
    if is_gguf(path):
        from specdec.models.gguf import config_from_metadata, open_gguf

        meta = open_gguf(path).metadata  # the header; long arrays are skipped, their lengths kept
        cfg = config_from_metadata(meta, path)
        tokens = meta.get("tokenizer.ggml.tokens")
        return Metadata(path, True, cfg.vocab_size, cfg.max_position_embeddings,
                        None if tokens is None else len(tokens),
                        (meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")))
    from specdec.models.config import ModelConfig

    cfg = ModelConfig.from_dir(path)
    return Metadata(path, False, cfg.vocab_size, cfg.max_position_embeddings, None, ())


def has_tokenizer(meta: Metadata) -> bool:
    if meta.gguf:
        return meta.tokens is not None
    return any(os.path.exists(os.path.join(meta.path, f)) for f in TOKENIZER_FILES)


def same_tokenizer_files(a: str, b: str) -> bool:
    """Whether two checkpoint directories hold byte-identical tokenizer files (then one tokenizer)."""
    names = [n for n in TOKENIZER_FILES if os.path.exists(os.path.join(a, n))]
    return bool(names) and all(os.path.exists(os.path.join(b, n)) and
                               filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False) for n in names)


def check_vocabularies(target, draft) -> None:
    """Refuse (CheckpointError) a draft checkpoint whose vocabulary is not the target's, from their files."""
    if draft is None or not is_checkpoint(target) or not is_checkpoint(draft):
        return
    from specdec.models import CheckpointError

    t, d = read_metadata(target), read_metadata(draft)
    if not (has_tokenizer(t) and has_tokenizer(d)):  # LLM's rule without two tokenizers: as many embedding rows
        if t.vocab_size != d.vocab_size:
            raise CheckpointError(
                f"draft {d.path} has a vocabulary of {d.vocab_size} ids and target {t.path} one of {t.vocab_size}, "
                f"and no tokenizers are available to show they agree; speculative decoding needs one vocabulary "
                f"(found from their config before loading any weights)")
        return
    if t.gguf and d.gguf:
        if (t.tokens, t.special) != (d.tokens, d.special):
            raise CheckpointError(
                f"draft {d.path} and target {t.path} have different tokenizers/vocabularies ({d.tokens} and "
                f"{t.tokens} tokens, BOS/EOS ids {list(d.special)} and {list(t.special)}); speculative decoding "
                f"needs one vocabulary (found from the files' metadata before loading any weights)")
        return
    if not t.gguf and not d.gguf and same_tokenizer_files(t.path, d.path):
        return
    from specdec.models import load_tokenizer

    t_tok, d_tok = load_tokenizer(t.path), load_tokenizer(d.path)
    if t_tok.fingerprint() != d_tok.fingerprint():
        raise CheckpointError(
            f"draft {d.path} and target {t.path} have different tokenizers/vocabularies (vocab sizes "
            f"{d_tok.vocab_size} and {t_tok.vocab_size}); speculative decoding needs one vocabulary (found from "
            f"their tokenizers before loading any weights)")


def context_length(target, draft=None) -> tuple[int, str] | None:
    """(positions, the file that sets them): the smaller context of the two checkpoints; None when neither
    is a checkpoint this module reads."""
    found = [(read_metadata(spec).context, os.fspath(spec)) for spec in (target, draft)
             if spec is not None and is_checkpoint(spec)]
    return min(found) if found else None


def check_max_tokens(max_tokens: int, k_max: int, target, draft=None, flag: str = "--max-tokens") -> None:
    """Refuse an answer length that no prompt (of one token or more) can have within the context, with the
    `k_max` drafts of a verify in flight after its last token."""
    found = context_length(target, draft)
    if found is None:
        return
    context, path = found
    if positions_needed(1, max_tokens, k_max) > context:
        most = context - positions_needed(1, 0, k_max)
        raise ValueError(f"{flag} {max_tokens}: the model's context is {context} positions ({path}), so an answer "
                         f"can have at most {most} new tokens (after a one-token prompt, with up to {k_max} drafts "
                         f"in flight); refused before loading any weights")


# --------------------------------------------------------------------------------------- float16 on a CPU
NATIVE_FLAGS = {"float16": ("avx512_fp16", "amx_fp16"), "bfloat16": ("avx512_bf16", "amx_bf16")}
# SmolLM2-135M-Instruct (the README's GGUF, --dtype dequantizing it), torch 2.13, one thread, on a Xeon with AMX
# limited to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2), against float32 in the same runs: a 128-token
# prefill 5.7-8.4x slower in float16 and 5.7-7.1x in bfloat16; a decode step 0.8-1.5x; an 8-token verify
# 1.2-1.6x. With AVX-512 FP16/BF16 and AMX (the same Xeon unrestricted): 0.4-1.2x (no slower).
MEASURED = "a 128-token prefill ran 6-8x slower than float32 and a decode step up to 1.5x slower"


def cpu_flags() -> set[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def dtype_warning(dtype, device) -> str | None:
    """The warning for `dtype` (float16/bfloat16) on a CPU device whose CPU has no native arithmetic for it;
    None otherwise."""
    name = str(dtype).removeprefix("torch.") if dtype is not None else None
    if name not in NATIVE_FLAGS or getattr(device, "type", str(device)) != "cpu":
        return None
    if cpu_flags() & set(NATIVE_FLAGS[name]):
        return None
    native = " or ".join(flag.upper().replace("_", "-") for flag in NATIVE_FLAGS[name])
    return (f"specdec: warning: --dtype {name} on a CPU without native {name} arithmetic ({native}) is slow: "
            f"in our measurement (SmolLM2-135M) {MEASURED}; float32 is faster here, and a quantized GGUF runs "
            f"fastest as stored (no --dtype)")
