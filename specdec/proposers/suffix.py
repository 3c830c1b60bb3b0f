"""Suffix decoding ("suffix"; SuffixDecoding, Oliaro et al., NeurIPS 2025): drafts from suffix tries.

Two tries are searched for each row, and the better proposal wins:
- the row's own: every substring (up to `depth` tokens) of its prompt + output, counted, extended by the
  tokens it gained since the last step (O(new tokens x depth));
- the global store (`SuffixStore`): the same over the outputs of recent finished requests, bounded in
  tokens, shared by every row of an Engine and by every request of a server (its own lock).

A proposal: the longest suffix of the row's sequence that occurs in the trie (at most depth - k_max
tokens, so that a continuation fits), then the most frequent continuation token after token, while the
product of their frequencies (count of the child over the counts of all children) stays at or above
`min_token_prob`, for at most `max_spec_factor` x the match length tokens. The draft length therefore
adapts per row: long where a pattern recurs, zero where nothing matches. The score of a proposal (its
expected accepted tokens, the sum of those products) picks between the two tries.

What the store keeps: token ids of finished requests' outputs (never prompts), the oldest dropped first
once `max_tokens` is exceeded. Drafts from it can only speed up or not: the target verifies every token,
so no output changes; but timing could reveal whether another request produced a pattern, so a
multi-tenant server that must rule that out turns it off (`suffix_store_tokens=0`, `--suffix-store-tokens
0`): each request then drafts from its own text only.
"""
from __future__ import annotations

import math
import threading
from collections import deque

from .base import LookupProposer, tokens_since


class Node:
    __slots__ = ("count", "children")

    def __init__(self):
        self.count = 0
        self.children: dict[int, Node] = {}


class SuffixTrie:
    """Occurrence counts of every substring, up to `depth` tokens long, of the sequences added."""

    def __init__(self, depth: int):
        self.depth = depth
        self.root = Node()

    def add(self, tokens: list[int], active: list[Node] | None = None) -> list[Node]:
        """Count the substrings ending at each of `tokens`. `active`: the nodes of the suffixes (lengths 1,
        2, ..) ending just before them, when the tokens continue a sequence added earlier. Returns the
        nodes of the suffixes ending at the last token (pass them to continue the sequence)."""
        active = active or []
        for t in tokens:
            grown = []
            for node in [self.root] + active[: self.depth - 1]:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = Node()
                child.count += 1
                grown.append(child)
            active = grown
        return active

    def remove(self, tokens: list[int]) -> None:
        """Uncount a sequence added earlier (with `add` from an empty `active`)."""
        for i in range(len(tokens)):
            node = self.root
            for t in tokens[i: i + self.depth]:
                child = node.children[t]
                child.count -= 1
                if child.count == 0:  # no occurrence left below: the whole subtree goes
                    del node.children[t]
                    break
                node = child

    def match(self, seq: list[int], longest: int) -> tuple[Node | None, int]:
        """The node of the longest suffix of `seq` (at most `longest` tokens) that occurs followed by some
        token, and its length (a row's own trie holds the suffix itself too, at the end, with nothing after)."""
        found, m = None, 0
        for n in range(1, min(longest, len(seq)) + 1):
            node = self.root
            for t in seq[len(seq) - n:]:
                node = node.children.get(t)
                if node is None:
                    return found, m  # a longer suffix contains this one: none occurs either
            if not node.children:
                return found, m  # nor is a longer one followed by anything
            found, m = node, n
        return found, m

    def continuation(self, seq: list[int], k: int, max_spec_factor: float, min_token_prob: float,
                     ) -> tuple[list[int], float]:
        """The most frequent continuation of seq's longest occurring suffix, and its score (expected
        accepted tokens: the sum of the running products of frequencies)."""
        node, m = self.match(seq, self.depth - k)
        tokens, prob, score = [], 1.0, 0.0
        if node is None:
            return tokens, score
        limit = min(k, max(1, math.ceil(max_spec_factor * m)))
        while len(tokens) < limit and node.children:
            total = sum(c.count for c in node.children.values())
            token, child = max(node.children.items(), key=lambda item: item[1].count)
            prob *= child.count / total
            if prob < min_token_prob:
                break
            tokens.append(token)
            score += prob
            node = child
        return tokens, score


class SuffixStore:
    """The cross-request part: a suffix trie over recent finished requests' outputs, at most `max_tokens`
    tokens (oldest dropped first). Safe to share between threads (Engines, the server's requests)."""

    def __init__(self, max_tokens: int = 16384, depth: int = 24):
        if max_tokens < 0:
            raise ValueError(f"suffix store size must be >= 0 tokens, got {max_tokens}")
        self.max_tokens = max_tokens
        self.trie = SuffixTrie(depth)
        self.outputs: deque[list[int]] = deque()
        self.tokens = 0
        self.lock = threading.Lock()

    def add(self, output: list[int]) -> None:
        if not output or self.max_tokens == 0:
            return
        output = list(output[-self.max_tokens:])
        with self.lock:
            self.trie.add(output)
            self.outputs.append(output)
            self.tokens += len(output)
            while self.tokens > self.max_tokens:
                old = self.outputs.popleft()
                self.trie.remove(old)
                self.tokens -= len(old)

    def clear(self) -> None:
        """Forget every stored output."""
        with self.lock:
            self.trie = SuffixTrie(self.trie.depth)
            self.outputs.clear()
            self.tokens = 0

    def continuation(self, seq, k, max_spec_factor, min_token_prob) -> tuple[list[int], float]:
        with self.lock:
            return self.trie.continuation(seq, k, max_spec_factor, min_token_prob)


class RowTrie:
    """One row's suffix trie, with its sequence so far and the nodes of the suffixes it ends with."""

    def __init__(self, depth: int):
        self.trie = SuffixTrie(depth)
        self.seq: list[int] = []
        self.active: list[Node] = []

    def extend(self, tokens: list[int]) -> None:
        self.seq.extend(tokens)
        self.active = self.trie.add(tokens, self.active)


class SuffixProposer(LookupProposer):
    """Suffix-decoding drafts per row (module docstring); `store` None: each row drafts from its own text."""

    name = "suffix"

    def __init__(self, store: SuffixStore | None = None, depth: int = 24, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1):
        super().__init__()
        if depth < 2:
            raise ValueError(f"suffix trie depth must be >= 2, got {depth}")
        self.store = store
        self.depth = depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob

    def drafts(self, request, k_max: int) -> list[int]:
        row = self.rows.get(request.key)
        if row is None:
            row = self.rows[request.key] = RowTrie(self.depth)
        row.extend(tokens_since(request, len(row.seq)))
        k = min(k_max, self.depth - 1)
        seq = row.seq[-self.depth:]  # a match is at most depth - k tokens
        best, score = row.trie.continuation(seq, k, self.max_spec_factor, self.min_token_prob)
        if self.store is not None:
            shared, shared_score = self.store.continuation(seq, k, self.max_spec_factor, self.min_token_prob)
            if shared_score > score:
                best = shared
        return best

    def release(self, request) -> None:
        """A finished request's output joins the store (an aborted one's too: it is text the target wrote)."""
        super().release(request)
        if self.store is not None:
            self.store.add(request.output_ids)
