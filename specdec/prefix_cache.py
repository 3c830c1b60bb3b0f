"""The prefix cache: the K/V (target and draft) and the target's hidden states (feature drafts) of token
sequences seen before, so that a newcomer whose prompt begins with one of them prefills only the rest.

A radix tree over token ids (SGLang's structure; docs/design.md, "Admitting a request", says why not hashed
blocks: `bench/prefix_cache.py` measured both). Each node holds one segment of tokens (the edge from its
parent) and, detached from any batch, that segment's

- `target` K/V `[L, 2, H_kv, n, D]` (a copy of the columns of one cache row),
- `draft` K/V `[L_d, 2, H_d, n, D_d]`, or None where the draft had not computed them (auto k deferred the
  draft's prefill; the draft lags the sequence), a node holding them for all its tokens or for none,
- `features` `[n, E]`: the target's last hidden state at each of its tokens (feature drafts only).

A sequence's prefix is the path from the root; a lookup walks it (token-exact: a match may end inside a
node, whose first columns are then copied) and copies each node's columns into the newcomer's cache row,
one slice copy per node and cache. A node is split (both halves copied, so that every node owns exactly
its bytes) where a new sequence leaves it. Memory is bounded: the bytes of every node's tensors never
exceed `budget_bytes`; to make room, the least recently used leaf goes first (a lookup that copies a path
and an insert that walks it mark the path used); a sequence that does not fit even then is stored only as
far as it fits. Safe to share between threads (one lock); an `LLM` has one, shared by its Engines.

What goes in: every prefill's prompt (so the next request that shares it, or the n choices of one request,
find it) and, when a request finishes, its prompt and output (so the next turn of a chat finds the answer
too): `store_row`. A lookup never matches the whole prompt: the last token must be fed to produce the
first token's logits.

Exactness: the K/V of a token depends only on (token, position, the tokens before it), but a matmul's
rounding depends on its shape: a prefix's K/V computed in a long prefill and in a short one (or in decoding
steps) can differ in the last bits, unless the models run batch-invariant (`batch_invariant=True`, and
every quantized target), where they are the same bits and generation with the cache equals generation
without it bit for bit (tests/test_prefix_cache.py).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from .options import GIB  # the budget's unit, declared with the option (re-exported)


def budget_bytes(gb: float) -> int:
    """A budget in GiB (checked > 0 by the option's rule, specdec/options.py) as bytes."""
    return int(gb * GIB)


class Node:
    __slots__ = ("tokens", "parent", "children", "target", "draft", "features", "used")

    def __init__(self, tokens: tuple, parent: "Node | None"):
        self.tokens = tokens  # the segment's token ids
        self.parent = parent
        self.children: dict[int, Node] = {}  # first token -> child
        self.target = None  # [L, 2, H_kv, n, D]
        self.draft = None  # [L_d, 2, H_d, n, D_d] or None
        self.features = None  # [n, E] or None
        self.used = 0  # LRU clock of the last lookup or insert through it

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.target, self.draft, self.features) if t is not None)


@dataclass
class Match:
    """A lookup's result: `parts` [(node, tokens used from its start)] along the path, `length` tokens in
    all (the target's prefix), `draft_length` <= length of them with the draft's K/V."""

    parts: list
    length: int
    draft_length: int


def _common(segment: tuple, tokens: list, pos: int) -> int:
    """How many of segment's tokens equal tokens[pos:]."""
    n = min(len(segment), len(tokens) - pos)
    if tuple(tokens[pos:pos + n]) == segment[:n]:
        return n
    i = 0
    while i < n and segment[i] == tokens[pos + i]:
        i += 1
    return i


def _cut(t, lo: int, hi: int | None = None):
    """Columns lo..hi of a node tensor (tokens on dim 3 for K/V, dim 0 for features), as an owned copy."""
    if t is None:
        return None
    return (t[:, :, :, lo:hi] if t.dim() == 5 else t[lo:hi]).clone()


class PrefixCache:
    """A radix tree of cached prefixes under a memory budget (module docstring)."""

    def __init__(self, budget: int):
        self.budget = int(budget)
        self.root = Node((), None)
        self.bytes = 0  # every node's tensors together: never above `budget`
        self.clock = 0
        self.lock = threading.RLock()
        # counters over the cache's life (Prometheus: specdec/serve/metrics.py)
        self.queried_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of them, found (the target's prefix)
        self.inserted_tokens = 0  # tokens stored (new segments)
        self.evictions = 0  # nodes evicted
        self.evicted_tokens = 0

    # ------------------------------------------------------------------------------------------ lookup
    def _walk(self, tokens: list[int], limit: int, features: bool) -> Match:
        node, pos, parts, draft, draft_open = self.root, 0, [], 0, True
        while pos < limit:
            child = node.children.get(tokens[pos])
            if child is None or (features and child.features is None):
                break
            n = _common(child.tokens, tokens[:limit], pos)
            parts.append((child, n))
            if draft_open and child.draft is not None:
                draft += n
            else:
                draft_open = False
            pos += n
            if n < len(child.tokens):
                break
            node = child
        return Match(parts, pos, draft)

    def peek(self, tokens: list[int], features: bool = False) -> tuple[int, int]:
        """The tokens of `tokens` a lookup would find (at most all but the last) for the target and for the
        draft, touching nothing."""
        with self.lock:
            match = self._walk(tokens, len(tokens) - 1, features)
            return match.length, match.draft_length

    def fetch(self, tokens: list[int], target, row: int, draft=None, features=None) -> tuple[int, int]:
        """Copy the longest cached prefix of `tokens` (all but the last token at most) into row `row` of the
        caches `target` and `draft` (KVCache, from column host_start[row]) and of `features` ([B, C, E] or
        None), and mark it used. Returns (target tokens, draft tokens) copied; the caches' lengths are the
        caller's to set."""
        with self.lock:
            match = self._walk(tokens, len(tokens) - 1, features is not None)
            self.queried_tokens += len(tokens)
            self.hit_tokens += match.length
            self.clock += 1
            pos = 0
            start_t = target.host_start[row]
            start_d = draft.host_start[row] if draft is not None else 0
            for node, n in match.parts:
                node.used = self.clock
                target.kv[:, :, row, :, start_t + pos:start_t + pos + n].copy_(node.target[:, :, :, :n])
                if draft is not None and pos < match.draft_length:
                    draft.kv[:, :, row, :, start_d + pos:start_d + pos + n].copy_(node.draft[:, :, :, :n])
                if features is not None:
                    features[row, pos:pos + n].copy_(node.features[:n])
                pos += n
            return match.length, match.draft_length

    # ------------------------------------------------------------------------------------------ insert
    def store_row(self, tokens: list[int], target, row: int, draft=None, features=None) -> None:
        """Store row `row`'s cached columns: the target's K/V of tokens[:target length] (all of `tokens` at
        most), the draft's of its (shorter) prefix, the features of the same tokens as the target's."""
        n = min(len(tokens), target.host_length[row])
        if n <= 0:
            return
        s = target.host_start[row]
        kv_t = target.kv[:, :, row, :, s:s + n]  # [L, 2, H_kv, n, D] view
        kv_d = None
        if draft is not None:
            nd = min(n, draft.host_length[row])
            sd = draft.host_start[row]
            kv_d = draft.kv[:, :, row, :, sd:sd + nd] if nd > 0 else None  # [L_d, 2, H_d, nd, D_d] view
        self.insert(tokens[:n], kv_t, kv_d, None if features is None else features[row, :n])

    def insert(self, tokens: list[int], target_kv, draft_kv=None, features=None) -> None:
        """Store the K/V of `tokens` (target_kv [L, 2, H_kv, n, D]; draft_kv of a prefix of them or None;
        features [n, E] or None), sharing the path already cached, within the budget."""
        n = len(tokens)
        nd = 0 if draft_kv is None else draft_kv.shape[3]
        per_token = self._token_bytes(target_kv, draft_kv, features)
        with self.lock:
            self.clock += 1
            node, pos, path = self.root, 0, {id(self.root)}
            while pos < n:
                child = node.children.get(tokens[pos])
                if child is None:
                    self._add_leaf(node, tokens, pos, n, nd, target_kv, draft_kv, features, per_token, path)
                    return
                common = _common(child.tokens, tokens, pos)
                if common < len(child.tokens) and pos + common < n:  # the sequence leaves this node: split it
                    self._split(child, common)
                    child = node.children[tokens[pos]]
                if child.draft is None and draft_kv is not None and nd > pos:
                    if nd - pos < len(child.tokens):  # the draft covers this node's head only: split there
                        self._split(child, nd - pos)
                        child = node.children[tokens[pos]]
                    path.add(id(child))
                    extra = draft_kv[:, :, :, pos:pos + len(child.tokens)]
                    if self._make_room(extra.numel() * extra.element_size(), path):
                        child.draft = extra.clone()
                        self.bytes += child.draft.numel() * child.draft.element_size()
                child.used = self.clock
                path.add(id(child))
                node, pos = child, pos + len(child.tokens)

    @staticmethod
    def _token_bytes(target_kv, draft_kv, features) -> tuple[int, int]:
        """(bytes per token without the draft, the draft's bytes per token)."""
        def per(t):
            return 0 if t is None else t.numel() * t.element_size() // max(1, t.shape[3] if t.dim() == 5 else t.shape[0])
        return per(target_kv) + per(features), per(draft_kv)

    def _add_leaf(self, parent: Node, tokens, pos, n, nd, target_kv, draft_kv, features, per_token, path) -> None:
        """New nodes for tokens[pos:n] under `parent`: one with the draft's K/V up to nd, one without after
        it; as many tokens as fit in the budget."""
        base, extra = per_token
        spans = [(pos, nd, True), (max(pos, nd), n, False)] if pos < nd < n else [(pos, n, pos < nd)]
        for lo, hi, with_draft in spans:
            if hi <= lo:
                continue
            each = base + (extra if with_draft else 0)
            fit = min(hi - lo, self._room_for(each, hi - lo, path))
            if fit <= 0:
                return
            hi = lo + fit
            leaf = Node(tuple(tokens[lo:hi]), parent)
            leaf.target = target_kv[:, :, :, lo:hi].clone()
            leaf.draft = draft_kv[:, :, :, lo:hi].clone() if with_draft else None
            leaf.features = None if features is None else features[lo:hi].clone()
            leaf.used = self.clock
            parent.children[tokens[lo]] = leaf
            self.bytes += leaf.bytes
            self.inserted_tokens += hi - lo
            path.add(id(leaf))
            parent = leaf
            if fit < hi - lo:
                return

    def _room_for(self, each: int, count: int, path) -> int:
        """Make room for `count` tokens of `each` bytes (evicting), or as many as can fit; returns how many."""
        if each <= 0:
            return count
        want = min(count, self.budget // each)
        while want > 0 and self.bytes + want * each > self.budget:
            if not self._evict_one(path):
                want = (self.budget - self.bytes) // each
                break
        return max(0, want)

    def _make_room(self, size: int, path) -> bool:
        while self.bytes + size > self.budget:
            if not self._evict_one(path):
                return False
        return True

    def _evict_one(self, keep) -> bool:
        """Drop the least recently used leaf not in `keep` (ids); False if there is none."""
        victim, stack = None, [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root and id(node) not in keep and (victim is None or node.used < victim.used):
                victim = node
        if victim is None:
            return False
        self.bytes -= victim.bytes
        self.evictions += 1
        self.evicted_tokens += len(victim.tokens)
        del victim.parent.children[victim.tokens[0]]
        victim.parent = None
        return True

    def _split(self, node: Node, at: int) -> None:
        """Cut `node` after `at` tokens: a new head node (its first `at` tokens) between it and its parent."""
        head = Node(node.tokens[:at], node.parent)
        head.target, node.target = _cut(node.target, 0, at), _cut(node.target, at)
        head.draft, node.draft = _cut(node.draft, 0, at), _cut(node.draft, at)
        head.features, node.features = _cut(node.features, 0, at), _cut(node.features, at)
        head.used = node.used
        node.parent.children[head.tokens[0]] = head
        node.tokens = node.tokens[at:]
        node.parent = head
        head.children[node.tokens[0]] = node

    # ------------------------------------------------------------------------------------------- state
    def clear(self) -> None:
        with self.lock:
            self.root = Node((), None)
            self.bytes = 0

    def nodes(self) -> list[Node]:
        """Every node but the root (tests, and the byte count's independent check)."""
        with self.lock:
            out, stack = [], list(self.root.children.values())
            while stack:
                node = stack.pop()
                out.append(node)
                stack.extend(node.children.values())
            return out

    def stats(self) -> dict:
        with self.lock:
            return {"bytes": self.bytes, "budget_bytes": self.budget, "queried_tokens": self.queried_tokens,
                    "hit_tokens": self.hit_tokens, "inserted_tokens": self.inserted_tokens,
                    "evictions": self.evictions, "evicted_tokens": self.evicted_tokens}


__all__ = ["GIB", "Match", "PrefixCache", "budget_bytes"]
