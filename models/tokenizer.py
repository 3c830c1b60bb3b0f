"""Tokenizers for HF checkpoint directories, without `transformers`.

`load_tokenizer(path)` reads the tokenizer of an HF checkpoint directory and mirrors what
`transformers.AutoTokenizer.from_pretrained(path)` (v5) does for it:

* Which file: `tokenizer.json` (through the `tokenizers` library) when it exists, else
  `tokenizer.model` (through `sentencepiece`). This is AutoTokenizer's order too: it builds its
  backend from `tokenizer.json` first and only converts `tokenizer.model` when there is none.
* BOS/EOS added by `encode`: for `tokenizer.json`, whatever its post_processor does (HF drops
  `add_bos_token`/`add_eos_token` from tokenizer_config.json in that case); for
  `tokenizer.model`, `add_bos_token` (default True, as LLaMA and the v4 slow tokenizer do;
  v5 defaults to False when the key is absent, but every Llama/Vicuna config sets it) and
  `add_eos_token` (default False).
* Llama-class tokenizers (`tokenizer.model`, or `tokenizer.json` with a Llama
  `tokenizer_class`) follow HF v5's LlamaTokenizer rather than raw sentencepiece: no
  normalizer; a "▁" is prepended only to the text chunk at offset 0 (`legacy=False`; every
  chunk with `legacy=True`; none with `add_prefix_space=False`) and *not* when the chunk
  already starts with a space, so " hi" encodes as "▁hi" where sentencepiece gives "▁▁hi";
  special/added token strings in the text ("<s>", "</s>", ...) are matched and encoded as their
  ids; decode drops exactly one leading space of the result.
* `clean_up_tokenization_spaces` is ignored: HF v5 ignores it for BPE models as well.
"""
from __future__ import annotations

import datetime
import functools
import hashlib
import json
import re
from pathlib import Path

import sentencepiece
import tokenizers
from tokenizers import decoders, pre_tokenizers

from .errors import CheckpointError
from .gguf_tokenizer import build_gguf_tokenizer

__all__ = ["Tokenizer", "load_tokenizer"]

_LLAMA_CLASSES = ("LlamaTokenizer", "LlamaTokenizerFast")
_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token")

# Appended to a serialized sentencepiece ModelProto. Protobuf merges a repeated message field into
# the earlier one, so this overrides normalizer_spec (field 3) with: precompiled_charsmap (2) = b""
# (identity normalization), add_dummy_prefix (3) = false, remove_extra_whitespaces (4) = false.
# HF v5 does no normalization for Llama; the "▁" prefix is added in Python by HF's rule instead.
_SP_RAW_NORMALIZER = b"\x1a\x06\x12\x00\x18\x00\x20\x00"


class Tokenizer:
    """A loaded checkpoint tokenizer; build it with `load_tokenizer`.

    vocab_size: number of ids the tokenizer can produce (max id + 1, added tokens included).
    eos_token_ids: every id that ends generation (config.json, generation_config.json, tokenizer).
    """

    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: frozenset[int]
    pad_token_id: int | None
    add_bos: bool
    chat_template: str | None
    path: str

    def __init__(self, path: str, cfg: dict, model_eos=(), *, sp=None, tok=None, prepend="first", strip_space=True):
        """Use `load_tokenizer`. `cfg`: tokenizer_config.json; `model_eos`: the configs' eos ids."""
        self.path = path
        self._sp, self._tok = sp, tok  # exactly one is set
        self._prepend, self._strip_space = prepend, strip_space  # sentencepiece path only
        self._add_eos = False
        self._added: dict[str, int] = {}  # sentencepiece path: text matched before segmentation
        self._special: set[int] = set()  # sentencepiece path: ids that skip_special_tokens drops
        self._template = None
        self._byte_level: bool | None = None  # the decoder maps byte-level BPE pieces (token_bytes; found once)
        self.chat_template = _chat_template(Path(path), cfg)
        self._special_text = {k: s for k in _NAMED_SPECIALS if (s := _token_text(cfg.get(k))) is not None}
        # Unnamed special tokens: "additional_special_tokens" (v4) / "extra_special_tokens" (v5).
        extra = []
        for key in ("additional_special_tokens", "extra_special_tokens"):
            value = cfg.get(key) or []
            extra += [t for t in map(_token_text, value.values() if isinstance(value, dict) else value) if t]

        if sp is not None:
            self._pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
            # Control and unknown pieces (<s>, </s>, <unk>) behave as HF's special added tokens.
            for i, piece in enumerate(self._pieces):
                if sp.is_control(i) or sp.is_unknown(i):
                    self._added[piece] = i
                    self._special.add(i)
            defaults = {"bos_token": sp.bos_id(), "eos_token": sp.eos_id(), "unk_token": sp.unk_id()}
            for key, i in defaults.items():
                if key not in cfg and i >= 0:
                    self._special_text[key] = sp.id_to_piece(i)
            for i, entry in (cfg.get("added_tokens_decoder") or {}).items():
                content = _token_text(entry)
                if content is not None:
                    self._added[content] = int(i)
                    if not isinstance(entry, dict) or entry.get("special", True):
                        self._special.add(int(i))
            for text in [*self._special_text.values(), *extra]:
                if (i := self.token_to_id(text)) is not None:
                    self._added[text] = i
                    self._special.add(i)
            # Longest first, so that the alternation matches the longest token at a position.
            alts = sorted(self._added, key=len, reverse=True)
            self._added_re = re.compile("|".join(map(re.escape, alts))) if alts else None
            self._id_to_added = {i: s for s, i in self._added.items()}
            self.add_bos = bool(cfg.get("add_bos_token", True))
            self._add_eos = bool(cfg.get("add_eos_token", False))
            size = max([len(self._pieces) - 1, *self._added.values()]) + 1
        else:
            # HF registers the config's named special tokens as special added tokens (a token already
            # in the vocabulary keeps its id).
            names = [*self._special_text.values(), *extra]
            tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in names])
            size = max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self.vocab_size = size

        self.bos_token_id = self.token_to_id(self._special_text.get("bos_token"))
        if tok is not None:  # the post_processor decides; see whether it puts BOS first
            self.add_bos = self.bos_token_id is not None and tok.encode("").ids[:1] == [self.bos_token_id]
        self.pad_token_id = self.token_to_id(self._special_text.get("pad_token"))
        self._eos_id = self.token_to_id(self._special_text.get("eos_token"))
        self.eos_token_ids = frozenset({*model_eos, *([] if self._eos_id is None else [self._eos_id])})

    # -- encode / decode ------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with BOS (and EOS) where the checkpoint adds them."""
        if self._tok is not None:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        ids: list[int] = []
        pos = 0
        for m in self._added_re.finditer(text) if self._added_re else ():
            ids += self._encode_chunk(text[pos : m.start()], at_start=pos == 0)
            ids.append(self._added[m.group()])
            pos = m.end()
        ids += self._encode_chunk(text[pos:], at_start=pos == 0)
        if add_special_tokens:
            if self.add_bos and self.bos_token_id is not None:
                ids.insert(0, self.bos_token_id)
            if self._add_eos and self._eos_id is not None:
                ids.append(self._eos_id)
        return ids

    def _encode_chunk(self, chunk: str, at_start: bool) -> list[int]:
        # HF's Metaspace(prepend_scheme, split=False): prepend "▁" unless the chunk already starts
        # with one (a space becomes "▁"), so leading spaces are not doubled as in sentencepiece.
        if not chunk:
            return []
        if self._prepend == "always" or (self._prepend == "first" and at_start):
            if not chunk.startswith((" ", "▁")):
                chunk = " " + chunk
        return self._sp.encode(chunk)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of `ids` (any iterable of ints); special tokens dropped unless asked for."""
        ids = [int(i) for i in ids]
        if self._tok is not None:
            return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        # Built from sentencepiece's pieces through HF's decoder chain, not sp.decode(): the two
        # differ on broken UTF-8 (HF turns a whole run of byte pieces into U+FFFD per byte).
        tokens = []
        for i in ids:
            if i in self._id_to_added:
                if not (skip_special_tokens and i in self._special):
                    tokens.append(self._id_to_added[i])
            elif 0 <= i < len(self._pieces):  # unknown ids are ignored, as HF does
                tokens.append(self._pieces[i])
        return _llama_decode(tokens, self._strip_space)

    def token_bytes(self, i: int) -> bytes:
        """The bytes token `i` stands for in a text (UTF-8; a byte-level or byte-fallback token may hold part
        of a character; a "▁" piece's space is kept, as in the middle of a text). b"" for an unknown id."""
        i = int(i)
        if self._tok is not None:
            piece = self._tok.id_to_token(i)
            if piece is None:
                return b""
            if self._byte_level is None:
                self._byte_level = _decoder_types(self._tok.decoder) & {"ByteLevel"} != set()
            if self._byte_level and i not in self._tok.get_added_tokens_decoder():
                alphabet = _byte_level_alphabet()
                if all(c in alphabet for c in piece):
                    return bytes(alphabet[c] for c in piece)
                return piece.encode()
        elif i in self._id_to_added:
            return self._id_to_added[i].encode()
        elif 0 <= i < len(self._pieces):
            piece = self._pieces[i]
        else:
            return b""
        if m := _BYTE_PIECE.fullmatch(piece):
            return bytes([int(m[1], 16)])
        return piece.replace("▁", " ").encode()

    def token_to_id(self, token: str | None) -> int | None:
        """Id of one token string (a piece or an added token), or None."""
        if token is None:
            return None
        if self._tok is not None:
            return self._tok.token_to_id(token)
        if token in self._added:
            return self._added[token]
        i = self._sp.piece_to_id(token)
        return i if self._sp.id_to_piece(i) == token else None

    # -- identity / chat ------------------------------------------------------------------------

    def fingerprint(self) -> str:
        """sha256 hex over every (piece, id) pair and the special ids; equal for equal vocabularies."""
        if self._tok is not None:
            pairs = sorted(self._tok.get_vocab(with_added_tokens=True).items(), key=lambda p: (p[1], p[0]))
        else:
            pairs = list(zip(self._pieces, range(len(self._pieces))))
            pairs += sorted((s, i) for s, i in self._added.items() if i >= len(self._pieces))
        h = hashlib.sha256()
        for piece, i in pairs:
            h.update(json.dumps([piece, i], ensure_ascii=False).encode() + b"\n")
        special = {"bos": self.bos_token_id, "eos": sorted(self.eos_token_ids), "pad": self.pad_token_id}
        h.update(json.dumps(special, sort_keys=True).encode())
        return h.hexdigest()

    def set_chat_template(self, source: str | None) -> None:
        """Replace the chat template (Jinja source; None: no template); compiled on first use."""
        self.chat_template, self._template = source, None

    def apply_chat_template(self, messages: list[dict]) -> str:
        """Render `chat_template` as HF does, with add_generation_prompt=True; returns the prompt text."""
        if self.chat_template is None:
            raise CheckpointError(f"{self.path}: the tokenizer has no chat_template")
        if self._template is None:
            self._template = _compile_template(self.chat_template, self.path)
        try:
            return self._template.render(
                messages=messages, tools=None, documents=None, add_generation_prompt=True, **self._special_text
            )
        except Exception as e:  # raise_exception(), undefined names, sandbox refusals, errors in filters...
            detail = " ".join(str(e).split()) or "no message"
            raise CheckpointError(
                f"{self.path}: chat_template failed to render ({type(e).__name__}: {detail})") from None

    def __repr__(self) -> str:
        kind = "sentencepiece" if self._sp is not None else "tokenizers"
        return f"Tokenizer({self.path!r}, {kind}, vocab_size={self.vocab_size})"


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_types(decoder) -> set[str]:
    """The kinds of step in a `tokenizers` decoder ("ByteLevel", "Replace", ...), nested ones included."""
    if decoder is None:
        return set()
    found: set[str] = set()

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("type"), str):
                found.add(node["type"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(decoder.__getstate__()))
    return found


@functools.lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (the inverse of `gguf_tokenizer.byte_alphabet`)."""
    from .gguf_tokenizer import byte_alphabet

    return {c: b for b, c in byte_alphabet().items()}


def _llama_decode(tokens: list[str], strip_space: bool) -> str:
    """HF's Llama decoder: Replace("▁", " "), ByteFallback, Fuse, then Strip(" ", 1, 0) if asked."""
    parts: list[str] = []
    pending = bytearray()  # a run of byte pieces: valid UTF-8 as a whole, or U+FFFD per byte

    def flush():
        if pending:
            try:
                parts.append(pending.decode("utf-8"))
            except UnicodeDecodeError:
                parts.append("\ufffd" * len(pending))
            pending.clear()

    for token in tokens:
        if m := _BYTE_PIECE.fullmatch(token):
            pending.append(int(m[1], 16))
        else:
            flush()
            parts.append(token.replace("▁", " "))
    flush()
    text = "".join(parts)
    return text[1:] if strip_space and text.startswith(" ") else text


def _compile_template(source: str, path: str):
    # The same sandboxed environment, filters and globals as transformers' chat template rendering.
    try:
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise CheckpointError(f"{path}: apply_chat_template needs jinja2 (pip install jinja2)") from e

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise CheckpointError(f"{path}: chat_template does not parse: {' '.join(str(e).split())}") from e


# -- loading -------------------------------------------------------------------------------------


def load_tokenizer(path) -> Tokenizer:
    """Load the tokenizer of the HF checkpoint directory `path` (or of a `.gguf` file, from its metadata:
    models/gguf_tokenizer.py); raises CheckpointError naming the path."""
    root = Path(path)
    if root.suffix == ".gguf" and not root.is_dir():
        tok, cfg = build_gguf_tokenizer(str(root))
        return Tokenizer(str(root), cfg, (), tok=tok)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint directory")
    cfg = _read_json(root / "tokenizer_config.json")
    if "added_tokens_decoder" not in cfg:  # HF reads special_tokens_map.json only in this case
        cfg.update(_read_json(root / "special_tokens_map.json"))

    # EOS from the model: config.json and generation_config.json, each an int or a list.
    model_eos = set()
    for name in ("config.json", "generation_config.json"):
        value = _read_json(root / name).get("eos_token_id")
        model_eos.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))

    # Llama-style settings (HF v5 LlamaTokenizer): where "▁" is prepended, and decode's strip.
    add_prefix_space = cfg.get("add_prefix_space")
    add_prefix_space = True if add_prefix_space is None else bool(add_prefix_space)
    prepend = ("always" if cfg.get("legacy") else "first") if add_prefix_space else "never"

    json_file, model_file = root / "tokenizer.json", root / "tokenizer.model"
    if json_file.is_file():
        try:
            tok = tokenizers.Tokenizer.from_file(str(json_file))
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise CheckpointError(f"{json_file}: cannot read tokenizer.json: {e}") from e
        if cfg.get("tokenizer_class") in _LLAMA_CLASSES:
            # HF rebuilds Llama tokenizers around the file's vocab and merges with its own pipeline.
            tok.normalizer = None
            tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend, split=False)
            steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
            tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_prefix_space else []))
        return Tokenizer(str(root), cfg, model_eos, tok=tok)
    elif model_file.is_file():
        try:
            proto = model_file.read_bytes()
            sentencepiece.SentencePieceProcessor(model_proto=proto)  # validate the file as it is
            sp = sentencepiece.SentencePieceProcessor(model_proto=proto + _SP_RAW_NORMALIZER)
        except Exception as e:  # sentencepiece raises RuntimeError/OSError (and others) on bad files
            raise CheckpointError(f"{model_file}: cannot read sentencepiece model: {e}") from e
        if sp.get_piece_size() == 0:
            raise CheckpointError(f"{model_file}: sentencepiece model has no pieces")
        return Tokenizer(str(root), cfg, model_eos, sp=sp, prepend=prepend, strip_space=add_prefix_space)
    raise CheckpointError(f"{root}: no tokenizer.json or tokenizer.model in the checkpoint directory")


def _read_json(file: Path) -> dict:
    """The JSON object in `file`, or {} when the file does not exist."""
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: cannot parse JSON: {e}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value) -> str | None:
    """A token as tokenizer_config.json writes it: a string, or a dict with "content" (AddedToken)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(root: Path, cfg: dict) -> str | None:
    # chat_template.jinja wins over tokenizer_config.json, as in HF; a list of named templates
    # (old format) gives its "default" one.
    file = root / "chat_template.jinja"
    if file.is_file():
        try:
            return file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file}: cannot read chat template: {e}") from e
    template = cfg.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None
