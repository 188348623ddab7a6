"""Incremental detokenization and stop strings.

Text is emitted only once it decodes to whole characters: a token that ends inside a
multi-byte UTF-8 character (Chinese, emoji) is held until the character completes, so
no broken text is ever emitted, and the pieces concatenate to `tokenizer.decode(ids)`.
Each step decodes a short window (a few tokens of context plus the new ones), not the
whole output, so the cost per token stays constant.
"""

from __future__ import annotations

from pagedserve.sampling_params import SamplingParams

_CONTEXT = 5  # prompt tokens kept as decoding context (leading-space handling)
# where transformers' own tokenizers-backed decode lives (4.x: _fast; 5.x: _tokenizers)
_PLAIN_DECODE = {"decode": {"transformers.tokenization_utils_base"},
                 "_decode": {"transformers.tokenization_utils_tokenizers", "transformers.tokenization_utils_fast"}}


def _defined_in(cls: type, name: str) -> str | None:
    return next((c.__module__ for c in cls.__mro__ if name in c.__dict__), None)


def raw_decoder(tokenizer):
    """`tokenizer.decode`, or the Rust tokenizer's own decode where that is exactly what
    tokenizer.decode computes: a tokenizers-backed tokenizer whose decode and _decode are
    transformers' own (its class's, not replaced on the instance), and that cleans up no
    spaces. transformers' wrapper converts and type-checks its input on every call: 3.9 against
    1.35 us a call on a Zen 4 core; in cProfile's figures (which inflate many small Python
    calls) 12.6 against 3.0 ms a step at 256 streams on the H200 machine (BENCHMARKS section 7)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.decode
    if "decode" in vars(tokenizer) or "_decode" in vars(tokenizer):  # replaced on the instance
        return tokenizer.decode
    if any(_defined_in(type(tokenizer), name) not in mods for name, mods in _PLAIN_DECODE.items()):
        return tokenizer.decode
    return backend.decode


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self._raw_decode = raw_decoder(tokenizer)
        self.skip_special = params.skip_special_tokens
        self.stop = params.stop or []
        self.include_stop = params.include_stop_str_in_output
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.output_text = ""
        # streaming holds back this many characters: they might start a stop string
        self.stop_buffer = max((len(s) for s in self.stop), default=1) - 1 if not self.include_stop else 0
        self._sent = 0  # characters already handed out as deltas

    def _decode(self, ids: list[int]) -> str:
        return self._raw_decode(ids, skip_special_tokens=self.skip_special)

    def add_tokens(self, new_ids: list[int]) -> str:
        """Append tokens; returns the newly completed text (possibly empty)."""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the next token
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """At the end: whatever is still held (an unfinished character decodes as U+FFFD)."""
        if self.read_offset == len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        delta = self._decode(self.ids[self.prefix_offset :])[len(prefix_text) :]
        self.read_offset = len(self.ids)
        self.output_text += delta
        return delta

    def check_stop(self, new_chars: int) -> str | None:
        """Look for a stop string in text that includes the last `new_chars` characters;
        if one is found, trim the output at it and return it."""
        if not self.stop or not new_chars:
            return None
        text = self.output_text
        best = None
        for s in self.stop:
            idx = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.output_text = text[: idx + len(s)] if self.include_stop else text[:idx]
        return s

    def add_tokens_until_stop(self, new_ids: list[int]) -> tuple[int, str | None]:
        """Append tokens and look for a stop string. Several tokens at once (speculative
        decoding) are fed one at a time while stop strings exist, so a stop ends the output
        at the token that completed it. Returns (tokens taken, stop string or None)."""
        if len(new_ids) > 1 and self.stop:
            for j, tok in enumerate(new_ids):
                stop = self.check_stop(len(self.add_tokens([tok])))
                if stop is not None:
                    return j + 1, stop
            return len(new_ids), None
        return len(new_ids), self.check_stop(len(self.add_tokens(new_ids)))

    def next_delta(self, finished: bool) -> str:
        """Text not yet handed out, keeping back a possible stop-string prefix until the end."""
        end = len(self.output_text) if finished else max(len(self.output_text) - self.stop_buffer, self._sent)
        delta = self.output_text[self._sent : end]
        self._sent = end
        return delta
