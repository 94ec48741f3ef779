"""What the sync and async clients share: how each call is built, how its
answer is read, when it is sent again, and the server-sent event decoder.
None of it does I/O."""

from __future__ import annotations

import base64
import json
import os
import re
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Any, Callable, Dict, Generic, List, Optional, Tuple, TypeVar, Union
from urllib.parse import quote

import httpx

from ._errors import RunboxError
from ._models import (
    Exit,
    FileInfo,
    Image,
    Lost,
    Preview,
    Process,
    Run,
    Started,
    Stderr,
    Stdout,
)

T = TypeVar("T")

DEFAULT_URL = "http://127.0.0.1:7439"
DEFAULT_TOKEN_FILE = "/var/lib/runbox/token"
# A call is sent at most this many more times (4 attempts in all).
DEFAULT_MAX_RETRIES = 3
# The longest wait before one retry, in seconds, whatever Retry-After says.
DEFAULT_MAX_RETRY_WAIT = 30.0
# The first wait after a connection failure, doubled each time (0.2, 0.4, 0.8 s).
RETRY_BACKOFF = 0.2
# Streams last as long as their command: only connecting is bounded.
STREAM_TIMEOUT = httpx.Timeout(None, connect=10.0)


def resolve(url: Optional[str], token: Optional[str]) -> Tuple[str, Optional[str]]:
    """The base URL and token: the arguments, else RUNBOX_URL and
    RUNBOX_TOKEN, else the default address and the token file in
    RUNBOX_STATE_DIR (default /var/lib/runbox)."""
    base = (url or os.environ.get("RUNBOX_URL") or DEFAULT_URL).rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"the runbox URL must be http:// or https://, not {base!r}")
    if token is None:
        token = os.environ.get("RUNBOX_TOKEN")
    if token is None:
        state = os.environ.get("RUNBOX_STATE_DIR", "/var/lib/runbox")
        try:
            with open(os.path.join(state, "token"), encoding="utf-8") as f:
                token = f.read().strip() or None
        except OSError:
            token = None
    return base, token


def segment(what: str, value: str) -> str:
    """One path segment, percent-encoded; `.` and `..` are refused, since URL
    normalisation would turn them into another route."""
    if value in ("", ".", ".."):
        raise ValueError(f"invalid {what} {value!r}")
    return quote(value, safe="")


def file_path(path: str) -> str:
    """A path below /work as URL segments."""
    parts = path.lstrip("/").split("/")
    if path.startswith("/work/"):
        parts = path[len("/work/"):].split("/")
    return "/".join(segment("file path", p) for p in parts)


def run_path(run_id: str) -> str:
    return f"/v1/runs/{segment('run id', run_id)}"


def process_path(run_id: str, process: Union[int, str]) -> str:
    return f"{run_path(run_id)}/processes/{segment('process', str(process))}"


@dataclass
class Call(Generic[T]):
    """One request, and how to read its successful answer."""

    method: str
    path: str
    json: Any = None
    params: Optional[Dict[str, Any]] = None
    content: Optional[bytes] = None
    headers: Dict[str, str] = field(default_factory=dict)
    parse: Callable[[Any], T] = lambda body: body  # type: ignore[assignment]
    # The answer has no body (204).
    empty: bool = False


def new_idempotency_key() -> str:
    """A fresh ``Idempotency-Key`` for one create (sent again, unchanged,
    on each of its retries)."""
    return str(uuid.uuid4())


def retry_after_seconds(value: Optional[str], now: Optional[datetime] = None) -> Optional[float]:
    """A ``Retry-After`` header's wait in seconds: delta-seconds (what
    runbox sends) or an HTTP date; None when absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    if re.fullmatch(r"[0-9]{1,10}", value):
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - (now or datetime.now(timezone.utc))).total_seconds())


def is_keyed_create(method: str, path: str, headers: Dict[str, str]) -> bool:
    """A create (``POST /v1/runs``) with an ``Idempotency-Key``: the server
    answers its repeat with the run the first attempt made."""
    return (
        method.upper() == "POST"
        and path.rstrip("/") == "/v1/runs"
        and any(k.lower() == "idempotency-key" and v for k, v in headers.items())
    )


def repeatable(method: str, path: str, headers: Dict[str, str]) -> bool:
    """Whether a request may be sent again after the server answered it
    (``429``/``503`` with ``Retry-After``): GET, HEAD, DELETE, and keyed
    creates. Any other POST, PUT or PATCH may have done something."""
    return method.upper() in ("GET", "HEAD", "DELETE") or is_keyed_create(method, path, headers)


def replayable(content: Any) -> bool:
    """Whether a request body can be sent again: none, or bytes (never a
    stream or an iterator, which the first attempt consumed)."""
    return content is None or isinstance(content, (bytes, bytearray, memoryview, str))


def connect_failed(error: BaseException) -> bool:
    """The connection could not be made: the request never left."""
    return isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout))


def answer_lost(error: BaseException) -> bool:
    """The request went (or may have), and the connection broke before the
    whole answer came. Read timeouts are not counted: a server that did not
    answer in time is not asked again, so ``timeout`` keeps bounding a call."""
    return isinstance(error, (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError))


@dataclass(frozen=True)
class RetryPolicy:
    """When a call is sent again, and after how long (pure logic: the
    clients do the waiting).

    At most ``max_retries`` more attempts (0: none), whatever made them:

    - a connection that could not be made (refused, no route): any
      request, since it never reached the server; after ``backoff``,
      doubled each time (0.2, 0.4, 0.8 s);
    - an answer lost on the way (the connection broke after the request
      went): GET, HEAD and keyed creates only, with the same backoff;
    - a ``429`` or ``503`` carrying ``Retry-After`` (``capacity``,
      ``tenant_quota``, ``draining``; the server changed nothing): GET,
      HEAD, DELETE and keyed creates, after ``Retry-After``, each wait
      capped at ``max_wait`` seconds; ``503 run_moved`` (the run moved to
      another node of the fleet first): any request.

    A body that cannot be replayed (a stream) is never sent again.
    """

    max_retries: int = DEFAULT_MAX_RETRIES
    max_wait: float = DEFAULT_MAX_RETRY_WAIT
    backoff: float = RETRY_BACKOFF

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be 0 or more, not {self.max_retries}")
        if self.max_wait < 0:
            raise ValueError(f"the longest retry wait must be 0 or more, not {self.max_wait}")

    def after_answer(
        self,
        call: "Call[Any]",
        status: int,
        retry_after: Optional[str],
        retries: int,
        code: Optional[str] = None,
    ) -> Optional[float]:
        """The wait before sending ``call`` again when the server answered it
        with ``status`` (its error ``code``, and this ``Retry-After``), after
        ``retries`` retries so far; None: do not. A ``run_moved`` answer
        (the run moved to another node before the call did anything) is
        sent again whatever the method."""
        if retries >= self.max_retries or status not in (429, 503):
            return None
        moved = status == 503 and code == "run_moved"
        if not (moved or repeatable(call.method, call.path, call.headers)) or not replayable(call.content):
            return None
        wait = retry_after_seconds(retry_after)
        if wait is None:
            return None
        return min(wait, self.max_wait)

    def after_error(self, call: "Call[Any]", error: BaseException, retries: int) -> Optional[float]:
        """The wait before sending ``call`` again when it failed with
        ``error`` and no answer, after ``retries`` retries so far; None: do
        not."""
        if retries >= self.max_retries or not replayable(call.content):
            return None
        lost_but_safe = answer_lost(error) and (
            call.method.upper() in ("GET", "HEAD") or is_keyed_create(call.method, call.path, call.headers)
        )
        if not (connect_failed(error) or lost_but_safe):
            return None
        return min(self.backoff * 2**retries, self.max_wait)


def compact(**fields: Any) -> Dict[str, Any]:
    """A JSON body without the fields left as None."""
    return {k: v for k, v in fields.items() if v is not None}


def lease_params(lease: Optional[Tuple[str, int]]) -> Dict[str, Any]:
    if lease is None:
        return {}
    owner, generation = lease
    return {"owner": owner, "generation": generation}


def exec_body(
    cmd: Union[str, List[str]],
    *,
    cwd: Optional[str] = None,
    env: Optional[Dict[str, str]] = None,
    timeout: Optional[int] = None,
    user: Optional[str] = None,
    stdin: Optional[str] = None,
    pty: Optional[Tuple[int, int]] = None,
    term: Optional[str] = None,
    tag: Optional[str] = None,
    open_stdin: bool = False,
    lease: Optional[Tuple[str, int]] = None,
) -> Dict[str, Any]:
    """An ExecRequest. A string command runs through `sh -c`."""
    argv = ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
    body = compact(
        cmd=argv,
        cwd=cwd,
        env=env,
        timeoutSec=timeout,
        user=user,
        stdin=stdin,
        tag=tag,
        openStdin=True if open_stdin else None,
    )
    if pty is not None:
        body["pty"] = compact(rows=pty[0], cols=pty[1], term=term)
    if lease is not None:
        body["owner"], body["generation"] = lease
    return body


class EventDecoder:
    """Server-sent events from byte chunks split anywhere, as exec events.

    Unknown event names are skipped (a newer daemon may add some); nothing
    after `exit` is returned.
    """

    def __init__(self) -> None:
        self._buf = b""
        self._name = ""
        self._data: List[str] = []
        self.done = False

    def feed(self, chunk: bytes) -> List[Any]:
        out: List[Any] = []
        self._buf += chunk
        while not self.done:
            at = self._buf.find(b"\n")
            if at < 0:
                break
            line = self._buf[:at].rstrip(b"\r").decode("utf-8", "replace")
            self._buf = self._buf[at + 1:]
            if line == "":
                event = self._dispatch()
                if event is not None:
                    out.append(event)
                    if isinstance(event, Exit):
                        self.done = True
            elif line.startswith(":"):
                continue
            else:
                name, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if name == "event":
                    self._name = value
                elif name == "data":
                    self._data.append(value)
        return out

    def _dispatch(self) -> Any:
        name, data = self._name, "\n".join(self._data)
        self._name, self._data = "", []
        if name == "started":
            return Started(json.loads(data)["pid"])
        if name == "stdout":
            return Stdout(base64.b64decode(data.replace("\n", "")))
        if name == "stderr":
            return Stderr(base64.b64decode(data.replace("\n", "")))
        if name == "lost":
            return Lost(json.loads(data)["chunks"])
        if name == "exit":
            return Exit.from_json(json.loads(data))
        return None


class JsonEventDecoder(EventDecoder):
    """Server-sent events whose data is JSON (watch, pull), as dicts with
    the event's name under ``event``."""

    def _dispatch(self) -> Any:
        name, data = self._name, "\n".join(self._data)
        self._name, self._data = "", []
        if not name and not data:
            return None
        value = json.loads(data) if data else {}
        if isinstance(value, dict):
            value.setdefault("event", name)
        return value


def parse_runs(body: Any) -> List[Run]:
    return [Run.from_json(r) for r in body["runs"]]


def parse_processes(body: Any) -> List[Process]:
    return [Process.from_json(p) for p in body["processes"]]


def parse_entries(body: Any) -> List[FileInfo]:
    return [FileInfo.from_json(e) for e in body["entries"]]


def parse_images(body: Any) -> List[Image]:
    return [Image.from_json(i) for i in body["images"]]


def check_exit(events: List[Any], ended: bool) -> None:
    if ended and not any(isinstance(e, Exit) for e in events):
        from ._errors import StreamEnded

        raise StreamEnded()


__all__ = [
    "Call",
    "EventDecoder",
    "JsonEventDecoder",
    "Preview",
    "RetryPolicy",
    "RunboxError",
    "exec_body",
    "resolve",
]
