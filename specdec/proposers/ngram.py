"""Prompt lookup ("ngram"): propose what followed the latest earlier occurrence of the row's last n tokens
in its own prompt + output, for the longest n in ngram_max..ngram_min that occurs (transformers'
`prompt_lookup_num_tokens`, llama.cpp's lookup decoding, vLLM's `ngram`).

Each row keeps an incremental index, n-gram -> the position after its latest occurrence that has a
continuation, extended by the tokens the row gained since the last step: a step costs O(new tokens x
n-gram sizes) dictionary updates and (ngram_max - ngram_min + 1) lookups, never a rescan of the sequence.
"""
from __future__ import annotations

from .base import LookupProposer, tokens_since


class NgramIndex:
    """The n-grams (ngram_min <= n <= ngram_max) of one growing sequence, each mapped to the index that
    follows its latest occurrence whose continuation exists (so the current suffix never finds itself)."""

    def __init__(self, ngram_min: int, ngram_max: int):
        self.sizes = range(ngram_max, ngram_min - 1, -1)  # longest first
        self.seq: list[int] = []  # the row's sequence as far as indexed
        self.after: dict[tuple, int] = {}  # n-gram -> e: seq[e - n:e] is the n-gram, seq[e] what followed

    def extend(self, tokens: list[int]) -> None:
        """Append tokens; index every n-gram that now has a continuation (ending at e <= len(seq) - 1)."""
        seq = self.seq
        start = max(len(seq), 1)
        seq.extend(tokens)
        for e in range(start, len(seq)):
            for n in self.sizes:
                if n <= e:
                    self.after[tuple(seq[e - n:e])] = e

    def lookup(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest matching n-gram's latest occurrence (none: [])."""
        seq = self.seq
        for n in self.sizes:
            if n > len(seq):
                continue
            e = self.after.get(tuple(seq[len(seq) - n:]))
            if e is not None:
                return seq[e:e + k]
        return []


class NgramProposer(LookupProposer):
    """Prompt-lookup drafts per row; a row with no match offers none."""

    name = "ngram"

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4):
        super().__init__()
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"ngram sizes must satisfy 1 <= ngram_min <= ngram_max, got {ngram_min} and {ngram_max}")
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def drafts(self, request, k_max: int) -> list[int]:
        index = self.rows.get(request.key)
        if index is None:
            index = self.rows[request.key] = NgramIndex(self.ngram_min, self.ngram_max)
        index.extend(tokens_since(request, len(index.seq)))
        return index.lookup(k_max)
