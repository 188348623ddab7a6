"""Typed errors shared by every layer (imports nothing from the package)."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses; nothing of it was queued.

    `param` names the offending field in OpenAI's terms (e.g. "max_tokens", "messages"),
    so the server maps it to a 400 with that `param` without parsing the message.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine core stopped (an executor fault, or its process died); in-flight
    requests fail with this and new ones are refused."""


class RequestFailedError(RuntimeError):
    """One request failed on an internal error (a bug while processing its inputs or
    outputs); it was aborted (its KV blocks freed) and the engine goes on. The server
    answers it with a 500; other requests are unaffected."""
