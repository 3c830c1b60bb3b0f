"""Stop strings, server-side: watch a request's text as it grows, hold back what might begin a stop string,
and cut the text where the first one starts (the stop string itself is not returned, as with OpenAI)."""
from __future__ import annotations


class StopStrings:
    """Feed each new piece of text; get back the text that is safe to send, and whether a stop string was
    found. Text that could be the start of a stop string is held until it is known not to be one (`flush`
    at the end of the request releases it)."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.text = ""  # the request's text so far (cut at the stop string, once found)
        self.sent = 0  # characters of `text` already released
        self.stop_end: int | None = None  # where the stop string found ends, in the uncut text

    def feed(self, piece: str) -> tuple[str, bool]:
        self.text += piece
        # A stop string cannot begin before `sent`: any text that could begin one was held back.
        hits = [(i, i + len(s)) for s in self.stops if (i := self.text.find(s, self.sent)) >= 0]
        if hits:
            start, self.stop_end = min(hits)
            self.text = self.text[:start]
            return self.flush(), True
        end = len(self.text) - self._held()
        out, self.sent = self.text[self.sent : end], end
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent :], len(self.text)
        return out

    def _held(self) -> int:
        """Length of the longest unsent suffix of `text` that is a proper prefix of a stop string."""
        tail = self.text[self.sent :]
        for n in range(min(len(tail), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            if any(s.startswith(tail[-n:]) for s in self.stops):
                return n
        return 0


def tokens_through(decode, token_ids: list[int], first: int, stop_end: int) -> int:
    """How many of `token_ids` it took to write a stop string that ends at character `stop_end`: the fewest
    n >= `first` whose text `decode(token_ids[:n])` has `stop_end` characters (all of them if none has).
    So the count reported (usage, token ids) is the same whatever the speculative step sizes were."""
    for n in range(max(first, 1), len(token_ids) + 1):
        if len(decode(token_ids[:n])) >= stop_end:
            return n
    return len(token_ids)
