"""Structured outputs: constrain generation to a JSON schema, a regex, a choice list or a
grammar (vLLM's `StructuredOutputsParams`), on xgrammar by default.

Nothing here imports xgrammar until a constrained request arrives, so the engine runs
without it. Layout: `backend` (the interface and the canonical `GrammarSpec`),
`xgrammar_backend`, `manager` (compile cache + thread pool, per-request matchers, the
step's bitmask), `bitmask` (applying it to the logits), `validate` (front-end checks).
"""

from pagedserve.structured_outputs.backend import GrammarSpec, StructuredOutputGrammar, grammar_spec
from pagedserve.structured_outputs.bitmask import allocate_bitmask, apply_grammar_bitmask
from pagedserve.structured_outputs.manager import StructuredOutputManager, StructuredOutputRequest
from pagedserve.structured_outputs.validate import validate_structured_outputs

__all__ = [
    "GrammarSpec",
    "StructuredOutputGrammar",
    "StructuredOutputManager",
    "StructuredOutputRequest",
    "allocate_bitmask",
    "apply_grammar_bitmask",
    "grammar_spec",
    "validate_structured_outputs",
]
