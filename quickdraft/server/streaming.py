"""Text deltas for streaming, and server-sent events.

The engine hands out the full decoded text of a request after every step. A delta is what is new
since the last one sent, except for two kinds of tail that may still change:

* U+FFFD at the end: a byte-level BPE token can end in the middle of a multi-byte UTF-8 character
  (an emoji is often two or three tokens), and decoding the incomplete bytes gives the replacement
  character. Once the next token completes the character the text there changes, so a trailing
  U+FFFD is held back until it is resolved, or until the request ends (then it is real).
* a tail that begins a stop string: if the next token completes the stop string, the engine cuts
  the text before it, and what was already sent could not be taken back.
"""

from __future__ import annotations

import json

REPLACEMENT = "\ufffd"


class IncrementalText:
    def __init__(self, stop: tuple[str, ...] = ()):
        self.stop = stop
        self.sent = ""

    def delta(self, text: str, finished: bool) -> str:
        """What to send now, given the full text so far."""
        ready = len(text) if finished else self._stable_length(text)
        if not text.startswith(self.sent):
            # Cannot happen with a byte-level decoder (sent text never contains a held tail); if
            # it ever does, continue from where the two agree rather than resend.
            common = 0
            while common < min(len(text), len(self.sent)) and text[common] == self.sent[common]:
                common += 1
            self.sent = self.sent[:common]
        if ready <= len(self.sent):
            return ""
        out = text[len(self.sent):ready]
        self.sent = text[:ready]
        return out

    def _stable_length(self, text: str) -> int:
        end = len(text)
        while end > 0 and text[end - 1] == REPLACEMENT:
            end -= 1
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, end), 0, -1):
                if text.endswith(s[:k], 0, end):
                    hold = max(hold, k)
                    break
        return end - hold


def sse(payload: dict | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")
