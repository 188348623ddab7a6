"""Tool calling helpers (pagedserve/server/tool_calls.py): request checks, forced calls as
JSON schemas, parsing hermes / llama3 output, and streamed deltas that reassemble to the
non-streamed calls."""

from __future__ import annotations

import json

import pytest

from pagedserve.errors import InvalidRequestError
from pagedserve.server.tool_calls import (
    ToolCallStreamer,
    check_tools,
    fallback_messages,
    forced_structured_outputs,
    parse_forced,
    parse_tool_calls,
    template_supports_tools,
    tools_system_prompt,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}


def test_check_tools():
    fns, choice = check_tools([WEATHER, TIME], None)
    assert [f["name"] for f in fns] == ["get_weather", "get_time"] and choice == "auto"
    assert check_tools(None, None) == ([], "none")
    assert check_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}})[1] == {
        "name": "get_weather"
    }
    for tools, choice, param in [
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([WEATHER], "sometimes", "tool_choice"),
        ([], "required", "tool_choice"),
        ([{"type": "function", "function": {}}], "auto", "tools"),
    ]:
        with pytest.raises(InvalidRequestError) as e:
            check_tools(tools, choice)
        assert e.value.param == param


def test_forced_schemas():
    jsonschema = pytest.importorskip("jsonschema")
    fns, _ = check_tools([WEATHER, TIME], "required")
    named = forced_structured_outputs(fns, {"name": "get_weather"})
    assert named.json == WEATHER["function"]["parameters"]
    req = forced_structured_outputs(fns, "required").json
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}], req)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], req)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris"}}], req)
    assert forced_structured_outputs(fns, "auto") is None
    calls = parse_forced(
        '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}]',
        "required",
    )
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {}),
        ("get_weather", {"city": "Oslo", "unit": "c"}),
    ]
    assert parse_forced(' {"city": "Oslo"} ', {"name": "get_weather"})[0].arguments == '{"city": "Oslo"}'


def test_prompt_and_template():
    p = tools_system_prompt(check_tools([WEATHER], None)[0])
    assert "<tools>" in p and "get_weather" in p and "<tool_call>" in p
    assert template_supports_tools("{% if tools %}...{% endif %}") and not template_supports_tools(
        "{{ messages }}"
    )


HERMES = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def test_parse_hermes():
    content, calls = parse_tool_calls(HERMES, "hermes")
    assert content == "Let me check.\n"
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris", "unit": "c"}'),
        ("get_time", "{}"),
    ]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    assert parse_tool_calls("no tools here", "hermes") == ("no tools here", [])
    assert parse_tool_calls("<tool_call>{broken", "hermes") == ("<tool_call>{broken", [])
    # the model stopped (EOS) before closing the tag
    _, calls = parse_tool_calls('<tool_call>{"name": "get_time", "arguments": {}}', "qwen")
    assert calls[0].name == "get_time"


def test_parse_llama3_json():
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "unit": "f"}}; {"name": "get_time", "parameters": {}}'
    content, calls = parse_tool_calls(text, "llama3_json")
    assert content is None and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Rome", "unit": "f"}'),
        ("get_time", "{}"),
    ]
    assert parse_tool_calls("Hello {there}", "llama3_json") == ("Hello {there}", [])


def reassemble(events):
    content, calls = "", {}
    for e in events:
        if "content" in e:
            content += e["content"]
            continue
        c = calls.setdefault(e["index"], {"id": None, "name": None, "arguments": ""})
        if "id" in e:
            assert c["id"] is None and c["arguments"] == ""  # id and name come first, once
            c["id"], c["name"] = e["id"], e["name"]
        c["arguments"] += e["arguments"]
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize(
    "parser,text",
    [
        ("hermes", HERMES),
        ("hermes", "Just text, no <tool call> here < at all"),
        ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa}ris", "unit": "c"}}'),
        ("llama3_json", '{"name": "get_time", "parameters": {}}'),
    ],
)
def test_streaming_reassembles(parser, text, chunk):
    s = ToolCallStreamer(parser)
    events = []
    for i in range(0, len(text), chunk):
        events += s.feed(text[i : i + chunk])
    events += s.finish()
    content, calls = reassemble(events)
    want_content, want_calls = parse_tool_calls(text, parser)
    assert content == (want_content or "") or (want_content is None and not content.strip())
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in want_calls]
    assert [c["id"] for c in calls] == [c.id for c in s.calls]


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_streaming_forced(chunk):
    named = {"name": "get_weather"}
    text = ' {"city": "Paris", "unit": "c"} '
    s = ToolCallStreamer(forced=named)
    events = [e for i in range(0, len(text), chunk) for e in s.feed(text[i : i + chunk])] + s.finish()
    _, calls = reassemble(events)
    assert calls == [{"id": s.calls[0].id, "name": "get_weather", "arguments": text.strip()}]
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}]'
    s = ToolCallStreamer(forced="required")
    events = [e for i in range(0, len(text), chunk) for e in s.feed(text[i : i + chunk])] + s.finish()
    _, calls = reassemble(events)
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.name, c.arguments) for c in parse_forced(text, "required")
    ]


def test_required_without_parallel_calls_is_one_call():
    jsonschema = pytest.importorskip("jsonschema")
    fns, _ = check_tools([WEATHER, TIME], "required")
    one = forced_structured_outputs(fns, "required", parallel=False).json
    call = {"name": "get_time", "parameters": {}}
    jsonschema.validate([call], one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([call, call], one)
    jsonschema.validate([call, call], forced_structured_outputs(fns, "required").json)


def test_fallback_messages():
    fns, _ = check_tools([WEATHER], None)
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
    ]
    out = fallback_messages(history, fns)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and "<tools>" in out[0]["content"]
    assert out[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    }
    assert out[3] == {"role": "user", "content": "<tool_response>\n-3 C\n</tool_response>"}
    assert history[2]["tool_calls"]  # the request's messages are not modified
    # no system message: one is added; no functions: history only, no tools prompt
    assert fallback_messages(history[1:2], fns)[0]["role"] == "system"
    assert fallback_messages(history[:2], []) == history[:2]


def test_openai_deltas_shape():
    from pagedserve.server.serving_chat import openai_deltas

    s = ToolCallStreamer("hermes")
    events = s.feed(HERMES) + s.finish()
    deltas = openai_deltas(events)
    assert deltas[0] == {"content": "Let me check.\n"}
    first = deltas[1]["tool_calls"][0]
    assert first == {
        "index": 0,
        "id": s.calls[0].id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": ""},
    }
    assert all(
        set(d["tool_calls"][0]) == {"index", "function"} for d in deltas[2:] if "id" not in d["tool_calls"][0]
    )
    # parallel_tool_calls=false: the second call's deltas are dropped
    assert {d["tool_calls"][0]["index"] for d in openai_deltas(events, parallel=False)[1:]} == {0}
