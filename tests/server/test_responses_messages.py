"""OpenAI's Responses API and Anthropic's Messages API on the server, judged by the
official `openai` and `anthropic` clients: plain and streamed (the stream reassembles to
the plain answer), function tools round trips, JSON schema output, stored conversations
across a server restart, deletion, and bad input in each API's own error shape."""

import json

import httpx
import jsonschema
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from pagedserve.server.response_store import ResponseStore  # noqa: E402
from pagedserve.server.serving_messages import chat_messages as anthropic_chat_messages  # noqa: E402
from pagedserve.server.serving_responses import chat_messages  # noqa: E402
from tests.server.test_server import MODEL, Server  # noqa: E402

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"], "additionalProperties": False},
}


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    return str(tmp_path_factory.mktemp("store") / "responses.sqlite3")


@pytest.fixture(scope="module")
def server(checkpoint, store_path):
    s = Server(checkpoint("llama"), responses_store=store_path, api_key="k", structured_outputs_disable_any_whitespace=True)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0)


# -- Responses ------------------------------------------------------------------------------
def test_response_and_its_stream_agree(oai):
    kw = dict(model=MODEL, input="Tell me about the sea.", instructions="Be brief.", max_output_tokens=12, temperature=0)
    r = oai.responses.create(**kw)
    assert r.object == "response" and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 12 and r.usage.input_tokens > 5
    with oai.responses.stream(**kw) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    final = events[-1].response  # response.incomplete carries it (get_final_response wants .completed)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == final.output[0].content[0].text and final.usage.output_tokens == 12
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds


def test_function_call_round_trip(oai):
    r = oai.responses.create(model=MODEL, input="Weather in Lyon?", tools=[WEATHER],
                             tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60, temperature=0)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    r2 = oai.responses.create(model=MODEL, previous_response_id=r.id, max_output_tokens=5, temperature=0,
                              input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}])
    assert r2.previous_response_id == r.id and r2.output[0].type == "message"
    with oai.responses.stream(model=MODEL, input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                              max_output_tokens=60, temperature=0) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    calls = [o for o in events[-1].response.output if o.type == "function_call"]
    assert len(calls) >= 1
    call = calls[0]
    assert "response.function_call_arguments.delta" in kinds and "city" in json.loads(call.arguments)


def test_json_schema_output(oai):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    r = oai.responses.create(model=MODEL, input="a number", max_output_tokens=40, temperature=0,
                             text={"format": {"type": "json_schema", "name": "num", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_stored_conversation_survives_a_restart_and_deletion(checkpoint, oai, store_path):
    first = oai.responses.create(model=MODEL, input="Remember the word kiwi.", max_output_tokens=4, temperature=0)
    s2 = Server(checkpoint("llama"), responses_store=store_path)  # another server on the same store
    try:
        c2 = openai.OpenAI(base_url=s2.url + "/v1", api_key="none", max_retries=0)
        assert c2.responses.retrieve(first.id).output_text == first.output_text
        cont = c2.responses.create(model=MODEL, previous_response_id=first.id, input="Which word?", max_output_tokens=4)
        assert cont.status in ("completed", "incomplete")
        # the continuation's prompt holds the first exchange: more input tokens than the question alone
        alone = c2.responses.create(model=MODEL, input="Which word?", max_output_tokens=4, store=False)
        assert cont.usage.input_tokens > alone.usage.input_tokens
        c2.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            c2.responses.retrieve(first.id)
        with pytest.raises(openai.BadRequestError) as e:
            c2.responses.create(model=MODEL, previous_response_id=first.id, input="again")
        assert e.value.body["param"] == "previous_response_id"
        with pytest.raises(openai.NotFoundError):
            c2.responses.retrieve(alone.id)  # store=False: never stored
    finally:
        s2.stop()


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
        ({"no_such_field": 1}, "no_such_field"),
    ],
)
def test_unsupported_responses_fields_are_a_400_naming_them(server, extra, param):
    body = {"model": MODEL, "input": "hi", **extra}
    r = httpx.post(server.url + "/v1/responses", json=body, headers={"Authorization": "Bearer k"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_input_items_become_chat_messages():
    msgs = chat_messages([
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
    ])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool"]
    assert [c["id"] for c in msgs[2]["tool_calls"]] == ["c1", "c2"]


def test_store_bounds_age_and_size(tmp_path):
    st = ResponseStore(str(tmp_path / "s.db"), max_bytes=64 << 10, max_age_s=3600)
    for i in range(400):
        st.put({"id": f"r{i}", "x": "y" * 500}, [{"role": "user", "content": "z" * 500}])
    assert st.get("r399") is not None and st.get("r0") is None  # the oldest went first
    assert st._size() <= 64 << 10
    old = ResponseStore(str(tmp_path / "o.db"), max_age_s=0.0)
    old.put({"id": "a"}, [])
    assert old.get("a") is None


# -- Anthropic Messages ------------------------------------------------------------------------
def test_messages_create_and_stream_agree(claude):
    greedy = {"temperature": 0}  # an extra field: this client has no sampling arguments
    kw = dict(model=MODEL, max_tokens=10, extra_body=greedy, system="Be brief.", messages=[{"role": "user", "content": "Hello"}])
    m = claude.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.stop_reason == "max_tokens" and m.usage.output_tokens == 10
    with claude.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == m.content[0].text and final.stop_reason == "max_tokens" and final.usage.output_tokens == 10


def test_messages_tool_use_round_trip(claude):
    tool = {"name": "get_weather", "description": "Weather", "input_schema": WEATHER["parameters"]}
    m = claude.messages.create(model=MODEL, max_tokens=60, extra_body={"temperature": 0}, tools=[tool],
                               tool_choice={"type": "tool", "name": "get_weather"},
                               messages=[{"role": "user", "content": "Weather in Lyon?"}])
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and "city" in use.input
    m2 = claude.messages.create(model=MODEL, max_tokens=5, tools=[tool], messages=[
        {"role": "user", "content": "Weather in Lyon?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
    ])
    assert m2.content and m2.content[0].type == "text"
    with claude.messages.stream(model=MODEL, max_tokens=60, tools=[tool], tool_choice={"type": "any"},
                                messages=[{"role": "user", "content": "Weather?"}]) as stream:
        final = stream.get_final_message()
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert "city" in use.input


def test_messages_errors_are_in_anthropics_shape(server, claude):
    r = httpx.post(server.url + "/v1/messages", json={"model": MODEL, "messages": []}, headers={"x-api-key": "k"})
    assert r.status_code == 400 and r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": []})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"  # no key
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}])


def test_anthropic_blocks_become_chat_messages():
    from pagedserve.server.serving_messages import MessagesRequest

    body = MessagesRequest(model="m", max_tokens=3, system=[{"type": "text", "text": "sys"}], messages=[
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "text", "text": "t"}, {"type": "tool_use", "id": "u1", "name": "f", "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "u1", "content": [{"type": "text", "text": "r"}]}]},
    ])
    msgs = anthropic_chat_messages(body)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool"]
    assert json.loads(msgs[2]["tool_calls"][0]["function"]["arguments"]) == {"a": 1} and msgs[3]["content"] == "r"


def test_endpoints_are_counted_in_metrics(server, oai, claude):
    oai.responses.create(model=MODEL, input="x", max_output_tokens=2)
    claude.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}])
    text = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer k"}).text
    for endpoint in ("/v1/responses", "/v1/messages"):
        assert f'endpoint="{endpoint}"' in text and "pagedserve:http_requests_total" in text
