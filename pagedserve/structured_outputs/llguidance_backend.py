"""The llguidance backend: grammars are compiled lazily by its Earley parser (nothing to
precompute per schema), masks computed per step. Same interface as xgrammar's."""

from __future__ import annotations

import json
from collections.abc import Iterable

import numpy as np

from pagedserve.structured_outputs.backend import (
    EBNF,
    JSON,
    JSON_OBJECT,
    LARK,
    REGEX,
    GrammarSpec,
    StructuredOutputBackend,
    StructuredOutputGrammar,
    set_stop_bits,
)


class LLGuidanceGrammar(StructuredOutputGrammar):
    """llguidance stops its matcher as soon as the grammar is complete with nothing
    possible after it; the stop token is then ours to accept (as vLLM does)."""

    __slots__ = ("matcher", "stop_token_ids", "_fill", "_terminated")

    def __init__(self, matcher, stop_token_ids: list[int], fill) -> None:
        self.matcher = matcher
        self.stop_token_ids = stop_token_ids
        self._fill = fill
        self._terminated = False

    def accept_tokens(self, tokens: Iterable[int]) -> bool:
        tokens = list(tokens)
        stops = [t in self.stop_token_ids for t in tokens]
        if self.matcher.is_stopped():
            ok = all(stops)
        else:
            ok = self.matcher.try_consume_tokens(tokens) == len(tokens)
        self._terminated |= ok and any(stops)
        return ok

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._terminated = False
            self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask, row: int) -> None:
        if self._terminated or self.matcher.is_stopped():
            set_stop_bits(bitmask, row, self.stop_token_ids)
            return
        import torch

        self._fill(
            self.matcher, torch.from_numpy(bitmask) if isinstance(bitmask, np.ndarray) else bitmask, row
        )

    def is_terminated(self) -> bool:
        return self._terminated

    def reset(self) -> None:
        self._terminated = False
        self.matcher.reset()


def _closed_objects(schema):
    """additionalProperties: false wherever an object schema lists properties and says
    nothing about others (xgrammar's strict mode, which the xgrammar backend uses)."""
    if isinstance(schema, list):
        return [_closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed_objects(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class LLGuidanceBackend(StructuredOutputBackend):
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self._ll = llguidance
        self._fill = llguidance.torch.fill_next_token_bitmask
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.ll_tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=self.stop_token_ids or None
        )

    def compile(self, spec: GrammarSpec) -> str:
        ll = self._ll
        ws = {"whitespace_flexible": spec.any_whitespace}
        if spec.kind == JSON:
            schema = json.dumps(_closed_objects(json.loads(spec.spec)))
            grammar = ll.LLMatcher.grammar_from_json_schema(schema, defaults=ws)
        elif spec.kind == JSON_OBJECT:
            grammar = ll.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=ws)
        elif spec.kind == REGEX:
            grammar = ll.grammar_from("regex", spec.spec)
        elif spec.kind == EBNF:
            grammar = ll.grammar_from("gbnf", spec.spec)
        elif spec.kind == LARK:
            grammar = ll.grammar_from("lark", spec.spec)
        else:
            raise ValueError(f"unknown grammar kind {spec.kind!r}")
        err = ll.LLMatcher.validate_grammar(grammar)
        if err:
            raise ValueError(err)
        return grammar

    def new_grammar(self, compiled: str) -> LLGuidanceGrammar:
        matcher = self._ll.LLMatcher(self.ll_tokenizer, compiled)
        return LLGuidanceGrammar(matcher, self.stop_token_ids, self._fill)
