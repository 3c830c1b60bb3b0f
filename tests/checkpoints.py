"""Tiny random HF checkpoints of each supported family, built with `transformers` and `save_pretrained`.

Weights are redrawn with a larger scale than HF's init so logits are peaked (greedy argmax is then far
from ties) and norm weights/biases are non-trivial (so parity really checks them).
"""
from __future__ import annotations

import torch

FAMILIES = ("llama", "qwen3", "glm4")


def hf_config(family: str, **overrides):
    from transformers import Glm4Config, LlamaConfig, Qwen3Config

    base = dict(vocab_size=131, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "llama":
        cls = LlamaConfig
    elif family == "qwen3":
        cls = Qwen3Config
        base.update(head_dim=24, tie_word_embeddings=True)  # head_dim != hidden / heads
    elif family == "glm4":
        cls = Glm4Config
        base.update(head_dim=16, attention_bias=True)
    else:
        raise ValueError(family)
    base.update(overrides)
    return cls(**base)


def randomize_(model, seed: int, scale: float = 0.15) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=g))


def build_hf_model(family: str, seed: int = 0, scale: float = 0.15, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, **overrides))
    randomize_(model, seed, scale)
    return model.eval()


def save_checkpoint(model, path, **save_kwargs) -> str:
    model.save_pretrained(str(path), **save_kwargs)
    return str(path)


def make_checkpoint(family: str, path, seed: int = 0, **overrides) -> str:
    return save_checkpoint(build_hf_model(family, seed, **overrides), path)


def make_pair(family: str, root, seed: int = 0, noise: float = 0.02, **overrides) -> tuple[str, str]:
    """A target checkpoint and a draft derived from it by perturbing every weight: the draft agrees with
    the target often but not always, so acceptance is partial and differs across rows."""
    import os

    target = build_hf_model(family, seed, **overrides)
    target_dir = save_checkpoint(target, os.path.join(str(root), f"{family}-target"))
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for p in target.parameters():
            p.add_(noise * p.std() * torch.randn(p.shape, generator=g))
    draft_dir = save_checkpoint(target, os.path.join(str(root), f"{family}-draft"))
    return target_dir, draft_dir


def write_wordlevel_tokenizer(path, words) -> None:
    """A `tokenizer.json` mapping each whitespace-separated word of `words` to its index."""
    import os

    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(str(path), "tokenizer.json"))
