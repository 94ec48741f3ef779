"""What the sync and async clients share: how each call is built, how its
answer is read, and the server-sent event decoder. Neither does I/O."""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Generic, List, Optional, Tuple, TypeVar, Union
from urllib.parse import quote

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
    "RunboxError",
    "exec_body",
    "resolve",
]
