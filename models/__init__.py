"""specdec.models: our own minimal transformer for Llama/Vicuna, Qwen3 and GLM-4 HF checkpoints.

This top-level `models/` folder installs as `specdec.models` (setup.py's package_dir): import it as
`from specdec.models import load_model, load_tokenizer, KVCache`."""
from .cache import KVCache
from .config import ModelConfig
from .errors import CheckpointError
from .loader import load_model
from .transformer import Transformer


def load_tokenizer(path):
    """Load `tokenizer.model` (SentencePiece) or `tokenizer.json` from a checkpoint directory."""
    from .tokenizer import load_tokenizer as _load

    return _load(path)


__all__ = ["KVCache", "ModelConfig", "CheckpointError", "Transformer", "load_model", "load_tokenizer"]
