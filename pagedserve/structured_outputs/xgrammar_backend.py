"""The xgrammar backend (the default): compiled grammars with precomputed token masks,
C++ matchers that fill a request's bitmask row in microseconds."""

from __future__ import annotations

from collections.abc import Iterable

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

_JSON_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar (0.2.9)'s JSON string characters admit what JSON or UTF-8 forbid: a string
# with minLength/maxLength uses the first class below, which allows raw control characters
# (json.loads refuses them); both classes allow UTF-16 surrogates (U+D800..U+DFFF), whose
# 3-byte encodings are invalid UTF-8 (decoded as U+FFFD). The grammar is rewritten with
# the right class.
_BOUNDED_STRING_CHAR = r"[^\"\\\r\n]"
_BASIC_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\r\n\uD800-\uDFFF]"


def _json_schema_grammar(schema: str, any_whitespace: bool, strict: bool = True):
    import xgrammar as xgr

    g = xgr.Grammar.from_json_schema(schema, any_whitespace=any_whitespace, strict_mode=strict)
    text = str(g)
    fixed = text.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR).replace(
        _BASIC_STRING_CHAR, _JSON_STRING_CHAR
    )
    return g if fixed == text else xgr.Grammar.from_ebnf(fixed)


def to_grammar(spec: GrammarSpec):
    """The spec as an `xgrammar.Grammar`, without the tokenizer: cheap (no token masks),
    so the front end can validate a request with it. RuntimeError if it is invalid."""
    import xgrammar as xgr

    if spec.kind == JSON:
        return _json_schema_grammar(spec.spec, spec.any_whitespace)
    if spec.kind == JSON_OBJECT:  # any object, any keys (not strict)
        return _json_schema_grammar(_JSON_OBJECT_SCHEMA, spec.any_whitespace, strict=False)
    if spec.kind == REGEX:
        return xgr.Grammar.from_regex(spec.spec)
    if spec.kind == EBNF:
        return xgr.Grammar.from_ebnf(spec.spec)
    if spec.kind == LARK:
        return xgr.Grammar.from_lark(spec.spec)
    raise ValueError(f"unknown grammar kind {spec.kind!r}")


class XgrammarGrammar(StructuredOutputGrammar):
    __slots__ = ("matcher", "stop_token_ids")

    def __init__(self, matcher, stop_token_ids: list[int]) -> None:
        self.matcher = matcher
        self.stop_token_ids = stop_token_ids

    def accept_tokens(self, tokens: Iterable[int]) -> bool:
        accept = self.matcher.accept_token
        return all(accept(t) for t in tokens)

    def accept_token(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask, row: int) -> None:
        if self.matcher.is_terminated():
            set_stop_bits(bitmask, row, self.stop_token_ids)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def reset(self) -> None:
        self.matcher.reset()


class XgrammarBackend(StructuredOutputBackend):
    name = "xgrammar"

    def __init__(
        self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int], max_threads: int = 2
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_token_ids or None
        )
        # our LRU (manager.py) is the cache: xgrammar's own would grow without bound
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=False)

    def compile(self, spec: GrammarSpec):
        c = self.compiler
        if spec.kind == REGEX:
            return c.compile_regex(spec.spec)
        if spec.kind == EBNF:
            return c.compile_grammar(spec.spec)
        return c.compile_grammar(to_grammar(spec))  # JSON, JSON_OBJECT, LARK

    def new_grammar(self, compiled) -> XgrammarGrammar:
        return XgrammarGrammar(self._xgr.GrammarMatcher(compiled), self.tokenizer_info.stop_token_ids)
