"""Errors raised for bad checkpoints, tokenizers and arguments: each names the file, key or argument."""


class CheckpointError(ValueError):
    """A checkpoint directory, config key, weight file or tokenizer is missing, malformed or unsupported."""
