"""Request-supplied chat templates (only with --trust-request-chat-template).

A template is code: `{% for i in range(99999) %}{{ 'x' * 99999 }}{% endfor %}` builds a
gigabyte string. So a request's template is rendered in a short-lived child process
(plain Python + jinja2, nothing of the server imported) under a memory limit
(RLIMIT_AS), a CPU-time limit and a wall-clock timeout, in Jinja's immutable sandbox,
and its output is bounded. The model's own template (from the tokenizer) is trusted and
rendered by transformers, off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys

from pagedserve.errors import InvalidRequestError

TIMEOUT_S = 5.0
MEMORY_BYTES = 512 << 20
MAX_OUTPUT_CHARS = 8 << 20

_CHILD = r"""
import json, resource, sys
mem, cpu, max_chars = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
try:
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.exceptions import TemplateError

    req = json.loads(sys.stdin.buffer.read())

    def raise_exception(msg):
        raise TemplateError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    tmpl = env.from_string(req["template"])
    out, n = [], 0
    for piece in tmpl.generate(**req["variables"]):
        n += len(piece)
        if n > max_chars:
            raise ValueError(f"the rendered template is longer than {max_chars} characters")
        out.append(piece)
    res = {"text": "".join(out)}
except MemoryError:
    res = {"error": "the template needed more memory than allowed"}
except BaseException as e:
    res = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
sys.stdout.write(json.dumps(res))
"""


async def render_request_template(
    template: str,
    messages: list[dict],
    add_generation_prompt: bool,
    special_tokens: dict,
    timeout: float = TIMEOUT_S,
    memory_bytes: int = MEMORY_BYTES,
    max_chars: int = MAX_OUTPUT_CHARS,
    tools: list[dict] | None = None,
) -> str:
    """The rendered prompt text, or InvalidRequestError(param="chat_template"). `tools`
    (OpenAI's shape) is the template's `tools` variable, as transformers passes it."""
    variables = {"messages": messages, "add_generation_prompt": add_generation_prompt, **special_tokens}
    if tools:
        variables["tools"] = tools
    payload = json.dumps({"template": template, "variables": variables}).encode()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        "-c",
        _CHILD,
        str(memory_bytes),
        str(max(1, int(timeout))),
        str(max_chars),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(payload), timeout)
    except (asyncio.TimeoutError, asyncio.CancelledError) as e:
        # the child may have just died of its own CPU limit (which equals the timeout):
        # killing an exited process raises ProcessLookupError
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        if isinstance(e, asyncio.CancelledError):
            raise
        raise InvalidRequestError(
            f"the chat template took longer than {timeout:g} s to render.", "chat_template"
        ) from None
    try:
        res = json.loads(out)
    except ValueError:
        res = {"error": f"the template renderer exited with status {proc.returncode} (resource limit)"}
    if "error" in res:
        raise InvalidRequestError(f"could not apply the chat template: {res['error']}", "chat_template")
    return res["text"]
