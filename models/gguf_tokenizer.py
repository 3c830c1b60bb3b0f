"""The tokenizer stored in a GGUF file's metadata, built with the `tokenizers` library.

A GGUF file has no tokenizer.json: it stores the vocabulary (`tokenizer.ggml.tokens`, with a type per
token), the merges (`tokenizer.ggml.merges`) or SentencePiece-style scores (`tokenizer.ggml.scores`),
the special token ids, `add_bos_token`/`add_eos_token` and the chat template. Two kinds are built:

* `gpt2` (byte-level BPE: SmolLM2, Llama 3, Qwen2/3): the tokens are already spelled in the byte-level
  alphabet. Text is split by the regex its `tokenizer.ggml.pre` names (llama.cpp's pre-tokenizer types;
  unknown names get GPT-2's, as transformers does), then mapped to that alphabet.
* `llama` (SentencePiece BPE: Llama 1/2, Mistral): "▁" for spaces, byte-fallback pieces `<0xNN>`, and
  merges from the file or, when it has none, derived from the scores (a token's merges rank by its score).

Control tokens (type 3: `<|im_start|>`, ...) become special added tokens, user-defined ones (type 4)
plain added tokens, so the text never splits them. What `encode` then gives is what transformers'
`AutoTokenizer.from_pretrained(dir, gguf_file=...)` gives (tests/test_real_model.py checks 2,000 strings).
`build_gguf_tokenizer` returns the `tokenizers` object and its tokenizer_config entries; models/tokenizer.py's
`load_tokenizer` wraps them in its `Tokenizer`, as it does for a checkpoint directory.
"""
from __future__ import annotations

import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers, processors

from .errors import CheckpointError
from .gguf import open_gguf

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types
TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores",
                    "tokenizer.ggml.token_type")

# llama.cpp pre-tokenizer names (tokenizer.ggml.pre) -> the regex that splits text before byte-level BPE
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZER_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
                        "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for themselves, the other 68
    bytes take the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def derived_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a token into two vocabulary tokens,
    ranked by the token's score (higher first), then by the ids of the two halves."""
    ids = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for token, score in zip(tokens, scores):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-score, ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _byte_level_bpe(tokens, merges, pre: str | None) -> tokenizers.Tokenizer:
    alphabet = byte_alphabet()
    spelled = set(alphabet.values())
    # a token spelled outside the byte alphabet (a control token with other characters) is respelled
    vocab = {(t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    tok = tokenizers.Tokenizer(models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges], fuse_unk=False,
                                          byte_fallback=False))
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's regex
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens, merges, scores, add_prefix_space: bool) -> tokenizers.Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges] if merges is not None else derived_merges(tokens, scores)
    unk = "<unk>" if "<unk>" in vocab else None
    tok = tokenizers.Tokenizer(models.BPE(vocab, pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    prepend = "first" if add_prefix_space else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_prefix_space else []))
    return tok


def _array_of(meta: dict, path: str, key: str, kind, length: int | None = None) -> list | None:
    """Metadata array `tokenizer.ggml.{key}` (None where absent), checked: a list of `kind` values (`length` of
    them where given); one line naming the file and the key otherwise."""
    value = meta.get(f"tokenizer.ggml.{key}")
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
        kinds = {str: "strings", int: "integers"}.get(kind, "numbers")
        raise CheckpointError(f"{path}: GGUF metadata tokenizer.ggml.{key} is not an array of {kinds}")
    if length is not None and len(value) != length:
        raise CheckpointError(f"{path}: GGUF metadata tokenizer.ggml.{key} has {len(value)} entries, but "
                              f"tokenizer.ggml.tokens has {length} tokens")
    return value


def build_gguf_tokenizer(path: str) -> tuple[tokenizers.Tokenizer, dict]:
    """The `tokenizers` object of GGUF file `path`, and its tokenizer_config.json entries (bos/eos/unk/pad
    token strings, chat_template, add_bos_token, add_eos_token). Metadata the `tokenizers` library refuses (a
    merge of tokens not in the vocabulary, ...) is one CheckpointError naming the file."""
    meta = open_gguf(path, arrays=TOKENIZER_ARRAYS).metadata
    try:
        return _build(path, meta)
    except CheckpointError:
        raise
    except Exception as err:  # the tokenizers library's own errors are plain Exceptions
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"{path}: cannot build the tokenizer from the GGUF metadata ({reason})") from None


def _build(path: str, meta: dict) -> tuple[tokenizers.Tokenizer, dict]:
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise CheckpointError(f"{path}: no tokenizer in the GGUF metadata (tokenizer.ggml.model / tokens)")
    tokens = _array_of(meta, path, "tokens", str)
    merges = _array_of(meta, path, "merges", str)
    scores = _array_of(meta, path, "scores", (int, float), len(tokens))
    types = _array_of(meta, path, "token_type", int, len(tokens)) or [1] * len(tokens)
    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{path}: GGUF metadata tokenizer.chat_template is not a string")
    if merges is not None and not all(" " in m for m in merges):
        bad = next(m for m in merges if " " not in m)
        raise CheckpointError(f"{path}: GGUF metadata tokenizer.ggml.merges holds {bad!r}, not two tokens "
                              f"separated by a space")
    if kind == "gpt2":
        if merges is None:
            raise CheckpointError(f"{path}: byte-level BPE tokenizer without tokenizer.ggml.merges")
        tok = _byte_level_bpe(tokens, merges, meta.get("tokenizer.ggml.pre"))
        add_bos_default = False
    elif kind == "llama":
        if merges is None and scores is None:
            raise CheckpointError(f"{path}: SentencePiece tokenizer without tokenizer.ggml.merges or scores")
        tok = _sentencepiece_bpe(tokens, merges, scores, bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
        add_bos_default = True  # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
    else:
        raise CheckpointError(f"{path}: GGUF tokenizer model {kind!r} is not supported (only 'gpt2' and 'llama')")
    spelled = set(byte_alphabet().values()) if kind == "gpt2" else None
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                            for t, kind_ in zip(tokens, types)
                            if kind_ == CONTROL and (spelled is None or set(t) <= spelled)])
    tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False)
                    for t, kind_ in zip(tokens, types) if kind_ == USER_DEFINED])

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    bos, eos = token("bos"), token("eos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
    specials = [(t, tok.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    tok.post_processor = processors.TemplateProcessing(single=" ".join(single), special_tokens=specials)
    cfg = {"bos_token": bos, "eos_token": eos, "unk_token": token("unknown"), "pad_token": token("padding"),
           "chat_template": meta.get("tokenizer.chat_template"), "add_bos_token": add_bos, "add_eos_token": add_eos}
    return tok, {k: v for k, v in cfg.items() if v is not None}
