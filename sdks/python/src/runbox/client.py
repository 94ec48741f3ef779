"""The synchronous client."""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

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
from ._session import Session, open_session

Lease_ = Optional[Tuple[str, int]]


class Runbox:
    """A connection to one runbox daemon.

    ``url`` and ``token`` default to ``RUNBOX_URL`` and ``RUNBOX_TOKEN``, then
    to ``http://127.0.0.1:7439`` and the daemon's token file. Use it as a
    context manager, or call :meth:`close`.

    Calls that are safe to repeat are sent again, up to ``max_retries``
    more times (0 turns this off): any call whose connection could not be
    made (after 0.2, 0.4, 0.8 s); a GET or a create whose answer was lost
    on the way; a GET, DELETE or create answered ``429`` or ``503`` with
    ``Retry-After`` (the node at capacity, a tenant at its quota, a
    draining node), after that many seconds but at most
    ``max_retry_wait``. Creates carry a fresh ``Idempotency-Key``, reused
    on their retries, so a repeat never makes a second run. When the
    retries run out, the last error is raised.
    """

    def __init__(
        self,
        url: Optional[str] = None,
        token: Optional[str] = None,
        *,
        timeout: float = 60.0,
        http: Optional[httpx.Client] = None,
        max_retries: int = DEFAULT_MAX_RETRIES,
        max_retry_wait: float = DEFAULT_MAX_RETRY_WAIT,
    ) -> None:
        self.url, self._token = resolve(url, token)
        self._retry = RetryPolicy(max_retries, max_retry_wait)
        headers = {"User-Agent": "runbox-python/0.1"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        # Streams last as long as their command: only connecting and each
        # read of a plain answer are bounded.
        self._http = http or httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=10.0),
            follow_redirects=False,
        )

    def __enter__(self) -> "Runbox":
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # -- plumbing ---------------------------------------------------------

    def _open(self, call: Call[Any], stream: bool = False) -> httpx.Response:
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
                response = self._http.send(request, stream=stream)
            except httpx.HTTPError as e:
                wait = self._retry.after_error(call, e, retries)
                if wait is None:
                    raise
            else:
                if response.status_code < 300:
                    return response
                if stream:
                    try:
                        response.read()
                    finally:
                        response.close()
                error = error_from(response.status_code, response.content, response.reason_phrase)
                wait = self._retry.after_answer(
                    call, response.status_code, response.headers.get("Retry-After"), retries, error.code
                )
                if wait is None:
                    raise error
            retries += 1
            time.sleep(wait)

    def _send(self, call: Call[Any]) -> httpx.Response:
        try:
            return self._open(call)
        except httpx.HTTPError as e:
            raise RunboxError(0, "unreachable", f"cannot reach runbox at {self.url}: {e}") from e

    def _do(self, call: Call[Any]) -> Any:
        response = self._send(call)
        if call.empty or not response.content:
            return None
        return call.parse(response.json())

    def _stream(self, method: str, path: str, decoder: EventDecoder, **kwargs: Any) -> Iterator[Any]:
        try:
            # Sent again only until it is answered: once events flow, a
            # broken stream is the caller's to judge.
            response = self._open(Call(method, path, **kwargs), stream=True)
            try:
                for chunk in response.iter_raw():
                    for event in decoder.feed(chunk):
                        yield event
                    if decoder.done:
                        return
            finally:
                response.close()
        except httpx.HTTPError as e:
            raise StreamEnded(f"the stream broke: {e}") from e
        if isinstance(decoder, JsonEventDecoder):
            return
        raise StreamEnded()

    # -- runs -------------------------------------------------------------

    def health(self) -> Dict[str, Any]:
        return self._do(calls.health())

    def create_run(self, image: Optional[str] = None, **kwargs: Any) -> Run:
        """Create a run and wait until it is usable. Keyword arguments:
        ``env``, ``ttl``, ``network``, ``size``, ``cpus``, ``memory_mb``,
        ``pids``, ``disk_mb``, ``labels``, ``egress_allow``, ``secrets``
        (declared names, and secrets you bring as ``{"name", "value",
        "hosts", "header", "scheme"?, "methods", "path_prefixes"}``: the
        run sees a placeholder, the proxy sends the value), ``socks5``
        (a SOCKS5 door at ``127.0.0.1:1080`` named by ``ALL_PROXY``),
        ``upstream`` (an upstream proxy URL the server admits),
        ``auto_resume``, ``on_expire`` (``delete``, ``pause``, ``hibernate``, ``archive``),
        ``on_node_loss`` (``restore`` or ``lost``: what becomes of the run when
        its node of a fleet is declared gone),
        ``idle_pause_after`` and ``idle_hibernate_after`` (seconds; 0 is off),
        ``allow_privilege_escalation`` (setuid programs such as sudo work;
        only where runs have a user namespace), ``volumes`` (a list of
        ``{"name", "path"?, "mode"?}``, mode ``rw`` or ``ro``),
        ``history`` (keep a history point, this many at most, after every
        command and file call that changed a file: see :meth:`history`),
        ``idempotency_key`` (default: a fresh one, which this call's retries
        reuse); ``checkpoint`` (an id) instead of ``image``
        starts the run from a checkpoint. Without either, the image is
        ``base``."""
        return self._do(calls.create_run(image, **kwargs))

    def list_runs(self, labels: Optional[Union[Dict[str, Optional[str]], List[str]]] = None) -> List[Run]:
        """The runs this token may see; with ``labels`` (``{"team": "a",
        "job": None}`` or ``["team=a", "job"]``) only those whose labels
        match every term (None, or a bare key: the label is set)."""
        return self._do(calls.list_runs(labels))

    def get_run(self, run_id: str) -> Run:
        return self._do(calls.get_run(run_id))

    def delete_run(self, run_id: str) -> None:
        self._do(calls.delete_run(run_id))

    def renew_run(self, run_id: str, ttl: int) -> Run:
        return self._do(calls.renew_run(run_id, ttl))

    def update_egress(self, run_id: str, **kwargs: Any) -> Run:
        """Replaces a live run's egress: ``network`` (``none`` or
        ``allowlist``), ``egress_allow``, ``secrets``, ``socks5`` and ``upstream`` (as at
        create); a field left out keeps what the run has, ``[]`` clears it.
        New connections follow the new policy; open ones are not cut."""
        return self._do(calls.update_egress(run_id, **kwargs))

    def pause_run(self, run_id: str) -> Run:
        """Freezes the run's processes where they are, memory kept; the next
        call that reaches the run resumes it."""
        return self._do(calls.pause_run(run_id))

    def resume_run(self, run_id: str) -> Run:
        """Lets a paused run's processes go on (wakes a hibernated one)."""
        return self._do(calls.resume_run(run_id))

    def hibernate_run(self, run_id: str) -> Run:
        """Stops the run down to its disk: its processes and memory are
        lost, its files kept; the next call that reaches it boots it again."""
        return self._do(calls.hibernate_run(run_id))

    def archive_run(self, run_id: str) -> Run:
        """Sends the run's disk to the server's checkpoint store and drops it
        on the node; the next call that reaches it restores it."""
        return self._do(calls.archive_run(run_id))

    def move_run(self, run_id: str, node: Optional[str] = None) -> Run:
        """Moves the run to another node of the fleet (``node``, or the best
        one that can take it) under the same id, token, settings and lease;
        an awake run is hibernated first (its processes end) and booted
        there. Root only."""
        return self._do(calls.move_run(run_id, node))

    def wake_run(self, run_id: str) -> Run:
        """Boots a hibernated or failed run again on its disk."""
        return self._do(calls.wake_run(run_id))

    def info(self) -> Dict[str, Any]:
        return self._do(calls.info())

    # -- leases -----------------------------------------------------------

    def acquire_lease(self, run_id: str, owner: str, ttl: Optional[int] = None) -> Lease:
        return self._do(calls.acquire_lease(run_id, owner, ttl))

    def renew_lease(self, run_id: str, owner: str, generation: int, ttl: Optional[int] = None) -> Lease:
        return self._do(calls.renew_lease(run_id, owner, generation, ttl))

    def release_lease(self, run_id: str, owner: str, generation: int) -> None:
        self._do(calls.release_lease(run_id, owner, generation))

    # -- exec -------------------------------------------------------------

    def exec(self, run_id: str, cmd: Union[str, List[str]], **kwargs: Any) -> Iterator[Any]:
        """Run a command and yield its events as they come: :class:`Started`,
        :class:`Stdout`, :class:`Stderr`, then one :class:`Exit`. A string
        runs through ``sh -c``. Keyword arguments: ``cwd``, ``env``,
        ``timeout`` (seconds), ``user``, ``stdin`` (text), ``pty`` ((rows,
        cols)), ``term``, ``lease`` ((owner, generation)). Closing the
        iterator early kills the command."""
        body = exec_body(cmd, **kwargs)
        return self._stream("POST", f"{run_path(run_id)}/exec", EventDecoder(), json=body)

    def run(self, run_id: str, cmd: Union[str, List[str]], **kwargs: Any) -> ExecResult:
        """Run a command to its end and return its output and exit."""
        pid, out, err = None, bytearray(), bytearray()
        for event in self.exec(run_id, cmd, **kwargs):
            if isinstance(event, Started):
                pid = event.pid
            elif isinstance(event, Stdout):
                out += event.data
            elif isinstance(event, Stderr):
                err += event.data
            elif isinstance(event, Exit):
                return ExecResult(pid, bytes(out), bytes(err), event)
        raise StreamEnded()

    def session(self, run_id: str, cmd: Union[str, List[str]], **kwargs: Any) -> Session:
        """An interactive command over a WebSocket: its stdin open, on a
        terminal when ``pty=(rows, cols)`` is given. See :class:`Session`."""
        body = exec_body(cmd, **kwargs)
        return open_session(self.url, self._token, f"{run_path(run_id)}/exec/ws", start=body)

    # -- processes --------------------------------------------------------

    def start_process(self, run_id: str, cmd: Union[str, List[str]], **kwargs: Any) -> Process:
        """Start a background process; it outlives this client. Takes
        ``tag`` and ``open_stdin`` besides the arguments of :meth:`exec`."""
        return self._do(calls.start_process(run_id, cmd, **kwargs))

    def processes(self, run_id: str) -> List[Process]:
        return self._do(calls.processes(run_id))

    def process(self, run_id: str, proc: Union[int, str]) -> Process:
        return self._do(calls.process(run_id, proc))

    def wait_process(self, run_id: str, proc: Union[int, str], timeout: int = 60) -> Process:
        """Wait up to ``timeout`` seconds for a process to end; ``running``
        on the answer says whether it did."""
        return self._do(calls.wait_process(run_id, proc, timeout))

    def signal_process(self, run_id: str, proc: Union[int, str], signal: Union[int, str] = "TERM", lease: Lease_ = None) -> Process:
        return self._do(calls.signal_process(run_id, proc, signal, lease))

    def send_stdin(self, run_id: str, proc: Union[int, str], data: Union[bytes, str], close: bool = False, lease: Lease_ = None) -> Process:
        return self._do(calls.send_stdin(run_id, proc, data, close, lease))

    def process_output(self, run_id: str, proc: Union[int, str], replay: bool = True) -> Iterator[Any]:
        """A process's output as exec events (what it kept first when
        ``replay``), ending with its exit. Closing it leaves the process
        running."""
        return self._stream(
            "GET",
            f"{process_path(run_id, proc)}/output",
            EventDecoder(),
            params={"replay": "true" if replay else "false"},
        )

    def attach(self, run_id: str, proc: Union[int, str], replay: bool = True, lease: Lease_ = None) -> Session:
        """An interactive attach to a process over a WebSocket."""
        query = f"replay={'true' if replay else 'false'}"
        if lease:
            query += f"&owner={lease[0]}&generation={lease[1]}"
        return open_session(self.url, self._token, f"{process_path(run_id, proc)}/ws?{query}", start=None)

    # -- files ------------------------------------------------------------

    def write_file(self, run_id: str, path: str, data: Union[bytes, str], lease: Lease_ = None) -> None:
        """Write ``data`` to ``path`` below /work, replacing it whole."""
        self._do(calls.write_file(run_id, path, data, lease))

    def read_file(self, run_id: str, path: str) -> bytes:
        """Read a file below /work."""
        from ._core import file_path

        return self._get_bytes(f"{run_path(run_id)}/files/{file_path(path)}")

    def _get_bytes(self, url_path: str) -> bytes:
        return self._send(Call("GET", url_path)).content

    def stat(self, run_id: str, path: str = "") -> FileInfo:
        return self._do(calls.stat(run_id, path))

    def list_dir(self, run_id: str, path: str = "", depth: int = 1) -> List[FileInfo]:
        return self._do(calls.list_dir(run_id, path, depth))

    def make_dir(self, run_id: str, path: str, mode: Optional[int] = None, lease: Lease_ = None) -> FileInfo:
        return self._do(calls.make_dir(run_id, path, mode, lease))

    def move(self, run_id: str, src: str, dst: str, overwrite: bool = False, lease: Lease_ = None) -> FileInfo:
        return self._do(calls.move(run_id, src, dst, overwrite, lease))

    def remove(self, run_id: str, path: str, recursive: bool = False, lease: Lease_ = None) -> int:
        return self._do(calls.remove(run_id, path, recursive, lease))

    def watch(self, run_id: str, path: str = "", recursive: bool = False) -> Iterator[Dict[str, Any]]:
        """Changes below a directory of /work, as dicts (``kind``, ``path``,
        ``from``, ``isDir``); the first is ``ready``. Runs until closed."""
        return self._stream(
            "GET",
            f"{run_path(run_id)}/fs/watch",
            JsonEventDecoder(),
            params={"path": path, "recursive": "true" if recursive else "false"},
        )

    # -- images, snapshots, forks, previews -------------------------------

    def list_images(self) -> List[Image]:
        return self._do(calls.list_images())

    def get_image(self, name: str) -> Image:
        return self._do(calls.get_image(name))

    def import_image(self, name: str, tar: bytes) -> Image:
        return self._do(calls.import_image(name, tar))

    def delete_image(self, name: str) -> None:
        self._do(calls.delete_image(name))

    def build_image(
        self,
        name: str,
        dockerfile: Optional[str] = None,
        *,
        context: Any = None,
        on_log: Optional[Callable[[Dict[str, Any]], None]] = None,
        **kwargs: Any,
    ) -> Dict[str, Any]:
        """Build image ``name`` from a Dockerfile's text (or ``steps`` with
        ``from_image``) and wait for it; returns the ended build. ``context``:
        a directory or a tar's bytes, uploaded first (what COPY reads).
        ``on_log`` gets each log line (``step``, ``stream``, ``text``).
        Other keyword arguments: ``steps``, ``from_image``, ``build_args``,
        ``target``, ``no_cache``, ``timeout``, ``labels``. Raises
        :class:`BuildFailed` when the build ends without its image."""
        digest = None
        if context is not None:
            tar = calls.context_tar(context)
            digest = calls.context_digest(tar)
            self._do(calls.put_build_context(digest, tar))
        build = self._do(calls.start_build(calls.build_body(name, dockerfile, context=digest, **kwargs)))
        for event in self.build_events(build["id"]):
            done = calls.build_event(event, on_log)
            if done is not None:
                return done
        raise StreamEnded("the build's event stream ended before the build did")

    def build_events(self, build_id: str, offset: int = 0) -> Iterator[Dict[str, Any]]:
        """A build's events as dicts (``event``: ``step``, ``log`` or the
        last, ``done``), from log line ``offset``."""
        return self._stream(
            "GET", calls.build_events_path(build_id), JsonEventDecoder(), params={"offset": offset}
        )

    def get_build(self, build_id: str) -> Dict[str, Any]:
        return self._do(calls.get_build(build_id))

    def list_builds(self) -> List[Dict[str, Any]]:
        return self._do(calls.list_builds())

    def cancel_build(self, build_id: str) -> Dict[str, Any]:
        """Cancel a build; answers once it has ended."""
        return self._do(calls.cancel_build(build_id))

    def snapshot(self, run_id: str, name: Optional[str] = None, point: Optional[str] = None) -> Dict[str, Any]:
        """Record the run's files as an image named ``name`` (default:
        generated); with ``point``, its files as they were at that history
        point."""
        return self._do(calls.snapshot(run_id, name, point))

    def checkpoint(self, run_id: str, labels: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
        """Send the run's disk and settings to the server's checkpoint store;
        the run keeps running. ``create_run(checkpoint=id)`` starts runs
        from it."""
        return self._do(calls.checkpoint(run_id, labels))

    # -- tenants and usage (tenants: root token only) ----------------------

    def create_tenant(self, name: str, **policy: Any) -> Dict[str, Any]:
        """Adds a tenant; the answer's ``token`` is shown this once.
        ``policy``: ``max_runs``, ``images``, ``networks``, ``sizes``,
        ``egress_class`` (one the server defines)."""
        return self._do(calls.create_tenant(name, **policy))

    def list_tenants(self) -> List[Dict[str, Any]]:
        return self._do(calls.list_tenants())

    def get_tenant(self, name: str) -> Dict[str, Any]:
        return self._do(calls.get_tenant(name))

    def update_tenant(self, name: str, **policy: Any) -> Dict[str, Any]:
        return self._do(calls.update_tenant(name, **policy))

    def rotate_tenant(self, name: str) -> Dict[str, Any]:
        """A new token for the tenant; the old one stops working at once."""
        return self._do(calls.rotate_tenant(name))

    def delete_tenant(self, name: str) -> None:
        self._do(calls.delete_tenant(name))

    # -- volumes -------------------------------------------------------------

    def create_volume(
        self, name: str, size_mb: Optional[int] = None, labels: Optional[Dict[str, str]] = None
    ) -> Dict[str, Any]:
        """Makes a named volume (mount it with ``create_run(volumes=[{"name": ...}])``)."""
        return self._do(calls.create_volume(name, size_mb, labels))

    def list_volumes(
        self, labels: Optional[Union[Dict[str, Optional[str]], List[str]]] = None
    ) -> List[Dict[str, Any]]:
        """The volumes this token may see, filtered by ``labels`` as
        :meth:`list_runs` is."""
        return self._do(calls.list_volumes(labels))

    def get_volume(self, name: str) -> Dict[str, Any]:
        return self._do(calls.get_volume(name))

    def clone_volume(self, name: str, new_name: str, size_mb: Optional[int] = None) -> Dict[str, Any]:
        """A new volume holding what ``name`` holds now (constant time)."""
        return self._do(calls.clone_volume(name, new_name, size_mb))

    def move_volume(self, name: str, node: Optional[str] = None) -> Dict[str, Any]:
        """Moves the volume (no run may mount it) to another node of the
        fleet (``node``, or the best one): the volume on its new node."""
        return self._do(calls.move_volume(name, node))

    def delete_volume(self, name: str) -> None:
        """Deletes the volume and all it holds; refused while a run mounts it."""
        self._do(calls.delete_volume(name))

    def write_volume_file(
        self,
        name: str,
        path: str,
        data: Union[bytes, str],
        mode: Optional[int] = None,
        owner: Optional[Tuple[int, int]] = None,
        overwrite: bool = True,
    ) -> FileInfo:
        """Write ``data`` to ``path`` (from the volume's top) of a volume no
        run mounts; ``owner`` is (uid, gid) as runs see them."""
        return self._do(calls.write_volume_file(name, path, data, mode, owner, overwrite))

    def read_volume_file(self, name: str, path: str) -> bytes:
        """Read a file of a volume (runs may hold it meanwhile)."""
        from ._core import file_path

        return self._get_bytes(f"{calls.volume_path(name)}/files/{file_path(path.lstrip('/'))}")

    def volume_stat(self, name: str, path: str = "") -> FileInfo:
        return self._do(calls.volume_stat(name, path))

    def volume_list(self, name: str, path: str = "", depth: int = 1) -> List[FileInfo]:
        return self._do(calls.volume_list(name, path, depth))

    def volume_make_dir(
        self, name: str, path: str, mode: Optional[int] = None, owner: Optional[Tuple[int, int]] = None
    ) -> FileInfo:
        return self._do(calls.volume_make_dir(name, path, mode, owner))

    def volume_move(self, name: str, src: str, dst: str, overwrite: bool = False) -> FileInfo:
        return self._do(calls.volume_move(name, src, dst, overwrite))

    def volume_remove(self, name: str, path: str, recursive: bool = False) -> int:
        return self._do(calls.volume_remove(name, path, recursive))

    def usage(self, since: Optional[str] = None, tenant: Optional[str] = None) -> Dict[str, Any]:
        """What each tenant used since ``since`` (RFC 3339, or ``24h``, ``7d``)."""
        return self._do(calls.usage(since, tenant))

    def list_checkpoints(
        self, labels: Optional[Union[Dict[str, Optional[str]], List[str]]] = None
    ) -> List[Dict[str, Any]]:
        """The checkpoints this token may see, filtered by ``labels`` as
        :meth:`list_runs` is."""
        return self._do(calls.list_checkpoints(labels))

    def get_checkpoint(self, checkpoint_id: str) -> Dict[str, Any]:
        return self._do(calls.get_checkpoint(checkpoint_id))

    def delete_checkpoint(self, checkpoint_id: str) -> None:
        self._do(calls.delete_checkpoint(checkpoint_id))

    def fork(
        self, run_id: str, count: int = 1, ttl: Optional[int] = None, point: Optional[str] = None
    ) -> List[Run]:
        """Start ``count`` runs from the run's files as they are (with
        ``point``: as they were at that history point)."""
        return self._do(calls.fork(run_id, count, ttl, point))

    # -- history (runs created with ``history=N``) --------------------------

    def history(self, run_id: str) -> History:
        """The run's history points, newest first: one after every command
        and file call that changed a file, and a ``create`` point (the files
        before the first change). ``point_not_found`` for a run without a
        history."""
        return self._do(calls.history(run_id))

    def diff(
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
            point = calls.newest_point(run_id, self._do(calls.history(run_id)))
        return self._do(calls.diff(run_id, point, against, patch, limit))

    def rollback(self, run_id: str, point: str, lease: Lease_ = None) -> Run:
        """Return the run's files to a history point; a running run's
        processes end (it boots again on those files). Later points stay, so
        a rollback can be undone by rolling forward, until the next change."""
        return self._do(calls.rollback(run_id, point, lease))

    def mint_preview(self, run_id: str, port: int, ttl: Optional[int] = None) -> Preview:
        return self._do(calls.mint_preview(run_id, port, ttl))

