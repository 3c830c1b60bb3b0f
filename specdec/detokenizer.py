"""Incremental detokenization: the text a request gained in a step, decoding a few tokens, not its whole
output (vLLM's prefix/read offsets).

Decoding a window of tokens and subtracting the text of its first part gives the new text, provided the
window starts at a token boundary that was already emitted: a tokenizer that treats the first token of a
decode specially (SentencePiece strips its leading space) treats both decodes alike. The window starts at
`prefix_offset` (where the last emitted text began) and the new tokens start at `read_offset`; text ending
in an unfinished UTF-8 character or byte-fallback piece (U+FFFD) is held back until it completes. When the
request finishes, the whole output is decoded once, and what was not yet emitted is emitted: the deltas of
a request always concatenate to its final text.
"""
from __future__ import annotations

INCOMPLETE = "\ufffd"  # what a decoder prints for an unfinished UTF-8 character or byte-fallback piece


def text_delta(full: str, sent: str, final: bool) -> str:
    """The text to emit now, given the decoded output so far (`full`) and the text already emitted
    (`sent`): what is new, less an unfinished UTF-8 character or byte-fallback piece at the end (held back
    until it completes, or the request ends). Deltas therefore concatenate to the final text."""
    shown = full if final else full.rstrip(INCOMPLETE)
    return shown[len(sent):] if len(shown) > len(sent) and shown.startswith(sent) else ""


class IncrementalDetokenizer:
    """One request's output text, a step at a time. `decoded_tokens` counts what was decoded (the cost)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.prefix_offset = 0  # the window's first token: where the last emitted text began
        self.read_offset = 0  # tokens whose text has been emitted
        self.sent = ""  # the text emitted so far
        self.decoded_tokens = 0

    def _decode(self, ids) -> str:
        self.decoded_tokens += len(ids)
        return self.tokenizer.decode(ids)

    def step(self, output_ids: list[int]) -> str:
        """The new text of `output_ids` (the request's whole output so far; only its tail is decoded)."""
        if len(output_ids) == self.read_offset:
            return ""
        before = self._decode(output_ids[self.prefix_offset:self.read_offset])
        window = self._decode(output_ids[self.prefix_offset:])
        if len(window) <= len(before) or window.endswith(INCOMPLETE) or not window.startswith(before):
            return ""  # nothing printable yet: wait for more tokens
        delta = window[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(output_ids)
        self.sent += delta
        return delta

    def finish(self, output_ids: list[int]) -> tuple[str, str]:
        """(the last delta, the final text): the whole output decoded once."""
        full = self._decode(output_ids)
        delta = text_delta(full, self.sent, final=True)
        self.sent += delta
        return delta, full
