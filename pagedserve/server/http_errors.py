"""HTTP errors in OpenAI's shape: the error body, the typed APIError, the mapping from the
engine's typed errors (InvalidRequestError -> 400 naming its `param`, EngineDeadError ->
503), and the app's exception handlers (no request ever gets a 500 for bad input)."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.errors import EngineDeadError, InvalidRequestError

logger = logging.getLogger(__name__)

QUOTE_CHARS = 64  # error messages quote at most this much of any user input


def quote(value, limit: int = QUOTE_CHARS) -> str:
    """A short, printable, always-encodable rendering of user input for error messages."""
    s = value if isinstance(value, str) else repr(value)
    cut = len(s) > limit
    s = s[:limit].encode("utf-8", "backslashreplace").decode("utf-8")
    return repr(s + "...") if cut else repr(s)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error envelope; `code` is a string or null as OpenAI's clients expect."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code, self.headers = code, headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, safe_message(message), "invalid_request_error", param)


def to_api_error(e: BaseException) -> APIError:
    """Typed errors from the engine/input processor -> HTTP. InvalidRequestError carries its
    OpenAI `param`; a plain ValueError is still a 400 (param null); a dead engine is a 503."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidRequestError):
        return bad_request(str(e), e.param)
    if isinstance(e, ValueError):
        return bad_request(str(e))
    if isinstance(e, EngineDeadError):
        return APIError(503, "the engine is not running", "server_error", code="engine_dead")
    return APIError(500, "internal server error", "server_error")


def safe_message(message: str, limit: int = 1024) -> str:
    """Messages built by lower layers may embed user input: bound and make encodable."""
    if len(message) > limit:
        message = message[:limit] + "..."
    return message.encode("utf-8", "backslashreplace").decode("utf-8")


ANTHROPIC_PATHS = ("/v1/messages",)
_ANTHROPIC_TYPES = {
    "server_overloaded": "overloaded_error",
    "server_error": "api_error",
    "timeout_error": "api_error",
    "not_found_error": "not_found_error",
    "authentication_error": "authentication_error",
}


def shaped(path: str, body: dict) -> dict:
    """An error body in the shape of the API at `path`: Anthropic's {"type": "error",
    "error": {"type", "message"}} on its paths, OpenAI's everywhere else."""
    if not path.startswith(ANTHROPIC_PATHS) or "error" not in body:
        return body
    e = body["error"]
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(e.get("type"), "invalid_request_error"), "message": e.get("message", "")}}


def _shape(handler):
    async def wrapped(request: Request, e):
        resp = await handler(request, e)
        if request.url.path.startswith(ANTHROPIC_PATHS):
            body = shaped(request.url.path, json.loads(resp.body))
            return JSONResponse(body, status_code=resp.status_code, headers={k: v for k, v in resp.headers.items() if k.lower() == "retry-after"})
        return resp

    return wrapped


def install_error_handlers(app: FastAPI) -> None:
    """APIError as itself; the engine's typed errors as theirs (InvalidRequestError a 400
    naming its param, EngineDeadError a 503); request-validation failures as a 400 naming
    the top-level field; HTTP errors (404, 405) in the error shape; anything else a logged
    500 for that request."""
    for kind, handler in (
        (APIError, _api_error),
        (InvalidRequestError, _typed_error),
        (EngineDeadError, _typed_error),
        (RequestValidationError, _validation_error),
        (StarletteHTTPException, _http_error),
        (Exception, _internal_error),
    ):
        app.add_exception_handler(kind, _shape(handler))


async def _api_error(_: Request, e: APIError):
    return e.response()


async def _typed_error(_: Request, e: Exception):
    return to_api_error(e).response()


async def _validation_error(_: Request, e: RequestValidationError):
    errs = e.errors()
    first = errs[0] if errs else {}
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, InvalidRequestError):
        return APIError(400, safe_message(str(cause)), param=cause.param).response()
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = loc[0][:64] if loc else None  # the top-level field, in OpenAI's terms
    if first.get("type") == "json_invalid":
        msg = "request body is not valid JSON"
    elif param == "prompt" and len(loc) > 1:
        msg = "prompt must be a string, a list of strings, a list of token ids (JSON integers) or a list of such lists"
    else:
        msg = f"{'.'.join(loc)[:128] or 'body'}: {first.get('msg', 'invalid value')}"
    return APIError(400, safe_message(msg), param=param).response()


async def _http_error(_: Request, e: StarletteHTTPException):
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(safe_message(str(e.detail)), kind), status_code=e.status_code)


async def _internal_error(_: Request, e: Exception):  # one request fails, the server does not
    logger.exception("request failed")
    return JSONResponse(error_body("internal server error", "server_error"), status_code=500)
