"""Incremental detokenization that never emits half of a multi-byte character.

Decodes a small window (prefix_offset..end) and emits only the text past what the
same window decoded to before; a trailing U+FFFD means a character is still incomplete,
so nothing is emitted until the next token completes it.
"""

from __future__ import annotations

from collections.abc import Sequence

_WINDOW = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids)
        self.read_offset = len(self.ids)
        self.prefix_offset = max(len(self.ids) - _WINDOW, 0)
        self.text = ""  # everything emitted so far (output only)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly completed text (possibly empty)."""
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a request: whatever is still held back (an incomplete character)."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        rest = self._decode(self.ids[self.prefix_offset:])[len(prefix_text):]
        self.read_offset = len(self.ids)
        self.text += rest
        return rest


class TextStream:
    """Output text of one request: incremental decode plus stop strings.

    While the request runs, the last (longest stop string - 1) characters are held back, so a
    stop string split across tokens is never partly streamed; the stop string itself and all
    text after it are dropped, as in vLLM and OpenAI's API."""

    def __init__(self, tokenizer, prompt_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stop = list(stop)
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.emitted = 0
        self.checked = 0
        self.text = ""
        self.stopped = False

    def add(self, token_ids: Sequence[int]) -> str | None:
        """Feed tokens; return the stop string they completed, if any."""
        self.text += self.detok.add(token_ids)
        if not self.stop:
            return None
        start = max(self.checked - self.holdback, 0)
        hits = [(idx, s) for s in self.stop if (idx := self.text.find(s, start)) >= 0]
        self.checked = len(self.text)
        if not hits:
            return None
        idx, s = min(hits)
        self.text = self.text[:idx]
        self.stopped = True
        return s

    def take(self, final: bool) -> str:
        if final:
            if not self.stopped:
                self.text += self.detok.flush()
            end = len(self.text)
        else:
            end = max(len(self.text) - self.holdback, self.emitted)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
