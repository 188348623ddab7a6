"""Structured outputs, tools, strict request fields and /tokenize on the HTTP server, with
the official `openai` client against the tiny random checkpoint (issue 14).

A random model fills JSON's free whitespace forever, so the server runs with
--structured-outputs-disable-any-whitespace (compact JSON), and string fields are bounded.
Tool choice "auto" lets the model choose; a random model never writes a `<tool_call>` by
itself, so the auto path is driven end to end by constraining the output (a regex in
`structured_outputs`) to a known hermes-style text.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from tests.server.test_server import MODEL, Server  # noqa: E402
from tests.structured_outputs.test_structured_outputs import SCHEMAS  # noqa: E402

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER_PARAMS},
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "cet"]}},
    "required": ["zone"],
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS}}
TOOLS = [WEATHER, TIME]
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NATIVE_TEMPLATE = (
    "{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def server(checkpoint):
    s = Server(
        checkpoint("llama"),
        structured_outputs_disable_any_whitespace=True,
        trust_request_chat_template=True,
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def lit(text: str) -> str:
    """A regex matching exactly `text`."""
    return re.sub(r"([\\.^$*+?()\[\]{}|/])", r"\\\1", text).replace("\n", r"\n")


def chat(client, **kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 200)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(**kw)


def stream_chat(client, **kw):
    """Streams a chat request; returns (content, calls by index, finish_reason, chunks)."""
    content, calls, finish, chunks = "", {}, None, []
    for chunk in chat(client, stream=True, **kw):
        chunks.append(chunk)
        for ch in chunk.choices:
            d = ch.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": "", "deltas": 0})
                c["deltas"] += 1
                if tc.id is not None:
                    # the first delta of a call: its id, type and name, no arguments yet
                    assert c["id"] is None and c["deltas"] == 1 and tc.type == "function"
                    assert tc.function.name and not tc.function.arguments
                    c["id"], c["name"] = tc.id, tc.function.name
                else:
                    assert c["id"] is not None and tc.function.name is None
                c["arguments"] += tc.function.arguments or ""
            if ch.finish_reason is not None:
                finish = ch.finish_reason
    return content, [calls[i] for i in sorted(calls)], finish, chunks


def call_pairs(calls) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in calls or []]


def assert_400(exc_info, param):
    e = exc_info.value
    assert e.status_code == 400, e
    err = e.body if isinstance(e.body, dict) and "message" in e.body else e.response.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["message"]
    return err


# -- response_format and structured_outputs ------------------------------------------------------
@pytest.mark.parametrize("schema", SCHEMAS)
def test_response_format_json_schema_validates(client, schema):
    for temperature, seed in ((0, None), (1.0, 7)):
        r = chat(
            client,
            temperature=temperature,
            seed=seed,
            max_tokens=300,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "out", "schema": schema, "strict": True},
            },
        )
        c = r.choices[0]
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), schema)


def test_response_format_json_object_and_completions(client):
    # (a random model's keys are long strings: this seed closes its object within 300 tokens)
    r = chat(client, response_format={"type": "json_object"}, temperature=0.5, seed=2, max_tokens=300)
    assert r.choices[0].finish_reason == "stop"
    obj = json.loads(r.choices[0].message.content)
    assert isinstance(obj, dict) and obj
    # the same on /v1/completions (response_format in the body), and "text" is no constraint
    schema = SCHEMAS[2]
    r = client.completions.create(
        model=MODEL,
        prompt="JSON:",
        max_tokens=200,
        temperature=0,
        extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        },
    )
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    free = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=20, temperature=0)
    text = client.completions.create(
        model=MODEL,
        prompt="JSON:",
        max_tokens=20,
        temperature=0,
        extra_body={"response_format": {"type": "text"}},
    )
    assert text.choices[0].text == free.choices[0].text


def test_regex_choice_grammar_via_extra_body(client):
    pattern = r"[A-Z][a-z]{1,5} [0-9]{2}"
    for body in ({"structured_outputs": {"regex": pattern}}, {"guided_regex": pattern}):
        r = chat(client, extra_body=body, temperature=1.0, seed=3)
        assert re.fullmatch(pattern, r.choices[0].message.content), r.choices[0].message.content
    choices = ["positive", "negative", "neutral"]
    for body in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        r = chat(client, extra_body=body, n=4, temperature=1.0, seed=4)
        assert all(c.message.content in choices for c in r.choices)
    r = client.completions.create(
        model=MODEL,
        prompt="Sum:",
        max_tokens=20,
        temperature=1.0,
        seed=5,
        extra_body={"structured_outputs": {"grammar": 'root ::= "(" [0-9] "+" [0-9] ")"'}},
    )
    assert re.fullmatch(r"\([0-9]\+[0-9]\)", r.choices[0].text), r.choices[0].text
    # streamed: the pieces join into one allowed output
    parts = [
        c.choices[0].delta.content or ""
        for c in chat(client, extra_body={"structured_outputs": {"choice": choices}}, stream=True)
        if c.choices
    ]
    assert "".join(parts) in choices


def test_invalid_constraints_are_400(client):
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, response_format=bad_schema)
    assert "nonsense" in assert_400(e, "response_format")["message"]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert_400(e, "response_format")
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, response_format={"type": "yaml"})
    assert_400(e, "response_format")
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, extra_body={"structured_outputs": {"regex": "([a-z"}})
    assert_400(e, "structured_outputs")
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}})
    assert_400(e, "structured_outputs")
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, extra_body={"structured_outputs": {"regex": "a", "backend": "outlines"}})
    assert "backend" in assert_400(e, "structured_outputs")["message"]
    # two constraints at once
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"})
    assert_400(e, "guided_regex")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", extra_body={"guided_json": {"type": "nonsense"}})
    assert_400(e, "guided_json")


# -- tools ---------------------------------------------------------------------------------------
def test_tool_choice_required_and_named_validate(client):
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        r = chat(client, tools=TOOLS, tool_choice=choice)
        c = r.choices[0]
        assert c.message.tool_calls, c.message
        for call in c.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
        if choice == "required":
            assert c.finish_reason == "tool_calls" and c.message.content is None
        else:  # a named function: OpenAI's API (and vLLM) keep "stop"
            assert [t.function.name for t in c.message.tool_calls] == ["get_time"]
            assert c.finish_reason == "stop"
        # streamed at temperature 0: the same calls, as OpenAI's deltas
        _, calls, finish, _ = stream_chat(client, tools=TOOLS, tool_choice=choice)
        assert [(x["name"], x["arguments"]) for x in calls] == call_pairs(c.message.tool_calls)
        assert finish == c.finish_reason


def test_named_call_streams_argument_fragments(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(client, tools=TOOLS, tool_choice=choice)
    _, calls, _, _ = stream_chat(client, tools=TOOLS, tool_choice=choice)
    assert len(calls) == 1 and calls[0]["arguments"] == r.choices[0].message.tool_calls[0].function.arguments
    assert calls[0]["deltas"] > 2  # the arguments grow over several deltas, not one at the end


HERMES = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
)


def test_auto_parses_tool_calls_stream_and_not(client):
    force = {"structured_outputs": {"regex": lit(HERMES)}}
    r = chat(client, tools=TOOLS, tool_choice="auto", extra_body=force)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content == "Let me check.\n"
    assert call_pairs(c.message.tool_calls) == [
        ("get_weather", '{"city": "Paris", "unit": "c"}'),
        ("get_time", '{"zone": "utc"}'),
    ]
    assert len({t.id for t in c.message.tool_calls}) == 2
    content, calls, finish, _ = stream_chat(client, tools=TOOLS, extra_body=force)  # auto is the default
    assert content == c.message.content and finish == "tool_calls"
    assert [(x["name"], x["arguments"]) for x in calls] == call_pairs(c.message.tool_calls)
    # parallel_tool_calls=false: the first call only
    r = chat(client, tools=TOOLS, extra_body=force, parallel_tool_calls=False)
    assert call_pairs(r.choices[0].message.tool_calls) == [("get_weather", '{"city": "Paris", "unit": "c"}')]
    # auto where the model answers in text: no calls, the text as content
    r = chat(client, tools=TOOLS, extra_body={"structured_outputs": {"regex": "It is sunny"}})
    assert r.choices[0].message.content == "It is sunny" and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_tool_choice_none_is_a_request_without_tools(client):
    plain = chat(client, max_tokens=12)
    r = chat(client, tools=TOOLS, tool_choice="none", max_tokens=12)
    assert r.choices[0].message.content == plain.choices[0].message.content
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens  # the tools were not shown
    auto = chat(client, tools=TOOLS, max_tokens=1)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens  # ...they are with "auto"
    # nothing is parsed: a tool-call text stays content
    r = chat(
        client, tools=TOOLS, tool_choice="none", extra_body={"structured_outputs": {"regex": lit(HERMES)}}
    )
    assert r.choices[0].message.content == HERMES and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_bad_tools_are_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_stock"}})
    assert "get_stock" in assert_400(e, "tool_choice")["message"]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, tools=[{"type": "function"}])
    assert_400(e, "tools")
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, tool_choice="required")
    assert_400(e, "tool_choice")
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, tools=[bad])
    assert_400(e, "tools")
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert_400(e, "response_format")


def test_tool_history_and_native_templates_render(server):
    """The tools and an earlier call and its result reach the prompt: through the tools
    prompt for a template without tool support, through `tools` for one with it."""
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees"},
    ]

    def rendered(**kw):
        r = httpx.post(server.url + "/tokenize", json={"messages": history, "tools": TOOLS, **kw})
        assert r.status_code == 200, r.text
        d = httpx.post(server.url + "/detokenize", json={"tokens": r.json()["tokens"]})
        return d.json()["prompt"]

    text = rendered()
    assert "<tools>" in text and '"name": "get_weather"' in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
        in text
    )
    assert "<tool_response>\n22 degrees\n</tool_response>" in text
    native = rendered(chat_template=NATIVE_TEMPLATE)
    assert native.startswith("TOOLS:[") and "get_time" in native and "<tools>" not in native


# -- strict fields -------------------------------------------------------------------------------
def test_unknown_fields_are_400_naming_them(server, client):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": ASK, "max_tokens": 2, "frobnicate": 1, "top_a": 0.5},
    )
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "frobnicate" and "'frobnicate'" in err["message"] and "'top_a'" in err["message"]
    # null asks for nothing: accepted; the documented ignored fields are accepted on both endpoints
    from pagedserve.server.protocol import IGNORED_FIELDS

    ignored = {"frobnicate": None, **{f: None for f in IGNORED_FIELDS}, "user": "u", "store": True}
    for path, body in (("/v1/chat/completions", {"messages": ASK}), ("/v1/completions", {"prompt": "hi"})):
        r = httpx.post(
            server.url + path, json={"model": MODEL, "max_tokens": 2, **body, **ignored}, timeout=60
        )
        assert r.status_code == 200, r.text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"best_of": 3})
    assert_400(e, "best_of")
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert "continuous_usage_stats" in assert_400(e, "stream_options")["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, suffix="!")
    assert_400(e, "suffix")
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        r = httpx.post(server.url + path, json={**body, "extra": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "extra"


def test_clients_own_fields_are_accepted(server, client):
    """What the openai client, vLLM's benchmark client and `pagedserve bench serve` send."""
    r = chat(
        client,
        max_tokens=None,
        max_completion_tokens=3,
        n=2,
        temperature=1.0,
        seed=1,
        stop=["\n\n"],
        logprobs=True,
        top_logprobs=2,
        user="u1",
        store=False,
        metadata={"k": "v"},
        service_tier="auto",
        parallel_tool_calls=True,
        logit_bias={"5": 1.0},
        stream_options=None,
    )
    assert len(r.choices) == 2
    vllm_completion = {
        "model": MODEL,
        "prompt": "hello",
        "repetition_penalty": 1.0,
        "max_tokens": 3,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    vllm_chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
        "max_completion_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    ours = {
        "model": MODEL,
        "prompt": [1, 2, 3],
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "min_tokens": 3,
    }
    for path, body in (
        ("/v1/completions", vllm_completion),
        ("/v1/chat/completions", vllm_chat),
        ("/v1/completions", ours),
    ):
        with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
            assert r.status_code == 200, r.read()
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        if "stream_options" in body:
            assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 3


def test_masked_logprobs_are_finite_json(server):
    """Under a constraint most tokens are masked (-inf): JSON has no -inf, vLLM sends -9999.0."""
    body = {
        "model": MODEL,
        "messages": ASK,
        "max_tokens": 5,
        "logprobs": True,
        "top_logprobs": 5,
        "structured_outputs": {"choice": ["yes", "no"]},
    }
    for stream in (False, True):
        r = httpx.post(server.url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=60)
        assert r.status_code == 200, r.text
        payloads = (
            [r.text] if not stream else [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: {")]
        )
        values = []
        for p in payloads:  # strict JSON: -Infinity / NaN would fail here
            obj = json.loads(p, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
            for ch in obj["choices"]:
                for t in (ch.get("logprobs") or {}).get("content") or []:
                    values += [t["logprob"]] + [x["logprob"] for x in t["top_logprobs"]]
        assert values and min(values) == -9999.0 and all(v <= 0 for v in values)


# -- /tokenize and /detokenize -------------------------------------------------------------------
def test_tokenize_detokenize_round_trip(server, client):
    text = "The quick brown fox 你好 🚀"
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    t = r.json()
    assert t["count"] == len(t["tokens"]) == len(t["token_strs"]) > 3 and t["max_model_len"] == 2048
    assert httpx.post(server.url + "/detokenize", json={"tokens": t["tokens"]}).json() == {"prompt": text}
    assert client.completions.create(model=MODEL, prompt=text, max_tokens=1).usage.prompt_tokens == t["count"]
    # messages are rendered exactly as the chat endpoint renders them
    m = httpx.post(server.url + "/tokenize", json={"messages": ASK}).json()
    assert m["token_strs"] is None
    assert m["count"] == chat(client, max_tokens=1).usage.prompt_tokens
    with_tools = httpx.post(server.url + "/tokenize", json={"messages": ASK, "tools": TOOLS}).json()
    assert with_tools["count"] == chat(client, max_tokens=1, tools=TOOLS).usage.prompt_tokens
    # a completion's prompt of those ids is the same prompt
    c = client.completions.create(model=MODEL, prompt=t["tokens"], max_tokens=1, echo=True)
    assert c.choices[0].text.startswith(text)


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/detokenize", {"tokens": [1, 1001]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": [1.5]}, "tokens"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": ASK}, "prompt"),
        ("/tokenize", {"messages": ASK, "tools": [{"type": "function"}]}, "tools"),
        ("/tokenize", {"prompt": "a", "model": "nope"}, "model"),
    ],
)
def test_tokenize_errors(server, path, body, param):
    r = httpx.post(server.url + path, json=body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param
