"""The structured-output backend interface, and the grammar spec a request compiles to.

A backend compiles a `GrammarSpec` (what to constrain to, canonical and hashable, so
equal constraints share one compiled grammar) against the model's tokenizer, and makes
one `StructuredOutputGrammar` (a matcher: the grammar's state for one sequence) per
request from the compiled grammar. Backends: `xgrammar`.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass

from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import StructuredOutputsParams

# grammar kinds a backend compiles ("choice" becomes an EBNF grammar)
JSON, JSON_OBJECT, REGEX, EBNF, LARK = "json", "json_object", "regex", "ebnf", "lark"


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint in canonical form: the compile cache's key."""

    kind: str  # JSON, JSON_OBJECT, REGEX, EBNF or LARK
    spec: str  # the schema (compact JSON text), regex or grammar text; "" for JSON_OBJECT
    any_whitespace: bool = True  # JSON kinds: free whitespace between tokens


def choice_as_grammar(choices: list[str]) -> str:
    """root ::= "a" | "b" | ... with each choice an escaped EBNF string literal."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def grammar_spec(params: StructuredOutputsParams) -> GrammarSpec:
    """StructuredOutputsParams -> GrammarSpec; InvalidRequestError for a JSON schema that
    is not JSON or not an object."""
    kind = params.kind
    ws = not params.disable_any_whitespace
    if kind == "json":
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise InvalidRequestError(
                    f"structured_outputs.json is not valid JSON: {e}", "structured_outputs"
                ) from e
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(
                f"structured_outputs.json must be a JSON schema object, got {type(schema).__name__}.",
                "structured_outputs",
            )
        return GrammarSpec(
            JSON, json.dumps(schema, ensure_ascii=False), ws
        )  # key order kept: it orders the output
    if kind == "json_object":
        return GrammarSpec(JSON_OBJECT, "", ws)
    if kind == "regex":
        return GrammarSpec(REGEX, params.regex)
    if kind == "choice":
        return GrammarSpec(EBNF, choice_as_grammar(params.choice))
    text = params.grammar
    return GrammarSpec(EBNF if "::=" in text else LARK, text)


_CPP_PREFIX = re.compile(r"^\[[\d:.]+\]\s+\S+:\d+:\s*")


def clean_error(e: BaseException) -> str:
    """A backend's error message without its C++ source location prefix."""
    msg = str(e).strip()
    return _CPP_PREFIX.sub("", msg.splitlines()[0] if msg else type(e).__name__)


class StructuredOutputGrammar(ABC):
    """One sequence's position in a compiled grammar."""

    @abstractmethod
    def accept_tokens(self, tokens: list[int]) -> bool:
        """Advance over `tokens`; False (state unchanged past the first bad token) if one is illegal."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    @abstractmethod
    def fill_bitmask(self, bitmask, row: int) -> None:
        """Write the legal next tokens into row `row` of an int32 [rows, ceil(V / 32)]
        bitmask (bit t % 32 of word t // 32 set = token t allowed). A terminated grammar
        allows only its stop tokens."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """A stop token was accepted: nothing may follow."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start state (no tokens accepted)."""


class StructuredOutputBackend(ABC):
    """Compiles specs against one tokenizer; makes matchers."""

    name: str
    vocab_size: int  # the model's (logits width), >= the tokenizer's

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> object:
        """A compiled grammar (opaque; shared by every request with this spec)."""

    @abstractmethod
    def new_grammar(self, compiled: object) -> StructuredOutputGrammar:
        """A fresh matcher at the compiled grammar's start state."""


def set_stop_bits(bitmask, row: int, stop_token_ids) -> None:
    """Row `row` allows exactly `stop_token_ids` (numpy or torch int32 bitmask)."""
    bitmask[row] = 0
    for t in stop_token_ids:
        word, bit = divmod(t, 32)
        if word < bitmask.shape[1]:
            v = int(bitmask[row, word]) & 0xFFFFFFFF | (1 << bit)
            bitmask[row, word] = v - (1 << 32) if v >= 1 << 31 else v
