"""Errors in the caller's API's own shape, with the right status, never a stack trace.

Route code raises ``GatewayError``; the app's handlers turn it (and FastAPI's own errors, and
anything unexpected) into OpenAI's ``{"error": {message, type, param, code}}`` or Anthropic's
``{"type": "error", "error": {type, message}}`` depending on the path that was called.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import ValidationError

ApiFlavor = Literal["openai", "anthropic"]

# Anthropic names its error types by status.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class GatewayError(Exception):
    """A client-visible failure. ``code`` and ``param`` follow OpenAI's conventions."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers


def flavor_of(path: str) -> ApiFlavor:
    """Which wire format a path speaks (``/v1/messages`` is Anthropic's, the rest OpenAI's)."""
    return "anthropic" if path.rstrip("/").startswith("/v1/messages") else "openai"


def error_body(
    flavor: ApiFlavor,
    status: int,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
) -> dict[str, Any]:
    if flavor == "anthropic":
        return {
            "type": "error",
            "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message},
        }
    return {
        "error": {
            "message": message,
            "type": _OPENAI_TYPES.get(
                status, "server_error" if status >= 500 else "invalid_request_error"
            ),
            "param": param,
            "code": code,
        }
    }


def error_response(flavor: ApiFlavor, err: GatewayError) -> JSONResponse:
    return JSONResponse(
        error_body(flavor, err.status, err.message, code=err.code, param=err.param),
        status_code=err.status,
        headers=err.headers,
    )


def from_validation(exc: ValidationError | Any, *, status: int = 400) -> GatewayError:
    """A schema violation as a 400 that names the offending parameter."""
    errors = exc.errors() if hasattr(exc, "errors") else []
    if not errors:
        return GatewayError(status, "invalid request body", code="invalid_request")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return GatewayError(
            400, "We could not parse the JSON body of your request.", code="invalid_json"
        )
    if first.get("type") == "extra_forbidden":
        return GatewayError(
            status,
            f"Unrecognized request argument supplied: {param}",
            param=param,
            code="unknown_parameter",
        )
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    where = f"'{param}'" if param else "request body"
    return GatewayError(
        status, f"Invalid value for {where}: {msg}", param=param, code="invalid_value"
    )


def unsupported(param: str, why: str = "") -> GatewayError:
    tail = f" {why}" if why else ""
    return GatewayError(
        400,
        f"Unsupported parameter: '{param}' is not supported by this server.{tail}",
        param=param,
        code="unsupported_parameter",
    )
