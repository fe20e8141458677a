"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with the right status."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("kvstrata.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})
_TAG_PREFIXES = ("function-", "constrained-", "lax-", "strict-")


class APIError(Exception):
    """An error reported to the client; raise it anywhere below a route."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def __reduce__(self) -> tuple[Any, ...]:  # pickled whole: the engine process raises them too
        return (type(self), (self.status, self.message), {"param": self.param, "code": self.code})

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(error_body(status, message, param=param, code=code), status, headers=headers)


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif item in ("body",) and not parts:
            continue
        elif isinstance(item, str) and (item in _TYPE_TAGS or "[" in item or item.startswith(_TAG_PREFIXES)):
            continue  # pydantic names union members in the location; they say nothing to a client
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or None


def validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = _loc_to_param(tuple(first.get("loc", ())))
    msg = str(first.get("msg", "invalid request"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    message = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return APIError(400, message, param=param, code="invalid_value")


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(exc)
        return error_response(err.status, err.message, param=err.param, code=err.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error: %s", exc)
        return error_response(500, "internal server error", code="internal_error")
