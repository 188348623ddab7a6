"""Tool calling for the chat API: request checks, forced calls as structured outputs, the
tools prompt for chat templates without tool support, and parsing tool calls out of the
model's text (whole, or streamed as OpenAI's tool-call deltas).

tool_choice "required" and a named function are enforced with a JSON schema (vLLM's
approach): a named call's output is its arguments object; "required" outputs a JSON array
of {"name", "parameters"}; so the arguments always validate against the function's
parameters. "auto" lets the model choose and parses its text: hermes / qwen style
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the default), or llama3's
bare JSON `{"name": ..., "parameters": {...}}` (`;`-separated, after an optional
`<|python_tag|>`). Arguments are the model's own JSON text of the arguments, so streamed
fragments concatenate to exactly the non-streamed string.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import StructuredOutputsParams

TOOL_PARSERS = ("hermes", "qwen", "llama3_json")
_DECODER = json.JSONDecoder()


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or make_tool_call_id()

    def to_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def make_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# -- the request ----------------------------------------------------------------------------
def check_tools(tools, tool_choice) -> tuple[list[dict], str | dict]:
    """(the functions, the choice: "none" | "auto" | "required" | {"name": ...}), or an
    InvalidRequestError naming `tools` / `tool_choice` (an unknown function, a bad shape)."""
    functions = []
    for i, t in enumerate(tools or []):
        f = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise InvalidRequestError(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}.", "tools"
            )
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise InvalidRequestError(
                f"tools[{i}].function.parameters must be a JSON schema object.", "tools"
            )
        functions.append({"name": f["name"], "description": f.get("description", ""), "parameters": params})
    names = {f["name"] for f in functions}
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if isinstance(tool_choice, dict):
        name = (
            (tool_choice.get("function") or {}).get("name") if tool_choice.get("type") == "function" else None
        )
        if not isinstance(name, str):
            raise InvalidRequestError(
                "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}.",
                "tool_choice",
            )
        if name not in names:
            raise InvalidRequestError(
                f"tool_choice names function {name!r}, which is not in tools.", "tool_choice"
            )
        return functions, {"name": name}
    if tool_choice not in ("none", "auto", "required"):
        raise InvalidRequestError(
            f"tool_choice must be 'none', 'auto', 'required' or a named function, got {tool_choice!r}.",
            "tool_choice",
        )
    if tool_choice in ("auto", "required") and not functions:
        raise InvalidRequestError(f"tool_choice={tool_choice!r} needs tools.", "tool_choice")
    return functions, tool_choice


def forced_structured_outputs(
    functions: list[dict], choice, parallel: bool = True
) -> StructuredOutputsParams | None:
    """The constraint that enforces "required" or a named function (None otherwise);
    `parallel=False` (parallel_tool_calls=false): "required" makes exactly one call."""
    if isinstance(choice, dict):
        f = next(f for f in functions if f["name"] == choice["name"])
        return StructuredOutputsParams(json=f["parameters"])
    if choice == "required":
        calls = [
            {
                "type": "object",
                "properties": {"name": {"enum": [f["name"]]}, "parameters": f["parameters"]},
                "required": ["name", "parameters"],
            }
            for f in functions
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)
    return None


def template_tools(functions: list[dict]) -> list[dict]:
    """`tools=` for transformers' apply_chat_template (OpenAI's shape)."""
    return [{"type": "function", "function": f} for f in functions]


def template_supports_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def tools_system_prompt(functions: list[dict]) -> str:
    """Hermes-style instructions (as Qwen2.5's template writes them) for a chat template
    that does not render tools itself."""
    sigs = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{sigs}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def fallback_messages(messages: list[dict], functions: list[dict]) -> list[dict]:
    """The conversation for a chat template that knows nothing of tools: the tools prompt
    joins the system message (one is added if there is none), an assistant's earlier
    tool calls become `<tool_call>` text and tool results `<tool_response>` text in a user
    message (as Qwen2.5's template writes them)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n"
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                    ensure_ascii=False,
                )
                + "\n</tool_call>"
                for c in m.pop("tool_calls")
            )
            m["content"] = f"{m['content']}\n{calls}" if m.get("content") else calls
        if m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        m.pop("tool_call_id", None)
        out.append(m)
    if functions:
        prompt = tools_system_prompt(functions)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# -- the response -----------------------------------------------------------------------------
def _raw_value(text: str, start: int) -> tuple[object, str]:
    """The JSON value at text[start:] (after whitespace) and its exact text."""
    while start < len(text) and text[start] in " \t\r\n":
        start += 1
    value, end = _DECODER.raw_decode(text, start)
    return value, text[start:end]


_ARGS_KEY = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def _call_from_json(body: str) -> ToolCall | None:
    """{"name": ..., "arguments"|"parameters": {...}} (the whole of `body`) -> ToolCall."""
    try:
        obj, raw = _raw_value(body, 0)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    m = _ARGS_KEY.search(body)
    if isinstance(args, str) or m is None:  # arguments given as a JSON string
        return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
    try:
        _, raw_args = _raw_value(body, m.end())
    except ValueError:
        raw_args = json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], raw_args)


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_tool_calls(text: str, parser: str = "hermes") -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a whole output; no calls -> (text, [])."""
    if parser in ("hermes", "qwen"):
        if "<tool_call>" not in text:
            return text, []
        calls = [c for c in (_call_from_json(m.group(1).strip()) for m in _HERMES.finditer(text)) if c]
        if not calls:
            return text, []
        content = text[: text.index("<tool_call>")]  # as streamed (vLLM's hermes parser too)
        return (content if content.strip() else None), calls
    if parser == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls, pos = [], 0
        while pos < len(body):
            try:
                obj, raw = _raw_value(body, pos)
            except ValueError:
                return text, []
            call = _call_from_json(raw)
            if call is None:
                return text, []
            calls.append(call)
            pos = body.index(raw, pos) + len(raw)
            rest = body[pos:].lstrip()
            if rest.startswith(";"):
                pos = len(body) - len(rest) + 1
            elif rest:
                return text, []
            else:
                break
        return None, calls
    raise ValueError(f"tool parser must be one of {', '.join(TOOL_PARSERS)}; got {parser!r}.")


def parse_forced(text: str, choice) -> list[ToolCall]:
    """The calls of an output made under forced_structured_outputs()."""
    if isinstance(choice, dict):
        return [ToolCall(choice["name"], text.strip())]
    return _complete_items(text)[0]


class ToolCallStreamer:
    """Turns streamed text into OpenAI deltas: `feed(delta)` (and `finish()` at the end)
    return a list of {"content": str} and {"index", ["id", "name"], "arguments"} events.
    A call's first event carries its id and name (arguments ""), the next ones argument
    fragments; fragments concatenate to the non-streamed call's arguments."""

    _TAG, _END = "<tool_call>", "</tool_call>"

    def __init__(self, parser: str = "hermes", forced=None) -> None:
        self.parser = parser
        self.forced = forced
        self.text = ""
        self.pos = 0  # text before pos is handled
        self.index = -1  # the current call's index
        self.body_start = None  # in a hermes call: where its JSON starts
        self.sent_args = ""  # of the current call
        self.args_start = None
        self.calls: list[ToolCall] = []
        self.items_pos: int | None = None  # "required": where the next array element starts

    def feed(self, delta: str) -> list[dict]:
        self.text += delta
        if self.forced is not None:
            return self._feed_forced(final=False)
        if self.parser == "llama3_json":
            return []  # llama3's bare JSON is told from text only at the end
        return self._feed_hermes(final=False)

    def finish(self) -> list[dict]:
        if self.forced is not None:
            return self._feed_forced(final=True)
        if self.parser == "llama3_json":
            content, calls = parse_tool_calls(self.text, "llama3_json")
            if not calls:
                return [{"content": self.text}] if self.text else []
            self.calls = calls
            events = []
            for i, c in enumerate(calls):
                events.append({"index": i, "id": c.id, "name": c.name, "arguments": ""})
                events.append({"index": i, "arguments": c.arguments})
            return events
        return self._feed_hermes(final=True)

    # hermes / qwen
    def _feed_hermes(self, final: bool) -> list[dict]:
        events: list[dict] = []
        while True:
            if self.body_start is None:  # outside a call
                k = self.text.find(self._TAG, self.pos)
                if k < 0:
                    end = len(self.text) if final else _safe_end(self.text, self.pos, self._TAG)
                    if end > self.pos and self.index < 0:  # content only before the first call
                        events.append({"content": self.text[self.pos : end]})
                    self.pos = max(self.pos, end)
                    return events
                if k > self.pos and self.index < 0:
                    events.append({"content": self.text[self.pos : k]})
                self.body_start = self.pos = k + len(self._TAG)
                self.args_start, self.sent_args = None, ""
            close = self.text.find(self._END, self.body_start)
            body_end = close if close >= 0 else len(self.text)
            body = self.text[self.body_start : body_end]
            if self.args_start is None:
                m = re.match(
                    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)',
                    body,
                )
                if m is not None:
                    self.index += 1
                    call = ToolCall(json.loads(f'"{m.group(1)}"'), "")
                    self.calls.append(call)
                    events.append({"index": self.index, "id": call.id, "name": call.name, "arguments": ""})
                    self.args_start = m.end()
            done = close >= 0 or final
            if self.args_start is not None:
                if done:
                    call = _call_from_json(body.strip())
                    full = (
                        call.arguments
                        if call is not None
                        else body[self.args_start :].strip().removesuffix("}").rstrip()
                    )
                    self.calls[-1].arguments = full
                    more = full[len(self.sent_args) :] if full.startswith(self.sent_args) else ""
                else:
                    cur = body[self.args_start :]
                    for j in range(len(self._END) - 1, 0, -1):  # a partial "</tool_call" waits
                        if cur.endswith(self._END[:j]):
                            cur = cur[:-j]
                            break
                    cut = len(cur.rstrip(" \t\r\n}"))  # ... and so does the outer "}"
                    more = cur[len(self.sent_args) : cut] if cut > len(self.sent_args) else ""
                if more:
                    events.append({"index": self.index, "arguments": more})
                    self.sent_args += more
            if not done:
                return events
            self.pos = close + len(self._END) if close >= 0 else len(self.text)
            self.body_start = None
            if close < 0:
                return events

    # forced (named / required)
    def _feed_forced(self, final: bool) -> list[dict]:
        events: list[dict] = []
        if isinstance(self.forced, dict):  # the output is the arguments object
            if self.index < 0:
                self.index = 0
                self.calls.append(ToolCall(self.forced["name"], ""))
                events.append(
                    {"index": 0, "id": self.calls[0].id, "name": self.forced["name"], "arguments": ""}
                )
            target = self.text.strip() if final else self.text.lstrip()
            cut = len(target) if final else len(target.rstrip())
            more = target[len(self.sent_args) : cut]
            if more:
                events.append({"index": 0, "arguments": more})
                self.sent_args += more
            self.calls[0].arguments = self.sent_args
            return events
        if final:
            new = parse_forced(self.text, "required")[len(self.calls) :]
        else:
            new, self.items_pos = _complete_items(self.text, self.items_pos)
        for call in new:
            i = len(self.calls)
            self.calls.append(call)
            events.append({"index": i, "id": call.id, "name": call.name, "arguments": ""})
            events.append({"index": i, "arguments": call.arguments})
        return events


def _safe_end(text: str, start: int, tag: str) -> int:
    """End of what can be sent: all but a suffix that may begin `tag`."""
    for j in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:j]):
            return len(text) - j
    return len(text)


def _complete_items(text: str, pos: int | None = None) -> tuple[list[ToolCall], int | None]:
    """The complete elements of a streamed JSON array of calls from offset `pos` (None: from
    the opening "["), and the offset where the next element will start (None while the "["
    has not come): a stream resumes there instead of parsing its finished calls again."""
    if pos is None:
        s = text.lstrip()
        if not s.startswith("["):
            return [], None
        pos = len(text) - len(s) + 1
    calls = []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            _, raw = _raw_value(text, pos)
        except ValueError:
            return calls, pos
        pos += len(raw)
        call = _call_from_json(raw)
        if call is not None:
            calls.append(call)
