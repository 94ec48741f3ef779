"""Errors: every failure the SDK reports is a :class:`RunboxError`."""

from __future__ import annotations

import json
from typing import Optional


class RunboxError(Exception):
    """The daemon answered with an error, or could not be talked to.

    ``code`` is the API's stable error code (``run_not_found``,
    ``command_not_found``, ...; see docs/api.md), ``status`` the HTTP status
    (0 when no answer came), ``message`` what to fix.
    """

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{message} ({code})")
        self.status = status
        self.code = code
        self.message = message


class BadRequest(RunboxError):
    """A 400: the request breaks a rule; the message says which."""


class Unauthorized(RunboxError):
    """A 401: no token, or the wrong one."""


class Forbidden(RunboxError):
    """A 403: a path escapes /work, the run refuses, a preview token is bad."""


class NotFound(RunboxError):
    """A 404: no such run, image, file, process or route."""


class Conflict(RunboxError):
    """A 409: the state refuses it (a lease, a tag in use, a run not running)."""


class TooLarge(RunboxError):
    """A 413: the body is larger than the server takes."""


class Unavailable(RunboxError):
    """A 429, 502, 503 or 507: capacity, the run's agent, draining, storage."""


class BuildFailed(RunboxError):
    """An image build ended without its image: a step failed (``build``
    holds the build with its ``error``: the step, its exit code and last
    lines of output), it timed out, or it was cancelled."""

    def __init__(self, build: dict) -> None:
        error = build.get("error") or {}
        super().__init__(0, error.get("code", "build_failed"), error.get("message", "the build failed"))
        self.build = build


class StreamEnded(RunboxError):
    """An exec or session stream ended without its exit: the connection
    broke, and the command's fate is unknown."""

    def __init__(self, message: str = "the stream ended without an exit event") -> None:
        super().__init__(0, "stream_ended", message)


_BY_STATUS = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: TooLarge,
    429: Unavailable,
    502: Unavailable,
    503: Unavailable,
    507: Unavailable,
}


def error_from(status: int, body: bytes, reason: Optional[str] = None) -> RunboxError:
    """The error for a non-2xx answer; a body that is not runbox's error
    shape becomes code ``http_<status>`` with (a bounded prefix of) the text."""
    code, message = f"http_{status}", (reason or "").strip() or f"HTTP {status}"
    try:
        detail = json.loads(body)["error"]
        code, message = str(detail["code"]), str(detail["message"])
    except (ValueError, KeyError, TypeError):
        text = body[:512].decode("utf-8", "replace").strip()
        if text:
            message = text
    cls = _BY_STATUS.get(status, RunboxError)
    return cls(status, code, message)
