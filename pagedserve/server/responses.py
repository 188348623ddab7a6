"""The pieces of OpenAI responses every endpoint builds: the envelope, usage, server-sent
events, and token logprobs in completions' and chat's shapes."""

from __future__ import annotations

import json
import logging

from pagedserve.server.http_errors import APIError, to_api_error

logger = logging.getLogger(__name__)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def envelope(rid: str, obj: str, created: int, model: str, choices: list, usage_: dict | None = None) -> dict:
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    return out


# Characters that JSON leaves raw (ensure_ascii=False) but that line splitters following
# str.splitlines end a line at (httpx's iter_lines among them): escaped, so an event's data
# stays one line whatever text the model writes (a random model's bytes gave U+0085 in a test).
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(obj) -> str:
    """One server-sent event: `data: ` + the object's JSON on one line (non-ASCII text kept as
    UTF-8, except the characters some clients take for line breaks)."""
    s = json.dumps(obj, ensure_ascii=False)
    return f"data: {s if s.isascii() else s.translate(_LINE_BREAKS)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def stream_error_events(e: Exception, what: str) -> list[str]:
    """A stream that failed mid-way: its OpenAI error event (none when the server is shutting
    down), after logging an unexpected server error (`what` names the stream)."""
    err = to_api_error(e)
    if err.status >= 500 and not isinstance(e, APIError):
        logger.exception("%s failed", what)
    return [] if err.code == "shutting_down" else [sse(err.body())]


MIN_LOGPROB = -9999.0  # vLLM's stand-in for -inf (a token masked by a constraint): JSON has no -inf


def finite_logprob(v: float | None) -> float | None:
    """A logprob JSON can carry: -inf (and NaN) become MIN_LOGPROB."""
    if v is None or v >= MIN_LOGPROB:
        return v
    return MIN_LOGPROB


class LogprobFormatter:
    """Token logprobs in OpenAI's two shapes (completions' parallel lists, chat's content list)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def text(self, d, tid: int) -> tuple[str, float | None]:
        lp = d.get(tid) if d is not None else None
        if lp is None:
            return self.tokenizer.decode([tid]), None
        return (
            lp.decoded_token if lp.decoded_token is not None else self.tokenizer.decode([tid])
        ), finite_logprob(lp.logprob)

    @staticmethod
    def ranked(d, k: int) -> list[int]:
        """The k most likely token ids at one position, best first."""
        return sorted((t for t in d if d[t].rank is not None), key=lambda t: d[t].rank)[:k]

    def completion(self, entries, token_ids, k: int, offset: int = 0) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        pos = offset
        for d, tid in zip(entries, token_ids):
            tok, lp = self.text(d, tid)
            top = None
            if d is not None:
                top = {}
                for t in self.ranked(d, k):
                    s, v = self.text(d, t)
                    if s in top:  # two tokens with the same text (e.g. partial bytes): name them apart
                        s = self.tokenizer.convert_ids_to_tokens(t) or ""
                        if s in top or not s:
                            s = f"<|token_id:{t}|>"
                    top[s] = v
            out["tokens"].append(tok)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(top)
            out["text_offset"].append(pos)
            pos += len(tok)
        return out

    def chat(self, entries, token_ids, k: int) -> dict:
        content = []
        for d, tid in zip(entries, token_ids):
            tok, lp = self.text(d, tid)
            tops = []
            for t in self.ranked(d, k) if d is not None else ():
                s, v = self.text(d, t)
                tops.append({"token": s, "logprob": v, "bytes": list(s.encode("utf-8", "replace"))})
            content.append(
                {
                    "token": tok,
                    "logprob": lp,
                    "bytes": list(tok.encode("utf-8", "replace")),
                    "top_logprobs": tops,
                }
            )
        return {"content": content}
