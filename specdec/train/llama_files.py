"""The small draft's models: shapes, construction, and saving/loading as ordinary HF checkpoint directories."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .stdlib_corpus import BOS, EOS, PAD

ARCH_KEYS = ("hidden", "layers", "heads", "kv_heads", "ffn")

TOKENIZER_CONFIG = {
    "tokenizer_class": "LlamaTokenizer",
    "add_bos_token": True,
    "add_eos_token": False,
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "pad_token": "<pad>",
    "legacy": False,
    "add_prefix_space": False,
    "clean_up_tokenization_spaces": False,
    "model_max_length": 256,
}


def parse_arch(text: str) -> dict[str, int]:
    """'hidden=384,layers=8,heads=6,kv_heads=2,ffn=1024' -> dict; every key required, head_dim = hidden/heads."""
    try:
        arch = {k.strip(): int(v) for k, v in (item.split("=") for item in text.split(","))}
    except ValueError:
        raise ValueError(f"architecture {text!r}: expected key=int pairs separated by commas") from None
    if sorted(arch) != sorted(ARCH_KEYS):
        raise ValueError(f"architecture {text!r}: needs exactly the keys {', '.join(ARCH_KEYS)}")
    if arch["hidden"] % arch["heads"] or arch["heads"] % arch["kv_heads"]:
        raise ValueError(f"architecture {text!r}: hidden must divide by heads and heads by kv_heads")
    return arch


def arch_of(config) -> dict[str, int]:
    """The `parse_arch` dict of a LlamaConfig (a saved target's shape)."""
    return {"hidden": config.hidden_size, "layers": config.num_hidden_layers, "heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads, "ffn": config.intermediate_size}


def fingerprint_of(target_dir: Path) -> str:
    """The fingerprint specdec's shipped-draft lookup (specdec/drafts.py) matches a target by."""
    from specdec.models import load_model
    from specdec.models.feature_draft import fingerprint

    return fingerprint(load_model(str(target_dir), dtype="float32"))


def llama_config(arch: dict[str, int], vocab_size: int, ctx: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=arch["hidden"], intermediate_size=arch["ffn"],
        num_hidden_layers=arch["layers"], num_attention_heads=arch["heads"], num_key_value_heads=arch["kv_heads"],
        head_dim=arch["hidden"] // arch["heads"], max_position_embeddings=ctx, rms_norm_eps=1e-5, hidden_act="silu",
        attention_bias=False, mlp_bias=False, tie_word_embeddings=False, bos_token_id=BOS, eos_token_id=EOS,
        pad_token_id=PAD, initializer_range=0.02, attention_dropout=0.0)


def build_model(cfg, seed: int):
    """A freshly initialised float32 LlamaForCausalLM (transformers' default init, seeded)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).float()


def init_from_target(draft, target) -> int:
    """Copy into `draft` the target's token embedding, final norm, LM head and its first
    draft-layers decoder layers (the shapes must match: same hidden size, heads, KV heads and ffn). Returns the
    number of parameters copied."""
    d_cfg, t_cfg = draft.config, target.config
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")
    wrong = [k for k in keys if getattr(d_cfg, k) != getattr(t_cfg, k)]
    if wrong or d_cfg.num_hidden_layers > t_cfg.num_hidden_layers:
        raise ValueError(f"--draft-init target: the draft's {', '.join(wrong) or 'layer count'} differs from the "
                         f"target's (give --draft-arch the target's hidden, heads, kv_heads and ffn)")
    source = target.state_dict()
    copied = 0
    with torch.no_grad():
        for name, param in draft.named_parameters():  # every draft name exists in the target (layers 0..n-1)
            param.copy_(source[name].float())
            copied += param.numel()
    return copied


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def save_checkpoint(model, out: Path, tokenizer_model: bytes, target_fingerprint: str | None = None) -> None:
    """bfloat16 safetensors + config + generation config + tokenizer.model/.json; replaces `out`'s files. A
    draft's config also names its target's fingerprint (`target_fingerprint`, as the shipped drafts do)."""
    from transformers import AutoTokenizer, GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*"):
        if stale.is_file():
            stale.unlink()
    model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    model.save_pretrained(out, safe_serialization=True)
    model.float()
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dtype"] = cfg["torch_dtype"] = "bfloat16"  # older readers look for torch_dtype
    if target_fingerprint is not None:
        cfg["target_fingerprint"] = target_fingerprint
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "tokenizer.model").write_bytes(tokenizer_model)
    (out / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")
    special = {k: TOKENIZER_CONFIG[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    AutoTokenizer.from_pretrained(out).backend_tokenizer.save(str(out / "tokenizer.json"))  # for `tokenizers`
    for path in out.iterdir():
        path.chmod(0o644)


def load_saved(path: Path):
    """A saved (bfloat16) checkpoint, computed in float32."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def check_tokenizers(ckpt: Path, sp, texts: list[str]) -> dict:
    """sentencepiece, transformers and `tokenizers` must give the same ids, and decoding must round-trip."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(ckpt)
    raw = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    res = {"texts": len(texts), "spm_roundtrip": 0, "hf_ids_match": 0, "tokenizers_ids_match": 0, "hf_roundtrip": 0}
    for text in texts:
        ids = sp.encode(text)
        hf_ids = hf(text)["input_ids"]
        res["spm_roundtrip"] += sp.decode(ids) == text
        res["hf_ids_match"] += hf_ids == [BOS] + ids
        res["tokenizers_ids_match"] += raw.encode(text).ids == [BOS] + ids
        res["hf_roundtrip"] += hf.decode(hf_ids, skip_special_tokens=True) == text
    return res
