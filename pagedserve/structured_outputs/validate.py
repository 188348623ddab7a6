"""Front-end checks of a constraint, before anything is queued: the spec is parsed into a
grammar without the tokenizer (cheap), so an invalid schema, regex or grammar is a 400
naming `structured_outputs` (or `response_format` at the server) instead of a failed
request later."""

from __future__ import annotations

import functools

from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.structured_outputs.backend import GrammarSpec, clean_error, grammar_spec


@functools.lru_cache(maxsize=1024)
def _check(spec: GrammarSpec) -> str | None:
    from pagedserve.structured_outputs.xgrammar_backend import to_grammar

    try:
        to_grammar(spec)
    except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own types
        return clean_error(e)
    return None


def validate_structured_outputs(
    params: StructuredOutputsParams, param: str = "structured_outputs"
) -> GrammarSpec:
    """The request's canonical spec; InvalidRequestError if it cannot compile, or if
    xgrammar is not installed."""
    spec = grammar_spec(params)
    try:
        import xgrammar  # noqa: F401
    except ImportError as e:
        raise InvalidRequestError(
            "structured outputs need xgrammar: pip install 'pagedserve[structured]'.", param
        ) from e
    err = _check(spec)
    if err is not None:
        raise InvalidRequestError(f"invalid {params.kind} constraint: {err}", param)
    return spec
