"""Structured outputs (pagedserve/structured_outputs): params validation, the canonical
spec and compile cache, exact token masks for each constraint kind on the tiny test
tokenizer, rollback, termination, and applying the bitmask to logits."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from pagedserve import SamplingParams, StructuredOutputsParams
from pagedserve.errors import InvalidRequestError
from pagedserve.structured_outputs.backend import StructuredOutputBackend, grammar_spec
from pagedserve.structured_outputs.bitmask import allocate_bitmask, apply_grammar_bitmask, bitmask_to_bool
from pagedserve.structured_outputs.manager import StructuredOutputManager, make_backend
from pagedserve.structured_outputs.validate import validate_structured_outputs
from pagedserve.structured_outputs.xgrammar_backend import XgrammarBackend, XgrammarGrammar

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

MODEL_VOCAB = 1001  # the tiny checkpoints' (the tokenizer has 400 tokens: the rest is padding)
EOS = 2  # <|im_end|>

SCHEMAS = [
    {  # nested objects, enums, bounded integers
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 6},
                    "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
                },
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "age", "role", "address"],
    },
    {  # arrays with min/max items, bounded numbers
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 4},
                "minItems": 1,
                "maxItems": 3,
            },
            "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
        },
        "required": ["tags", "score"],
    },
    {  # string patterns, anyOf with null
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "note": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]},
            "flag": {"type": "boolean"},
        },
        "required": ["code", "note", "flag"],
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 2,
        "maxItems": 4,
    },
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tests.checkpoints import build_tokenizer

    return build_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def manager(request, tokenizer):
    if request.param == "llguidance":
        pytest.importorskip("llguidance")
    m = StructuredOutputManager(lambda: tokenizer, MODEL_VOCAB, backend=request.param)
    yield m
    m.shutdown()


def ready(manager, params: StructuredOutputsParams):
    r = manager.new_request(params, [EOS])
    assert r.wait(60) and r.error is None, r.error
    return r


def allowed(grammar) -> set[int]:
    bm = allocate_bitmask(1, MODEL_VOCAB)
    grammar.fill_bitmask(bm, 0)
    return set(np.flatnonzero(bitmask_to_bool(torch.from_numpy(bm), MODEL_VOCAB)[0].numpy()).tolist())


def token_text(tokenizer, t: int) -> str:
    return tokenizer.decode([t], skip_special_tokens=True)


def walk_finite(tokenizer, grammar, language: set[str], seed: int) -> str:
    """A random walk through the grammar, checking at every step that the mask allows
    exactly the tokens that keep the text a prefix of a word of `language` (and EOS only
    on a whole word)."""
    rng = random.Random(seed)
    texts = [token_text(tokenizer, t) for t in range(len(tokenizer))]
    text = ""
    for _ in range(64):
        expect = {t for t, s in enumerate(texts) if s and any(w.startswith(text + s) for w in language)}
        if text in language:
            expect.add(EOS)
        got = allowed(grammar)
        if isinstance(grammar, XgrammarGrammar):
            assert got == expect, (text, sorted(got ^ expect)[:10])
        else:  # llguidance allows a subset (it prefers canonical tokenizations)
            assert got and got <= expect, (text, sorted(got - expect)[:10])
        t = rng.choice(sorted(got))
        assert grammar.accept_tokens([t])
        if t == EOS:
            assert grammar.is_terminated()
            return text
        text += texts[t]
    raise AssertionError("no end")


def walk_random(tokenizer, grammar, seed: int, max_steps: int = 400, closing: float = 0.0) -> str:
    """Sample uniformly among allowed tokens (the stop token as soon as it is allowed);
    with probability `closing`, among those that close a string, array or object."""
    rng = random.Random(seed)
    closers = {t for t in range(len(tokenizer)) if set(token_text(tokenizer, t)) & set('"]}')}
    ids = []
    for _ in range(max_steps):
        got = allowed(grammar)
        assert got, "the grammar allows nothing"
        pool = got & closers if rng.random() < closing and got & closers else got
        t = EOS if EOS in got else rng.choice(sorted(pool))
        assert grammar.accept_tokens([t])
        if t == EOS:
            return tokenizer.decode(ids, skip_special_tokens=True)
        ids.append(t)
    raise AssertionError(f"did not finish: {tokenizer.decode(ids)!r}")


# -- params ---------------------------------------------------------------------------
def test_params_exactly_one_kind():
    assert StructuredOutputsParams(regex="a+").kind == "regex"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    for bad in ({}, {"regex": "a", "choice": ["x"]}, {"json": {}, "json_object": True}):
        with pytest.raises(InvalidRequestError) as e:
            StructuredOutputsParams(**bad)
        assert e.value.param == "structured_outputs"
    for bad in ({"choice": []}, {"choice": ["a", 1]}, {"regex": 3}, {"json": 5}, {"grammar": "  "}):
        with pytest.raises(InvalidRequestError):
            StructuredOutputsParams(**bad)


def test_sampling_params_field():
    p = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert isinstance(p.structured_outputs, StructuredOutputsParams) and p.structured_outputs.choice == [
        "a",
        "b",
    ]
    assert SamplingParams().structured_outputs is None
    with pytest.raises(InvalidRequestError):
        SamplingParams(structured_outputs="json")
    from pagedserve.sampling_params import StructuredOutputsParams as S

    assert S is StructuredOutputsParams


def test_spec_is_canonical():
    a = grammar_spec(
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    )
    b = grammar_spec(
        StructuredOutputsParams(json='{"type":"object",  "properties": {"a": {"type": "integer"}}}')
    )
    assert a == b and hash(a) == hash(b)
    # key order is kept (properties are generated in schema order), so this one differs
    c = grammar_spec(
        StructuredOutputsParams(json={"properties": {"a": {"type": "integer"}}, "type": "object"})
    )
    assert c != a
    c = grammar_spec(StructuredOutputsParams(choice=['say "hi"', "a\\b\nc"]))
    assert c.kind == "ebnf" and c.spec == 'root ::= "say \\"hi\\"" | "a\\\\b\\nc"'
    assert grammar_spec(StructuredOutputsParams(grammar='root ::= "x"')).kind == "ebnf"
    assert grammar_spec(StructuredOutputsParams(grammar='start: "x"')).kind == "lark"
    with pytest.raises(InvalidRequestError):
        grammar_spec(StructuredOutputsParams(json="{not json"))


@pytest.mark.parametrize(
    "params",
    [
        StructuredOutputsParams(json={"type": "objekt"}),
        StructuredOutputsParams(regex="(ab"),
        StructuredOutputsParams(grammar="root ::= undefined_rule"),
        StructuredOutputsParams(grammar="start: ("),
    ],
)
def test_validate_rejects(params):
    with pytest.raises(InvalidRequestError) as e:
        validate_structured_outputs(params)
    assert e.value.param == "structured_outputs" and "/project/" not in str(e.value)


# -- exact masks ------------------------------------------------------------------------
def test_choice_mask_exact(tokenizer, manager):
    choices = ["yes", "no", "maybe so", "fox jumps"]
    for seed in range(4):
        g = ready(manager, StructuredOutputsParams(choice=choices)).grammar
        assert walk_finite(tokenizer, g, set(choices), seed) in choices


def test_regex_mask_exact(tokenizer, manager):
    language = {f"{p}{d}" for p in ("ab", "cd") for d in "0123456789"}
    for seed in range(3):
        g = ready(manager, StructuredOutputsParams(regex=r"(ab|cd)[0-9]")).grammar
        assert walk_finite(tokenizer, g, language, seed) in language


@pytest.mark.parametrize(
    "grammar,language",
    [
        ('root ::= "the " ("quick" | "lazy dog")', {"the quick", "the lazy dog"}),
        ('start: "a" "bc"?', {"a", "abc"}),
    ],
)
def test_grammar_mask_exact(tokenizer, manager, grammar, language):
    g = ready(manager, StructuredOutputsParams(grammar=grammar)).grammar
    assert walk_finite(tokenizer, g, language, 0) in language


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_walks_validate(tokenizer, manager, schema):
    for seed in range(3):
        g = ready(manager, StructuredOutputsParams(json=schema, disable_any_whitespace=seed == 0)).grammar
        jsonschema.validate(json.loads(walk_random(tokenizer, g, seed)), schema)


def test_json_object(tokenizer, manager):
    for seed in range(3):
        g = ready(manager, StructuredOutputsParams(json_object=True)).grammar
        first = {token_text(tokenizer, t).lstrip()[:1] for t in allowed(g)} - {""}
        assert first == {"{"}
        assert isinstance(json.loads(walk_random(tokenizer, g, seed, closing=0.7)), dict)


@pytest.mark.parametrize("schema", [{"type": "string"}, {"type": "string", "maxLength": 4}])
def test_json_strings_refuse_control_chars_and_surrogates(tokenizer, manager, schema):
    """Bytes that json.loads or UTF-8 refuse (xgrammar 0.2.9 allows them; we rewrite its classes)."""
    import xgrammar

    vocab = xgrammar.TokenizerInfo.from_huggingface(tokenizer).decoded_vocab
    tid = {b: i for i, b in enumerate(vocab)}
    for bad in (b"\x03", b"\xed\xba\xac"):  # a control character; U+DEAC (a surrogate)
        g = ready(manager, StructuredOutputsParams(json=schema)).grammar
        assert g.accept_tokens([tid[b'"']])
        assert not g.accept_tokens([tid[bytes([b])] for b in bad])
    g = ready(manager, StructuredOutputsParams(json=schema)).grammar
    if isinstance(g, XgrammarGrammar):  # llguidance refuses the byte split of a merged token
        assert g.accept_tokens([tid[b'"'], tid[b"\xe4"], tid[b"\xbb"], tid[b"\x8a"], tid[b'"'], EOS])  # 今


def test_padded_vocab_never_allowed(manager):
    g = ready(manager, StructuredOutputsParams(json_object=True)).grammar
    assert max(allowed(g)) < 400  # ids 400..1000 exist in the model, not in the tokenizer


# -- state --------------------------------------------------------------------------------
def test_rollback_restores_mask(tokenizer, manager):
    g = ready(manager, StructuredOutputsParams(json=SCHEMAS[0])).grammar
    rng = random.Random(0)
    masks, toks = [allowed(g)], []
    for _ in range(6):
        t = rng.choice(sorted(masks[-1] - {EOS}))
        assert g.accept_tokens([t])
        toks.append(t)
        masks.append(allowed(g))
    g.rollback(3)
    assert allowed(g) == masks[3]
    g.reset()
    assert allowed(g) == masks[0]


def test_terminated_allows_only_stop(tokenizer, manager):
    r = ready(manager, StructuredOutputsParams(choice=["no"]))
    assert all(r.accept(t) for t in tokenizer.encode("no")) and not r.grammar.is_terminated()
    assert r.accept(EOS) and r.grammar.is_terminated()
    assert allowed(r.grammar) == {EOS}
    assert r.accept(EOS)  # ignore_eos / min_tokens: the request may go on; nothing breaks


def test_illegal_token_refused(tokenizer, manager):
    r = ready(manager, StructuredOutputsParams(choice=["yes"]))
    assert not r.accept(tokenizer.encode("z")[0])
    assert allowed(r.grammar) == {
        t for t in range(len(tokenizer)) if "yes".startswith(token_text(tokenizer, t) or "#")
    }


def test_replay(tokenizer, manager):
    r = ready(manager, StructuredOutputsParams(regex="[a-z]{2,6}"))
    toks = tokenizer.encode("fox")
    assert all(r.accept(t) for t in toks)
    mask = allowed(r.grammar)
    r.replay(toks)
    assert allowed(r.grammar) == mask


# -- cache ----------------------------------------------------------------------------------
def test_compile_cache_hits(tokenizer):
    m = StructuredOutputManager(lambda: tokenizer, MODEL_VOCAB, cache_size=2)
    try:
        s1 = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
        s1_reordered = json.dumps(s1, indent=2)  # the same schema, as text
        a = m.new_request(StructuredOutputsParams(json=s1), [EOS])
        b = m.new_request(StructuredOutputsParams(json=s1_reordered), [EOS])
        assert a.wait(60) and b.wait(60)
        assert (m.cache_misses, m.cache_hits, len(m.compile_seconds)) == (1, 1, 1)
        assert a.grammar is not b.grammar  # one compiled grammar, one matcher per request
        assert a.accept(tokenizer.encode("{")[0]) and allowed(a.grammar) != allowed(b.grammar)
        m.new_request(StructuredOutputsParams(regex="a"), [EOS]).wait(60)
        m.new_request(StructuredOutputsParams(regex="b"), [EOS]).wait(60)  # evicts s1 (LRU, size 2)
        m.new_request(StructuredOutputsParams(json=s1), [EOS]).wait(60)
        assert (m.cache_misses, m.cache_hits) == (4, 1)
    finally:
        m.shutdown()


def test_attach_bitmask_rows(tokenizer, manager):
    from types import SimpleNamespace

    from pagedserve.messages import CachedRequestData, SchedulerOutput

    r1 = ready(manager, StructuredOutputsParams(choice=["yes"]))
    r2 = ready(manager, StructuredOutputsParams(choice=["no"]))
    reqs = {
        "a": SimpleNamespace(structured_output_request=r1),
        "b": SimpleNamespace(structured_output_request=None),
        "c": SimpleNamespace(structured_output_request=r2),
        "d": SimpleNamespace(structured_output_request=r2),
    }
    sched = [
        CachedRequestData(req_id=rid, token_ids=[1], num_computed_tokens=0, block_ids=[], sample=rid != "d")
        for rid in "abcd"
    ]
    so = SchedulerOutput(sched, 4)
    manager.attach_bitmask(so, reqs)
    assert so.structured_output_request_ids == {"a": 0, "c": 1}
    assert so.grammar_bitmask.shape == (2, (MODEL_VOCAB + 31) // 32)
    so2 = SchedulerOutput([sched[1]], 1)
    manager.attach_bitmask(so2, reqs)
    assert so2.grammar_bitmask is None and so2.structured_output_request_ids is None


# -- applying the bitmask ------------------------------------------------------------------
@pytest.mark.parametrize("use_xgrammar", [True, False])
@pytest.mark.parametrize("rows", [None, [2, 0]])
def test_apply_bitmask(monkeypatch, use_xgrammar, rows):
    import pagedserve.structured_outputs.bitmask as bmod

    if not use_xgrammar:
        monkeypatch.setattr(bmod, "_xgr_apply", False)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 70, generator=g)
    k = 3 if rows is None else len(rows)
    vocab = 67  # bitmask covers 67 -> 3 words (96 bits); columns 67..69 are padding
    bits = torch.rand(k, vocab, generator=g) > 0.5
    bm = allocate_bitmask(k, vocab)
    bm[:] = 0
    for i in range(k):
        for t in np.flatnonzero(bits[i].numpy()):
            w, b = divmod(int(t), 32)
            bm[i, w] |= np.int32(1 << b) if b < 31 else np.int32(-(2**31))
    out = logits.clone()
    apply_grammar_bitmask(out, bm, rows)
    expect = logits.clone()
    for i, row in enumerate(range(3) if rows is None else rows):
        expect[row, :vocab][~bits[i]] = float("-inf")
        expect[row, vocab:] = float("-inf")
    assert torch.equal(out, expect)


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_make_backend_builds_each_backend_and_refuses_others(tokenizer, name):
    if name == "llguidance":
        pytest.importorskip("llguidance")
        from pagedserve.structured_outputs.llguidance_backend import LLGuidanceBackend as cls
    else:
        cls = XgrammarBackend
    b = make_backend(name, tokenizer, MODEL_VOCAB, [EOS])
    assert isinstance(b, cls) and isinstance(b, StructuredOutputBackend)
    with pytest.raises(ValueError, match="backend must be one of xgrammar, llguidance"):
        make_backend("outlines", tokenizer, MODEL_VOCAB, [EOS])
