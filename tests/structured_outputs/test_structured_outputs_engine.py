"""Structured outputs through the engine (tiny random checkpoint): every constraint kind
gives valid output, n = 4, preemption and recompute under a small KV cache give the same
outputs as without pressure, stop strings and max_tokens, requests waiting for their
grammar, and a failed grammar."""

from __future__ import annotations

import json
import re

import pytest

from pagedserve import LLM, SamplingParams, StructuredOutputsParams
from pagedserve.errors import InvalidRequestError
from tests.structured_outputs.test_structured_outputs import SCHEMAS

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

PROMPTS = ["The quick brown fox", "def f(x):", "Paged attention", "你好"]


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint("llama"), dtype="float32", num_kv_blocks=400)


def J(schema) -> StructuredOutputsParams:
    """A random model would fill JSON's free whitespace forever: compact JSON here."""
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def gen(llm, prompts, **kw):
    kw.setdefault("max_tokens", 200)
    return llm.generate(prompts, SamplingParams(**kw), use_tqdm=False)


def texts(outs):
    return [c.text for o in outs for c in o.outputs]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_outputs_validate(llm, schema):
    so = J(schema)
    outs = gen(llm, PROMPTS, structured_outputs=so, temperature=1.0, seed=1) + gen(
        llm, PROMPTS[:1], structured_outputs=so, temperature=0.0
    )
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)


def test_json_object_regex_choice_grammar(llm):
    for t in texts(
        gen(
            llm,
            PROMPTS,
            structured_outputs=StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
            seed=2,
            temperature=0.7,
        )
    ):
        assert isinstance(json.loads(t), dict)
    for t in texts(
        gen(
            llm,
            PROMPTS,
            structured_outputs=StructuredOutputsParams(regex=r"[A-Z][a-z]{1,5} [0-9]{2}"),
            seed=3,
        )
    ):
        assert re.fullmatch(r"[A-Z][a-z]{1,5} [0-9]{2}", t), t
    choices = ["positive", "negative", "neutral"]
    for t in texts(gen(llm, PROMPTS, structured_outputs=StructuredOutputsParams(choice=choices), seed=4)):
        assert t in choices
    grammar = 'root ::= "(" expr ")"\nexpr ::= [0-9] | [0-9] "+" [0-9]'
    for t in texts(gen(llm, PROMPTS, structured_outputs=StructuredOutputsParams(grammar=grammar), seed=5)):
        assert re.fullmatch(r"\([0-9](\+[0-9])?\)", t), t


def test_n4_each_sample_valid(llm):
    schema = SCHEMAS[1]
    (out,) = gen(
        llm,
        PROMPTS[:1],
        n=4,
        seed=7,
        temperature=1.0,
        structured_outputs=J(schema),
    )
    assert len(out.outputs) == 4
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), schema)
    assert len({c.text for c in out.outputs}) > 1  # each child has its own matcher and draws


def test_unconstrained_neighbours_unaffected(llm):
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = llm.generate(PROMPTS, plain, use_tqdm=False)
    mixed = llm.generate(
        PROMPTS + PROMPTS[:2],
        [plain] * 4 + [SamplingParams(max_tokens=40, structured_outputs=J(SCHEMAS[3]))] * 2,
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids for o in mixed[:4]]


def test_preemption_gives_same_outputs(checkpoint):
    """Recompute after preemption keeps each matcher in step with its output tokens."""
    path = checkpoint("llama")
    so = J(SCHEMAS[0])
    prompts = [p * 6 for p in PROMPTS] * 2
    params = [
        SamplingParams(max_tokens=120, temperature=0.8, seed=i, structured_outputs=so)
        for i in range(len(prompts))
    ]
    big = LLM(path, dtype="float32", num_kv_blocks=400, enable_prefix_caching=False)
    ref = [o.outputs[0].token_ids for o in big.generate(prompts, params, use_tqdm=False)]
    small = LLM(path, dtype="float32", num_kv_blocks=24, block_size=16, enable_prefix_caching=False)
    got = small.generate(prompts, params, use_tqdm=False)
    assert small.get_stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == ref
    for o in got:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMAS[0])


def test_prefix_cache_hit_same_output(llm):
    sp = dict(temperature=0.0, structured_outputs=J(SCHEMAS[2]))
    a = gen(llm, [PROMPTS[0] * 10], **sp)[0]
    b = gen(llm, [PROMPTS[0] * 10], **sp)[0]
    assert b.num_cached_tokens > 0 and a.outputs[0].token_ids == b.outputs[0].token_ids


def test_max_tokens_and_stop_strings(llm):
    so = J(SCHEMAS[0])
    (o,) = gen(llm, PROMPTS[:1], max_tokens=5, structured_outputs=so, temperature=0.0)
    assert o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 5
    (o,) = gen(llm, PROMPTS[:1], structured_outputs=so, temperature=0.0, stop=['"age"'])
    assert o.outputs[0].finish_reason == "stop" and '"age"' not in o.outputs[0].text


def test_invalid_constraint_refused_before_queueing(llm):
    for so in (StructuredOutputsParams(json={"type": "objekt"}), StructuredOutputsParams(regex="(a")):
        with pytest.raises(InvalidRequestError) as e:
            gen(llm, PROMPTS[:1], structured_outputs=so)
        assert e.value.param == "structured_outputs"
    assert llm.get_stats().num_waiting == 0 and llm.get_stats().num_running == 0


# -- the scheduler's waiting state ---------------------------------------------------------
class FakeGrammar:
    def __init__(self, error=None):
        self.done, self.error, self.grammar, self.accepted = False, error, None, []

    def ready(self):
        return self.done

    def accept(self, token):
        self.accepted.append(token)
        return True


def test_scheduler_waits_for_grammar_without_blocking_others():
    from pagedserve.config import CacheConfig, SchedulerConfig
    from pagedserve.core.request import Request, RequestStatus
    from pagedserve.core.scheduler import Scheduler
    from pagedserve.messages import ModelRunnerOutput

    s = Scheduler(SchedulerConfig(max_model_len=256), CacheConfig(block_size=16), 64)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    slow, failed, plain = (Request(r, [5, 6, 7], sp, max_tokens=4) for r in ("slow", "failed", "plain"))
    slow.structured_output_request = FakeGrammar()
    failed.structured_output_request = FakeGrammar(error="bad grammar")
    for r in (slow, failed, plain):
        s.add_request(r)
    assert slow.status is RequestStatus.WAITING_FOR_GRAMMAR
    so = s.schedule()
    assert [sr.req_id for sr in so.scheduled] == ["plain"]  # "slow" keeps its place, "failed" waits too
    failed.structured_output_request.done = True
    outs = s.update_from_output(so, ModelRunnerOutput({"plain": 9}))
    so = s.schedule()
    assert [sr.req_id for sr in so.scheduled] == ["plain"] and list(s.waiting) == [slow]
    outs = s.update_from_output(so, ModelRunnerOutput({"plain": 9}))
    assert [(o.req_id, o.finish_reason) for o in outs][0] == ("failed", "abort")
    slow.structured_output_request.done = True
    so = s.schedule()
    assert {sr.req_id for sr in so.scheduled} == {"slow", "plain"}
    s.update_from_output(so, ModelRunnerOutput({"plain": 9, "slow": 11}))
    assert slow.structured_output_request.accepted == [11]


# -- logit_bias, allowed_token_ids, bad_words ----------------------------------------------
def test_token_constraints_params():
    p = SamplingParams(logit_bias={"5": 3, 7: -100.0}, bad_words="fox", allowed_token_ids=(1, 2))
    assert p.logit_bias == {5: 3.0, 7: -100.0} and p.bad_words == ["fox"] and p.allowed_token_ids == [1, 2]
    for bad in (
        {"logit_bias": {"x": 1}},
        {"logit_bias": {1: 101}},
        {"allowed_token_ids": []},
        {"bad_words": [""]},
    ):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(**bad)
        assert e.value.param == next(iter(bad))


def test_apply_token_constraints_rows():
    from types import SimpleNamespace

    import torch

    from pagedserve.structured_outputs.token_constraints import apply_token_constraints

    def st(out, **kw):
        return SimpleNamespace(params=SamplingParams(**kw), output_token_ids=out)

    logits = torch.zeros(4, 10)
    states = [
        st([], logit_bias={3: 2.5}),
        st([1, 3], bad_words_token_ids=[[3, 4], [9]]),  # ends with 3: 4 banned; 9 always
        st([3, 1], bad_words_token_ids=[[3, 4]]),  # does not end with 3: nothing banned
        st([], allowed_token_ids=[2, 5]),
    ]
    apply_token_constraints(logits, states)
    inf = float("-inf")
    assert logits[0].tolist() == [0, 0, 0, 2.5, 0, 0, 0, 0, 0, 0]
    assert logits[1].tolist() == [0, 0, 0, 0, inf, 0, 0, 0, 0, inf]
    assert logits[2].tolist() == [0.0] * 10
    assert logits[3].tolist() == [inf, inf, 0, inf, inf, 0, inf, inf, inf, inf]


def test_token_constraints_end_to_end(llm):
    base = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    (ref,) = gen(llm, PROMPTS[:1], **base)
    ref_ids = ref.outputs[0].token_ids
    (o,) = gen(llm, PROMPTS[:1], logit_bias={17: 100}, **base)
    assert o.outputs[0].token_ids == [17] * 8
    (o,) = gen(llm, PROMPTS[:1], logit_bias={ref_ids[0]: -100}, **base)
    assert o.outputs[0].token_ids[0] != ref_ids[0]
    (o,) = gen(llm, PROMPTS[:1], allowed_token_ids=[40, 41, 42], **dict(base, temperature=1.0, seed=0))
    assert set(o.outputs[0].token_ids) <= {40, 41, 42}
    tok = llm.get_tokenizer()
    (fox,) = tok.encode(" fox", add_special_tokens=False)  # one token: banned outright
    push = {fox: 100.0}
    (o,) = gen(llm, PROMPTS[:1], logit_bias=push, **base)
    assert o.outputs[0].token_ids == [fox] * 8
    (o,) = gen(llm, PROMPTS[:1], logit_bias=push, bad_words=["fox"], **base)
    assert not set(o.outputs[0].token_ids) & set(push)
    with pytest.raises(InvalidRequestError):
        gen(llm, PROMPTS[:1], logit_bias={5000: 1.0})


def test_llguidance_backend(checkpoint):
    pytest.importorskip("llguidance")
    llm = LLM(
        checkpoint("llama"), dtype="float32", num_kv_blocks=100, structured_outputs_backend="llguidance"
    )
    for o in gen(llm, PROMPTS, structured_outputs=J(SCHEMAS[2]), temperature=1.0, seed=3):
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMAS[2])
    choices = ["positive", "negative"]
    assert set(
        texts(gen(llm, PROMPTS, structured_outputs=StructuredOutputsParams(choice=choices), seed=4))
    ) <= set(choices)
