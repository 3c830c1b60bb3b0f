"""specdec.models: our own minimal transformer for Llama/Vicuna, Qwen3 and GLM-4 HF checkpoints, and for
llama.cpp GGUF files (llama, qwen2, qwen3; models/gguf.py).

This top-level `models/` folder installs as `specdec.models` (setup.py's package_dir): import it as
`from specdec.models import load_model, load_tokenizer, KVCache`."""
from .cache import KVCache
from .config import ModelConfig
from .errors import CheckpointError
from .loader import load_model
from .transformer import Transformer


def load_tokenizer(path):
    """Load `tokenizer.model` (SentencePiece) or `tokenizer.json` from a checkpoint directory, or the
    tokenizer in a `.gguf` file's metadata."""
    from .tokenizer import load_tokenizer as _load

    return _load(path)


def is_gguf(path) -> bool:
    """Whether `path` names a GGUF file (what load_model and load_tokenizer read as one)."""
    import os

    path = os.fspath(path)
    return path.endswith(".gguf") and not os.path.isdir(path)


__all__ = ["KVCache", "ModelConfig", "CheckpointError", "Transformer", "is_gguf", "load_model", "load_tokenizer"]
