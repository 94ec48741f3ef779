"""The asynchronous client: the same surface as :class:`runbox.Runbox`,
every call awaitable, streams as async iterators."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Tuple, Union

import httpx

from . import _calls as calls
from ._core import (
    DEFAULT_MAX_RETRIES,
    DEFAULT_MAX_RETRY_WAIT,
    STREAM_TIMEOUT,
    Call,
    EventDecoder,
    JsonEventDecoder,
    RetryPolicy,
    exec_body,
    file_path,
    process_path,
    resolve,
    run_path,
)
from ._errors import RunboxError, StreamEnded, error_from
from ._models import (
    ExecResult,
    Exit,
    FileInfo,
    History,
    HistoryDiff,
    Image,
    Lease,
    Preview,
    Process,
    Run,
    Started,
    Stderr,
    Stdout,
)
from ._session import MAX_MESSAGE, control, decode_frame, headers, ws_url

Lease_ = Optional[Tuple[str, int]]


class AsyncSession:
    """:class:`runbox.Session`, awaitable."""

    def __init__(self, ws: Any, pid: int) -> None:
        self._ws = ws
        self.pid = pid
        self.exit: Optional[Exit] = None

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, *_: Any) -> None:
        await self.close()

    async def send(self, data: Union[bytes, str]) -> None:
        await self._ws.send(data.encode() if isinstance(data, str) else bytes(data))

    async def eof(self) -> None:
        await self._ws.send(control("eof"))

    async def signal(self, signal: Union[int, str]) -> None:
        await self._ws.send(control("signal", signal=signal))

    async def resize(self, rows: int, cols: int) -> None:
        await self._ws.send(control("resize", rows=rows, cols=cols))

    async def events(self) -> AsyncIterator[Any]:
        from websockets.exceptions import ConnectionClosed

        while self.exit is None:
            try:
                message = await self._ws.recv()
            except ConnectionClosed as e:
                raise StreamEnded(f"the session closed before the exit: {e}") from e
            event = decode_frame(message)
            if event is None or isinstance(event, RunboxError):
                continue
            if isinstance(event, Exit):
                self.exit = event
            yield event

    async def wait(self) -> ExecResult:
        out, err = bytearray(), bytearray()
        async for event in self.events():
            if isinstance(event, Stdout):
                out += event.data
            elif isinstance(event, Stderr):
                err += event.data
        assert self.exit is not None
        return ExecResult(self.pid, bytes(out), bytes(err), self.exit)

    async def close(self) -> None:
        await self._ws.close()


async def _open_session(base: str, token: Optional[str], path: str, start: Optional[Dict[str, Any]]) -> AsyncSession:
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    try:
        ws = await connect(ws_url(base, path), additional_headers=headers(token), max_size=MAX_MESSAGE)
    except InvalidStatus as e:
        raise error_from(e.response.status_code, e.response.body or b"") from e
    except OSError as e:
        raise RunboxError(0, "unreachable", f"cannot reach runbox at {base}: {e}") from e
    if start is not None:
        await ws.send(control("start", **start))
    first = json.loads(await ws.recv())
    if first.get("type") == "error":
        await ws.close()
        raise error_from(int(first.get("status", 400)), json.dumps({"error": first}).encode())
    if first.get("type") != "started":
        await ws.close()
        raise StreamEnded("the session did not begin with started")
    return AsyncSession(ws, first["pid"])


class AsyncRunbox:
    """An async connection to one runbox daemon; see :class:`runbox.Runbox`
    (the same arguments, the same retries of what is safe to repeat)."""

    def __init__(
        self,
        url: Optional[str] = None,
        token: Optional[str] = None,
        *,
        timeout: float = 60.0,
        http: Optional[httpx.AsyncClient] = None,
        max_retries: int = DEFAULT_MAX_RETRIES,
        max_retry_wait: float = DEFAULT_MAX_RETRY_WAIT,
    ) -> None:
        self.url, self._token = resolve(url, token)
        self._retry = RetryPolicy(max_retries, max_retry_wait)
        hdrs = {"User-Agent": "runbox-python/0.1"}
        if self._token:
            hdrs["Authorization"] = f"Bearer {self._token}"
        self._http = http or httpx.AsyncClient(
            base_url=self.url,
            headers=hdrs,
            timeout=httpx.Timeout(timeout, connect=10.0),
            follow_redirects=False,
        )

    async def __aenter__(self) -> "AsyncRunbox":
        return self

    async def __aexit__(self, *_: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _open(self, call: Call[Any], stream: bool = False) -> httpx.Response:
        """Sends ``call``, again as long as the retry policy allows, and
        returns its successful answer (unread when ``stream``: close it).
        Raises the error an unsuccessful answer carries, and httpx's error
        when no answer came."""
        retries = 0
        while True:
            request = self._http.build_request(
                call.method,
                call.path,
                json=call.json,
                params=call.params,
                content=call.content,
                headers=call.headers,
                timeout=STREAM_TIMEOUT if stream else httpx.USE_CLIENT_DEFAULT,
            )
            try:
                response = await self._http.send(request, stream=stream)
            except httpx.HTTPError as e:
                wait = self._retry.after_error(call, e, retries)
                if wait is None:
                    raise
            else:
                if response.status_code < 300:
                    return response
                if stream:
                    try:
                        await response.aread()
                    finally:
                        await response.aclose()
                error = error_from(response.status_code, response.content, response.reason_phrase)
                wait = self._retry.after_answer(
                    call, response.status_code, response.headers.get("Retry-After"), retries, error.code
                )
                if wait is None:
                    raise error
            retries += 1
            await asyncio.sleep(wait)

    async def _send(self, call: Call[Any]) -> httpx.Response:
        try:
            return await self._open(call)
        except httpx.HTTPError as e:
            raise RunboxError(0, "unreachable", f"cannot reach runbox at {self.url}: {e}") from e

    async def _do(self, call: Call[Any]) -> Any:
        response = await self._send(call)
        if call.empty or not response.content:
            return None
        return call.parse(response.json())

    async def _stream(self, method: str, path: str, decoder: EventDecoder, **kwargs: Any) -> AsyncIterator[Any]:
        try:
            # Sent again only until it is answered: once events flow, a
            # broken stream is the caller's to judge.
            response = await self._open(Call(method, path, **kwargs), stream=True)
            try:
                async for chunk in response.aiter_raw():
                    for event in decoder.feed(chunk):
                        yield event
                    if decoder.done:
                        return
            finally:
                await response.aclose()
        except httpx.HTTPError as e:
            raise StreamEnded(f"the stream broke: {e}") from e
        if not isinstance(decoder, JsonEventDecoder):
            raise StreamEnded()

    async def health(self) -> Dict[str, Any]:
        return await self._do(calls.health())

    async def create_run(self, image: Optional[str] = None, **kwargs: Any) -> Run:
        return await self._do(calls.create_run(image, **kwargs))

    async def list_runs(self, labels: Optional[Union[Dict[str, Optional[str]], List[str]]] = None) -> List[Run]:
        """The runs this token may see; with ``labels`` (``{"team": "a",
        "job": None}`` or ``["team=a", "job"]``) only those whose labels
        match every term (None, or a bare key: the label is set)."""
        return await self._do(calls.list_runs(labels))

    async def get_run(self, run_id: str) -> Run:
        return await self._do(calls.get_run(run_id))

    async def delete_run(self, run_id: str) -> None:
        await self._do(calls.delete_run(run_id))

    async def renew_run(self, run_id: str, ttl: int) -> Run:
        return await self._do(calls.renew_run(run_id, ttl))

    async def update_egress(self, run_id: str, **kwargs: Any) -> Run:
        """Replaces a live run's egress: ``network`` (``none`` or
        ``allowlist``), ``egress_allow``, ``secrets``, ``socks5`` and ``upstream`` (as at
        create); a field left out keeps what the run has, ``[]`` clears it.
        New connections follow the new policy; open ones are not cut."""
        return await self._do(calls.update_egress(run_id, **kwargs))

    async def pause_run(self, run_id: str) -> Run:
        """Freezes the run's processes where they are, memory kept; the next
        call that reaches the run resumes it."""
        return await self._do(calls.pause_run(run_id))

    async def resume_run(self, run_id: str) -> Run:
        """Lets a paused run's processes go on (wakes a hibernated one)."""
        return await self._do(calls.resume_run(run_id))

    async def hibernate_run(self, run_id: str) -> Run:
        """Stops the run down to its disk: its processes and memory are
        lost, its files kept; the next call that reaches it boots it again."""
        return await self._do(calls.hibernate_run(run_id))

    async def archive_run(self, run_id: str) -> Run:
        """Sends the run's disk to the server's checkpoint store and drops it
        on the node; the next call that reaches it restores it."""
        return await self._do(calls.archive_run(run_id))

    async def move_run(self, run_id: str, node: Optional[str] = None) -> Run:
        """Moves the run to another node of the fleet (``node``, or the best
        one that can take it) under the same id, token, settings and lease;
        an awake run is hibernated first (its processes end) and booted
        there. Root only."""
        return await self._do(calls.move_run(run_id, node))

    async def wake_run(self, run_id: str) -> Run:
        """Boots a hibernated or failed run again on its disk."""
        return await self._do(calls.wake_run(run_id))

    async def info(self) -> Dict[str, Any]:
        return await self._do(calls.info())

    async def acquire_lease(self, run_id: str, owner: str, ttl: Optional[int] = None) -> Lease:
        return await self._do(calls.acquire_lease(run_id, owner, ttl))

    async def renew_lease(self, run_id: str, owner: str, generation: int, ttl: Optional[int] = None) -> Lease:
        return await self._do(calls.renew_lease(run_id, owner, generation, ttl))

    async def release_lease(self, run_id: str, owner: str, generation: int) -> None:
        await self._do(calls.release_lease(run_id, owner, generation))

    def exec(self, run_id: str, cmd: Union[str, List[str]], **kwargs: Any) -> AsyncIterator[Any]:
        return self._stream("POST", f"{run_path(run_id)}/exec", EventDecoder(), json=exec_body(cmd, **kwargs))

    async def run(self, run_id: str, cmd: Union[str, List[str]], **kwargs: Any) -> ExecResult:
        pid, out, err = None, bytearray(), bytearray()
        async for event in self.exec(run_id, cmd, **kwargs):
            if isinstance(event, Started):
                pid = event.pid
            elif isinstance(event, Stdout):
                out += event.data
            elif isinstance(event, Stderr):
                err += event.data
            elif isinstance(event, Exit):
                return ExecResult(pid, bytes(out), bytes(err), event)
        raise StreamEnded()

    async def session(self, run_id: str, cmd: Union[str, List[str]], **kwargs: Any) -> AsyncSession:
        return await _open_session(self.url, self._token, f"{run_path(run_id)}/exec/ws", exec_body(cmd, **kwargs))

    async def start_process(self, run_id: str, cmd: Union[str, List[str]], **kwargs: Any) -> Process:
        return await self._do(calls.start_process(run_id, cmd, **kwargs))

    async def processes(self, run_id: str) -> List[Process]:
        return await self._do(calls.processes(run_id))

    async def process(self, run_id: str, proc: Union[int, str]) -> Process:
        return await self._do(calls.process(run_id, proc))

    async def wait_process(self, run_id: str, proc: Union[int, str], timeout: int = 60) -> Process:
        return await self._do(calls.wait_process(run_id, proc, timeout))

    async def signal_process(self, run_id: str, proc: Union[int, str], signal: Union[int, str] = "TERM", lease: Lease_ = None) -> Process:
        return await self._do(calls.signal_process(run_id, proc, signal, lease))

    async def send_stdin(self, run_id: str, proc: Union[int, str], data: Union[bytes, str], close: bool = False, lease: Lease_ = None) -> Process:
        return await self._do(calls.send_stdin(run_id, proc, data, close, lease))

    def process_output(self, run_id: str, proc: Union[int, str], replay: bool = True) -> AsyncIterator[Any]:
        return self._stream(
            "GET",
            f"{process_path(run_id, proc)}/output",
            EventDecoder(),
            params={"replay": "true" if replay else "false"},
        )

    async def attach(self, run_id: str, proc: Union[int, str], replay: bool = True, lease: Lease_ = None) -> AsyncSession:
        query = f"replay={'true' if replay else 'false'}"
        if lease:
            query += f"&owner={lease[0]}&generation={lease[1]}"
        return await _open_session(self.url, self._token, f"{process_path(run_id, proc)}/ws?{query}", None)

    async def write_file(self, run_id: str, path: str, data: Union[bytes, str], lease: Lease_ = None) -> None:
        await self._do(calls.write_file(run_id, path, data, lease))

    async def read_file(self, run_id: str, path: str) -> bytes:
        return await self._get_bytes(f"{run_path(run_id)}/files/{file_path(path)}")

    async def _get_bytes(self, url_path: str) -> bytes:
        return (await self._send(Call("GET", url_path))).content

    async def stat(self, run_id: str, path: str = "") -> FileInfo:
        return await self._do(calls.stat(run_id, path))

    async def list_dir(self, run_id: str, path: str = "", depth: int = 1) -> List[FileInfo]:
        return await self._do(calls.list_dir(run_id, path, depth))

    async def make_dir(self, run_id: str, path: str, mode: Optional[int] = None, lease: Lease_ = None) -> FileInfo:
        return await self._do(calls.make_dir(run_id, path, mode, lease))

    async def move(self, run_id: str, src: str, dst: str, overwrite: bool = False, lease: Lease_ = None) -> FileInfo:
        return await self._do(calls.move(run_id, src, dst, overwrite, lease))

    async def remove(self, run_id: str, path: str, recursive: bool = False, lease: Lease_ = None) -> int:
        return await self._do(calls.remove(run_id, path, recursive, lease))

    def watch(self, run_id: str, path: str = "", recursive: bool = False) -> AsyncIterator[Dict[str, Any]]:
        return self._stream(
            "GET",
            f"{run_path(run_id)}/fs/watch",
            JsonEventDecoder(),
            params={"path": path, "recursive": "true" if recursive else "false"},
        )

    async def list_images(self) -> List[Image]:
        return await self._do(calls.list_images())

    async def get_image(self, name: str) -> Image:
        return await self._do(calls.get_image(name))

    async def import_image(self, name: str, tar: bytes) -> Image:
        return await self._do(calls.import_image(name, tar))

    async def delete_image(self, name: str) -> None:
        await self._do(calls.delete_image(name))

    async def build_image(
        self,
        name: str,
        dockerfile: Optional[str] = None,
        *,
        context: Any = None,
        on_log: Optional[Callable[[Dict[str, Any]], None]] = None,
        **kwargs: Any,
    ) -> Dict[str, Any]:
        """:meth:`runbox.Runbox.build_image`, awaited."""
        digest = None
        if context is not None:
            tar = await asyncio.to_thread(calls.context_tar, context)
            digest = calls.context_digest(tar)
            await self._do(calls.put_build_context(digest, tar))
        build = await self._do(calls.start_build(calls.build_body(name, dockerfile, context=digest, **kwargs)))
        async for event in self.build_events(build["id"]):
            done = calls.build_event(event, on_log)
            if done is not None:
                return done
        raise StreamEnded("the build's event stream ended before the build did")

    def build_events(self, build_id: str, offset: int = 0) -> AsyncIterator[Dict[str, Any]]:
        """A build's events as dicts (``event``: ``step``, ``log`` or the
        last, ``done``), from log line ``offset``."""
        return self._stream(
            "GET", calls.build_events_path(build_id), JsonEventDecoder(), params={"offset": offset}
        )

    async def get_build(self, build_id: str) -> Dict[str, Any]:
        return await self._do(calls.get_build(build_id))

    async def list_builds(self) -> List[Dict[str, Any]]:
        return await self._do(calls.list_builds())

    async def cancel_build(self, build_id: str) -> Dict[str, Any]:
        """Cancel a build; answers once it has ended."""
        return await self._do(calls.cancel_build(build_id))

    async def snapshot(self, run_id: str, name: Optional[str] = None, point: Optional[str] = None) -> Dict[str, Any]:
        """Record the run's files as an image named ``name`` (default:
        generated); with ``point``, its files as they were at that history
        point."""
        return await self._do(calls.snapshot(run_id, name, point))

    async def checkpoint(self, run_id: str, labels: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
        """Send the run's disk and settings to the server's checkpoint store;
        the run keeps running. ``create_run(checkpoint=id)`` starts runs
        from it."""
        return await self._do(calls.checkpoint(run_id, labels))

    # -- tenants and usage (tenants: root token only) ----------------------

    async def create_tenant(self, name: str, **policy: Any) -> Dict[str, Any]:
        """Adds a tenant; the answer's ``token`` is shown this once.
        ``policy``: ``max_runs``, ``images``, ``networks``, ``sizes``,
        ``egress_class`` (one the server defines)."""
        return await self._do(calls.create_tenant(name, **policy))

    async def list_tenants(self) -> List[Dict[str, Any]]:
        return await self._do(calls.list_tenants())

    async def get_tenant(self, name: str) -> Dict[str, Any]:
        return await self._do(calls.get_tenant(name))

    async def update_tenant(self, name: str, **policy: Any) -> Dict[str, Any]:
        return await self._do(calls.update_tenant(name, **policy))

    async def rotate_tenant(self, name: str) -> Dict[str, Any]:
        """A new token for the tenant; the old one stops working at once."""
        return await self._do(calls.rotate_tenant(name))

    async def delete_tenant(self, name: str) -> None:
        await self._do(calls.delete_tenant(name))

    # -- volumes -------------------------------------------------------------

    async def create_volume(
        self, name: str, size_mb: Optional[int] = None, labels: Optional[Dict[str, str]] = None
    ) -> Dict[str, Any]:
        """Makes a named volume (mount it with ``create_run(volumes=[{"name": ...}])``)."""
        return await self._do(calls.create_volume(name, size_mb, labels))

    async def list_volumes(
        self, labels: Optional[Union[Dict[str, Optional[str]], List[str]]] = None
    ) -> List[Dict[str, Any]]:
        """The volumes this token may see, filtered by ``labels`` as
        :meth:`list_runs` is."""
        return await self._do(calls.list_volumes(labels))

    async def get_volume(self, name: str) -> Dict[str, Any]:
        return await self._do(calls.get_volume(name))

    async def clone_volume(self, name: str, new_name: str, size_mb: Optional[int] = None) -> Dict[str, Any]:
        """A new volume holding what ``name`` holds now (constant time)."""
        return await self._do(calls.clone_volume(name, new_name, size_mb))

    async def move_volume(self, name: str, node: Optional[str] = None) -> Dict[str, Any]:
        """Moves the volume (no run may mount it) to another node of the
        fleet (``node``, or the best one): the volume on its new node."""
        return await self._do(calls.move_volume(name, node))

    async def delete_volume(self, name: str) -> None:
        """Deletes the volume and all it holds; refused while a run mounts it."""
        await self._do(calls.delete_volume(name))

    async def write_volume_file(
        self,
        name: str,
        path: str,
        data: Union[bytes, str],
        mode: Optional[int] = None,
        owner: Optional[Tuple[int, int]] = None,
        overwrite: bool = True,
    ) -> FileInfo:
        return await self._do(calls.write_volume_file(name, path, data, mode, owner, overwrite))

    async def read_volume_file(self, name: str, path: str) -> bytes:
        return await self._get_bytes(f"{calls.volume_path(name)}/files/{file_path(path.lstrip('/'))}")

    async def volume_stat(self, name: str, path: str = "") -> FileInfo:
        return await self._do(calls.volume_stat(name, path))

    async def volume_list(self, name: str, path: str = "", depth: int = 1) -> List[FileInfo]:
        return await self._do(calls.volume_list(name, path, depth))

    async def volume_make_dir(
        self, name: str, path: str, mode: Optional[int] = None, owner: Optional[Tuple[int, int]] = None
    ) -> FileInfo:
        return await self._do(calls.volume_make_dir(name, path, mode, owner))

    async def volume_move(self, name: str, src: str, dst: str, overwrite: bool = False) -> FileInfo:
        return await self._do(calls.volume_move(name, src, dst, overwrite))

    async def volume_remove(self, name: str, path: str, recursive: bool = False) -> int:
        return await self._do(calls.volume_remove(name, path, recursive))

    async def usage(self, since: Optional[str] = None, tenant: Optional[str] = None) -> Dict[str, Any]:
        """What each tenant used since ``since`` (RFC 3339, or ``24h``, ``7d``)."""
        return await self._do(calls.usage(since, tenant))

    async def list_checkpoints(
        self, labels: Optional[Union[Dict[str, Optional[str]], List[str]]] = None
    ) -> List[Dict[str, Any]]:
        """The checkpoints this token may see, filtered by ``labels`` as
        :meth:`list_runs` is."""
        return await self._do(calls.list_checkpoints(labels))

    async def get_checkpoint(self, checkpoint_id: str) -> Dict[str, Any]:
        return await self._do(calls.get_checkpoint(checkpoint_id))

    async def delete_checkpoint(self, checkpoint_id: str) -> None:
        await self._do(calls.delete_checkpoint(checkpoint_id))

    async def fork(
        self, run_id: str, count: int = 1, ttl: Optional[int] = None, point: Optional[str] = None
    ) -> List[Run]:
        """Start ``count`` runs from the run's files as they are (with
        ``point``: as they were at that history point)."""
        return await self._do(calls.fork(run_id, count, ttl, point))

    # -- history (runs created with ``history=N``) --------------------------

    async def history(self, run_id: str) -> History:
        """The run's history points, newest first: one after every command
        and file call that changed a file, and a ``create`` point (the files
        before the first change). ``point_not_found`` for a run without a
        history."""
        return await self._do(calls.history(run_id))

    async def diff(
        self,
        run_id: str,
        point: Optional[str] = None,
        against: Optional[str] = None,
        patch: bool = False,
        limit: Optional[int] = None,
    ) -> HistoryDiff:
        """The paths a history point (default: the newest) changed against
        its parent, or against the point ``against``; ``patch`` adds unified
        diffs of changed text files; ``limit``: the most paths (1-10000,
        default 1000)."""
        if point is None:
            point = calls.newest_point(run_id, await self._do(calls.history(run_id)))
        return await self._do(calls.diff(run_id, point, against, patch, limit))

    async def rollback(self, run_id: str, point: str, lease: Lease_ = None) -> Run:
        """Return the run's files to a history point; a running run's
        processes end (it boots again on those files). Later points stay, so
        a rollback can be undone by rolling forward, until the next change."""
        return await self._do(calls.rollback(run_id, point, lease))

    async def mint_preview(self, run_id: str, port: int, ttl: Optional[int] = None) -> Preview:
        return await self._do(calls.mint_preview(run_id, port, ttl))
