"""Stop strings over streamed text: hold back what could still become a stop string.

Text arrives in pieces (one or a few tokens each). A stop string may span pieces ("a gr" + "een"
for the stop "a gre"), so a piece cannot be sent as soon as it arrives: its last len(longest stop)-1
characters might be the start of a stop. `StopMatcher.feed` returns only the text that is certainly
before any stop; at a stop it returns the text up to it and `stopped` turns true; `flush` returns
the held-back tail when the generation ends without a stop. Streamed and non-streamed answers are
built from the same matcher, so they agree.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0  # characters of `text` already returned
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Add a piece; return the text that is now safe to send (maybe empty)."""
        if self.stopped:
            return ""
        self.text += piece
        # A stop that starts before `sent` would have been complete (and found) already, because
        # `sent` never passes len(text) - hold: searching from `sent` is enough.
        cut = min((i for s in self.stops if (i := self.text.find(s, self.sent)) >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._send(cut)
        return self._send(max(len(self.text) - self.hold, self.sent))

    def flush(self) -> str:
        """The generation ended without a stop: the held-back tail is final text."""
        return "" if self.stopped else self._send(len(self.text))

    def _send(self, upto: int) -> str:
        out = self.text[self.sent:upto]
        self.sent = upto
        return out

    @property
    def answer(self) -> str:
        """Everything returned so far."""
        return self.text[: self.sent]
