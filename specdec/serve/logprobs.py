"""The engine's per-token log-probabilities (`specdec.logprobs.TokenLogprob`) in OpenAI's two shapes:
completions' `{tokens, token_logprobs, top_logprobs, text_offset}` and chat's `{content: [{token, logprob,
bytes, top_logprobs: [{token, logprob, bytes}]}]}`.

A token's string is its own bytes (`Tokenizer.token_bytes`: a byte-level or byte-fallback token may hold
part of a UTF-8 character) decoded with U+FFFD for what is incomplete; chat's `bytes` gives them exactly.
A logprob that is not finite is sent as -9999.0 (JSON has no -inf; OpenAI's convention)."""
from __future__ import annotations

import math

from .protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

FLOOR = -9999.0  # what a -inf (or NaN) logprob is sent as


def finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


class TokenStrings:
    """Token id -> its bytes and its string, through the tokenizer, cached (a server sees the same ids
    again and again)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._bytes: dict[int, bytes] = {}

    def bytes(self, token_id: int) -> bytes:
        found = self._bytes.get(token_id)
        if found is None:
            own = getattr(self.tokenizer, "token_bytes", None)  # a tokenizer without it: its decode of the token
            found = own(token_id) if own is not None else self.tokenizer.decode([token_id]).encode("utf-8")
            self._bytes[token_id] = found
        return found

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")


class CompletionLogprobsWriter:
    """One completions choice's `logprobs`, a piece at a time: `text_offset` counts on from the previous
    pieces (the offset of a token is where its string starts, the strings laid end to end from 0, as vLLM
    counts them). `top`: the top entries asked for; each position's dict holds them and the token itself,
    so up to top + 1 entries (OpenAI's rule)."""

    def __init__(self, strings: TokenStrings, top: int):
        self.strings, self.top, self.offset = strings, top, 0

    def write(self, entries) -> CompletionLogprobs:
        tokens, values, tops, offsets = [], [], [], []
        for e in entries:
            text = self.strings.text(e.token_id)
            tokens.append(text)
            values.append(finite(e.logprob))
            top = {self.strings.text(i): finite(v) for i, v in e.top[:self.top]}
            top.setdefault(text, finite(e.logprob))
            tops.append(top)
            offsets.append(self.offset)
            self.offset += len(text)
        return CompletionLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets)


def chat_logprobs(entries, strings: TokenStrings, top: int) -> ChatLogprobs:
    """Chat's `logprobs` of `entries` (TokenLogprob), each with its `top` most likely tokens."""

    def entry(token_id: int, value: float) -> dict:
        return {"token": strings.text(token_id), "logprob": finite(value), "bytes": list(strings.bytes(token_id))}

    return ChatLogprobs(content=[
        ChatTokenLogprob(**entry(e.token_id, e.logprob), top_logprobs=[TopLogprob(**entry(i, v)) for i, v in e.top[:top]])
        for e in entries])
