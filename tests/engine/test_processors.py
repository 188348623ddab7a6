"""The front end's processors on their own (no model): InputProcessor's checks and n > 1
fan-out, OutputProcessor's detokenization, stop strings, n > 1 fan-in, deltas and fault
isolation, fed EngineCoreOutputs by hand."""

import pytest

from pagedserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pagedserve.engine.input_processor import InputProcessor, ProcessedRequest
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.errors import InvalidRequestError
from pagedserve.messages import EngineCoreOutput, Logprob
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from tests.checkpoints import build_tokenizer

    return build_tokenizer(str(tmp_path_factory.mktemp("tok")))


def processor(tok, max_model_len=64, num_kv_blocks=None, block_size=16) -> InputProcessor:
    cfg = EngineConfig(scheduler=SchedulerConfig(max_model_len=max_model_len), cache=CacheConfig(block_size=block_size))
    p = InputProcessor(cfg, vocab_size=tok.get_vocab_size() if hasattr(tok, "get_vocab_size") else len(tok), tokenizer=tok, eos_token_ids=frozenset({2}))
    p.num_kv_blocks = num_kv_blocks
    return p


# -- input processor ---------------------------------------------------------------------
def test_fan_out_gives_n_children_with_their_own_seeds(tok):
    req = processor(tok).process("r", "hello world", SamplingParams(n=3, seed=7, max_tokens=5))
    assert isinstance(req, ProcessedRequest)
    assert [c.request_id for c in req.children] == ["r#0", "r#1", "r#2"]
    assert [c.sampling_params.seed for c in req.children] == [7, 8, 9]
    assert all(c.sampling_params.n == 1 and c.max_tokens == 5 for c in req.children)
    assert all(c.prompt_token_ids == req.prompt_token_ids == tok.encode("hello world") for c in req.children)
    assert all(c.eos_token_ids == frozenset({2}) for c in req.children)


def test_max_tokens_none_means_up_to_max_model_len(tok):
    p = processor(tok, max_model_len=40)
    req = p.process("r", [5] * 10, SamplingParams(max_tokens=None))
    assert req.children[0].max_tokens == 30
    with pytest.raises(InvalidRequestError, match="leaves no room") as e:
        p.process("r", [5] * 40, SamplingParams(max_tokens=None))
    assert e.value.param == "prompt"


@pytest.mark.parametrize(
    "prompt,params,param,match",
    [
        ([], SamplingParams(max_tokens=2), "prompt", "at least one token"),
        ([5] * 60, SamplingParams(max_tokens=10), "max_tokens", "maximum context length"),
        ([10**9], SamplingParams(max_tokens=2), "prompt", "prompt_token_ids must be integers"),
        ([5], SamplingParams(max_tokens=2, top_k=10**7), "top_k", "top_k must be"),
        ([5], SamplingParams(max_tokens=2, logprobs=21), "logprobs", "logprobs must be <= 20"),
        ([5], SamplingParams(max_tokens=2, stop_token_ids=[10**7]), "stop_token_ids", "stop_token_ids must be in"),
        ([5], SamplingParams(max_tokens=0), "max_tokens", "max_tokens must be >= 1"),
        ({"prompt": "x", "cache_salt": ""}, SamplingParams(max_tokens=2), "cache_salt", "cache_salt"),
        (3.5, SamplingParams(max_tokens=2), "prompt", "prompt must be a str"),
    ],
)
def test_each_refusal_names_its_param(tok, prompt, params, param, match):
    with pytest.raises(InvalidRequestError, match=match) as e:
        processor(tok).process("r", prompt, params)
    assert e.value.param == param


def test_kv_capacity_is_checked_once_the_cache_is_sized(tok):
    p = processor(tok, max_model_len=1000, num_kv_blocks=4, block_size=16)
    p.process("r", [5] * 10, SamplingParams(max_tokens=50))  # 59 tokens: 4 blocks
    with pytest.raises(InvalidRequestError, match="needs up to 5 KV blocks") as e:
        p.process("r", [5] * 10, SamplingParams(max_tokens=60))
    assert e.value.param == "max_tokens"


# -- output processor --------------------------------------------------------------------
def feed(op: OutputProcessor, outs: list[EngineCoreOutput]) -> list[RequestOutput]:
    res = op.process(outs)
    assert not res.failed
    return res.outputs


def test_tokens_become_text_and_the_final_output_carries_it(tok):
    ip, op = processor(tok), OutputProcessor(tok)
    req = ip.process("r", "hi", SamplingParams(max_tokens=8, output_kind=RequestOutputKind.FINAL_ONLY))
    op.add_request(req)
    ids = tok.encode(" the weather is fine")
    assert feed(op, [EngineCoreOutput("r", ids[:2])]) == []  # final only: nothing yet
    (out,) = feed(op, [EngineCoreOutput("r", ids[2:], finish_reason="length")])
    assert out.finished and out.outputs[0].text == tok.decode(ids)
    assert out.outputs[0].token_ids == ids and out.outputs[0].finish_reason == "length"
    assert not op.has_unfinished_requests()


def test_a_stop_string_ends_the_request_and_is_reported_to_the_core(tok):
    ip, op = processor(tok), OutputProcessor(tok)
    op.add_request(ip.process("r", "hi", SamplingParams(max_tokens=20, stop=["fine"])))
    ids = tok.encode(" the weather is fine today")
    res = op.process([EngineCoreOutput("r", ids)])
    assert res.stopped == ["r"]
    (out,) = res.outputs
    assert out.finished and out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "fine"
    assert out.outputs[0].text == " the weather is "


def test_n_samples_are_gathered_into_one_request_output(tok):
    ip, op = processor(tok), OutputProcessor(tok)
    op.add_request(ip.process("r", "hi", SamplingParams(n=2, max_tokens=4, output_kind=RequestOutputKind.FINAL_ONLY)))
    assert op.child_ids_of("r") == ["r#0", "r#1"]
    assert feed(op, [EngineCoreOutput("r#0", [5, 6], finish_reason="length")]) == []
    (out,) = feed(op, [EngineCoreOutput("r#1", [7], finish_reason="stop")])
    assert [c.index for c in out.outputs] == [0, 1]
    assert [c.token_ids for c in out.outputs] == [[5, 6], [7]]


def test_delta_outputs_carry_only_the_new_tokens(tok):
    ip, op = processor(tok), OutputProcessor(tok)
    op.add_request(ip.process("r", "hi", SamplingParams(max_tokens=9, output_kind=RequestOutputKind.DELTA)))
    a, b = tok.encode(" sunny"), tok.encode(" days")
    (o1,) = feed(op, [EngineCoreOutput("r", a)])
    (o2,) = feed(op, [EngineCoreOutput("r", b, finish_reason="length")])
    assert o1.outputs[0].token_ids == a and o2.outputs[0].token_ids == b
    assert o1.outputs[0].text + o2.outputs[0].text == tok.decode(a + b)


def test_logprobs_get_their_token_text(tok):
    ip, op = processor(tok), OutputProcessor(tok)
    op.add_request(ip.process("r", "hi", SamplingParams(max_tokens=2, logprobs=1)))
    t = tok.encode(" sun")[0]
    (out,) = feed(op, [EngineCoreOutput("r", [t], new_logprobs=[{t: Logprob(-0.5, 1)}], finish_reason="length")])
    (lp,) = out.outputs[0].logprobs
    assert lp[t].logprob == -0.5 and lp[t].decoded_token == tok.decode([t])


def test_a_request_whose_outputs_fail_fails_alone(tok, monkeypatch):
    ip, op = processor(tok), OutputProcessor(tok)
    op.add_request(ip.process("bad", "hi", SamplingParams(max_tokens=4)))
    op.add_request(ip.process("good", "hi", SamplingParams(max_tokens=4)))
    real = op._apply

    def broken(parent, *a, **kw):
        if parent.request_id == "bad":
            raise RuntimeError("detokenizer bug")
        return real(parent, *a, **kw)

    monkeypatch.setattr(op, "_apply", broken)
    res = op.process([EngineCoreOutput("bad", [5]), EngineCoreOutput("good", [6], finish_reason="length")])
    assert list(res.failed) == ["bad"] and res.abort == ["bad"]
    assert [o.request_id for o in res.outputs] == ["good"]
    assert [o.request_id for o in res.failed_outputs] == ["bad"]
    assert res.failed_outputs[0].outputs[0].finish_reason == "error"
    assert not op.has_unfinished_requests()
