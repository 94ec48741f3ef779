"""Interactive sessions over WebSocket (the frames of docs/api.md,
"WebSocket sessions"): binary frames carry stdin in and output out (first
byte 1 stdout, 2 stderr), text frames JSON control."""

from __future__ import annotations

import json
from typing import Any, Dict, Iterator, Optional, Union

from ._errors import RunboxError, StreamEnded, error_from
from ._models import ExecResult, Exit, Lost, Stderr, Stdout

MAX_MESSAGE = 2 << 20


def ws_url(base: str, path: str) -> str:
    return "ws" + base[len("http"):] + path


def decode_frame(message: Union[str, bytes]) -> Any:
    """One server frame as an event; None for frames to skip."""
    if isinstance(message, (bytes, bytearray)):
        if not message:
            return None
        kind, data = message[0], bytes(message[1:])
        if kind == 1:
            return Stdout(data)
        if kind == 2:
            return Stderr(data)
        return None
    frame = json.loads(message)
    kind = frame.get("type")
    if kind == "exit":
        return Exit.from_json(frame)
    if kind == "lost":
        return Lost(frame["chunks"])
    if kind == "error":
        return RunboxError(400, frame.get("code", "error"), frame.get("message", ""))
    return None


def control(kind: str, **fields: Any) -> str:
    return json.dumps({"type": kind, **fields})


def headers(token: Optional[str]) -> Dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


class Session:
    """An interactive command (or an attach) over a WebSocket.

    Send with :meth:`send`, :meth:`eof`, :meth:`signal`, :meth:`resize`; read
    with :meth:`events` or :meth:`wait`. Closing the session kills a command
    it started; an attached process keeps running.
    """

    def __init__(self, ws: Any, pid: int, opened: Any = None) -> None:
        self._ws = ws
        self._opened = opened
        self.pid = pid
        self.exit: Optional[Exit] = None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def send(self, data: Union[bytes, str]) -> None:
        """Bytes (or text) for stdin; on a terminal, keystrokes."""
        self._ws.send(data.encode() if isinstance(data, str) else bytes(data))

    def eof(self) -> None:
        """Close stdin (on a terminal: send ^D)."""
        self._ws.send(control("eof"))

    def signal(self, signal: Union[int, str]) -> None:
        self._ws.send(control("signal", signal=signal))

    def resize(self, rows: int, cols: int) -> None:
        self._ws.send(control("resize", rows=rows, cols=cols))

    def events(self) -> Iterator[Any]:
        """Output events, ending with the :class:`Exit`."""
        from websockets.exceptions import ConnectionClosed

        while self.exit is None:
            try:
                message = self._ws.recv()
            except ConnectionClosed as e:
                raise StreamEnded(f"the session closed before the exit: {e}") from e
            event = decode_frame(message)
            if isinstance(event, RunboxError):
                # A refused input frame; the session goes on.
                continue
            if event is None:
                continue
            if isinstance(event, Exit):
                self.exit = event
            yield event

    def wait(self) -> ExecResult:
        """Read to the end: all output and the exit."""
        out, err = bytearray(), bytearray()
        for event in self.events():
            if isinstance(event, Stdout):
                out += event.data
            elif isinstance(event, Stderr):
                err += event.data
        assert self.exit is not None
        return ExecResult(self.pid, bytes(out), bytes(err), self.exit)

    def close(self) -> None:
        if self._opened is not None:
            self._opened.__exit__(None, None, None)
            self._opened = None
        else:
            self._ws.close()


def open_session(base: str, token: Optional[str], path: str, start: Optional[Dict[str, Any]]) -> Session:
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    try:
        # Entered here and left by Session.close: the session outlives
        # this function, so no `with` block can hold it.
        opened = connect(ws_url(base, path), additional_headers=headers(token), max_size=MAX_MESSAGE)
        ws = opened.__enter__()
    except InvalidStatus as e:
        raise error_from(e.response.status_code, e.response.body or b"") from e
    except OSError as e:
        raise RunboxError(0, "unreachable", f"cannot reach runbox at {base}: {e}") from e
    session = Session(ws, 0, opened)
    if start is not None:
        ws.send(control("start", **start))
    first = json.loads(ws.recv())
    if first.get("type") == "error":
        session.close()
        raise error_from(int(first.get("status", 400)), json.dumps({"error": first}).encode())
    if first.get("type") != "started":
        session.close()
        raise StreamEnded("the session did not begin with started")
    session.pid = first["pid"]
    return session
