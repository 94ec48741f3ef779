"""Every non-streaming call, built once for both clients."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from ._core import (
    Call,
    compact,
    exec_body,
    file_path,
    lease_params,
    new_idempotency_key,
    parse_entries,
    parse_images,
    parse_processes,
    parse_runs,
    process_path,
    run_path,
    segment,
)
from ._errors import BuildFailed, NotFound
from ._models import FileInfo, History, HistoryDiff, Image, Lease, Preview, Process, Run

Lease_ = Optional[Tuple[str, int]]


def health() -> Call[Dict[str, Any]]:
    return Call("GET", "/health")


def secret_body(secret: Union[str, Dict[str, Any]]) -> Union[str, Dict[str, Any]]:
    """A declared secret's name as it is; a brought one (a dict) with
    ``path_prefixes`` spelt as the API spells it."""
    if isinstance(secret, str):
        return secret
    body = dict(secret)
    if "path_prefixes" in body:
        body["pathPrefixes"] = body.pop("path_prefixes")
    return body


def create_run(
    image: Optional[str],
    *,
    checkpoint: Optional[str] = None,
    env: Optional[Dict[str, str]] = None,
    ttl: Optional[int] = None,
    network: Optional[str] = None,
    size: Optional[str] = None,
    cpus: Optional[float] = None,
    memory_mb: Optional[int] = None,
    pids: Optional[int] = None,
    disk_mb: Optional[int] = None,
    labels: Optional[Dict[str, str]] = None,
    egress_allow: Optional[List[Union[str, Dict[str, Any]]]] = None,
    secrets: Optional[List[Union[str, Dict[str, Any]]]] = None,
    socks5: Optional[bool] = None,
    upstream: Optional[str] = None,
    auto_resume: Optional[bool] = None,
    on_expire: Optional[str] = None,
    on_node_loss: Optional[str] = None,
    idle_pause_after: Optional[int] = None,
    idle_hibernate_after: Optional[int] = None,
    allow_privilege_escalation: Optional[bool] = None,
    volumes: Optional[List[Dict[str, str]]] = None,
    history: Optional[int] = None,
    idempotency_key: Optional[str] = None,
) -> Call[Run]:
    limits = compact(cpus=cpus, memoryMb=memory_mb, pids=pids, diskMb=disk_mb) or None
    if image is None and checkpoint is None:
        image = "base"
    body = compact(
        image=image,
        checkpoint=checkpoint,
        env=env,
        ttlSec=ttl,
        network=network,
        size=size,
        limits=limits,
        labels=labels,
        egressAllow=egress_allow,
        secrets=None if secrets is None else [secret_body(s) for s in secrets],
        egressSocks5=socks5,
        egressUpstream=upstream,
        autoResume=auto_resume,
        onExpire=on_expire,
        onNodeLoss=on_node_loss,
        idle=compact(pauseAfterSec=idle_pause_after, hibernateAfterSec=idle_hibernate_after) or None,
        allowPrivilegeEscalation=allow_privilege_escalation,
        volumes=volumes,
        history=None if history is None else {"keep": history},
    )
    # Always keyed, so that the clients may send it again (with this key)
    # when its answer was lost or the node was at capacity: the server
    # answers a repeat with the run the first attempt made.
    headers = {"Idempotency-Key": idempotency_key or new_idempotency_key()}
    return Call("POST", "/v1/runs", json=body, headers=headers, parse=Run.from_json)


def update_egress(
    run_id: str,
    *,
    network: Optional[str] = None,
    egress_allow: Optional[List[Union[str, Dict[str, Any]]]] = None,
    secrets: Optional[List[Union[str, Dict[str, Any]]]] = None,
    socks5: Optional[bool] = None,
    upstream: Optional[str] = None,
) -> Call[Run]:
    body = compact(
        network=network,
        egressAllow=egress_allow,
        secrets=None if secrets is None else [secret_body(s) for s in secrets],
        egressSocks5=socks5,
        egressUpstream=upstream,
    )
    return Call("PATCH", f"{run_path(run_id)}/egress", json=body, parse=Run.from_json)


def label_selector(labels: Any) -> Optional[Dict[str, List[str]]]:
    """The query of a list's label selector: ``{"team": "a", "job": None}``
    (None: the label is set, to anything) or ``["team=a", "job"]``; every
    term must hold."""
    if not labels:
        return None
    if isinstance(labels, dict):
        terms = [k if v is None else f"{k}={v}" for k, v in labels.items()]
    else:
        terms = [str(t) for t in labels]
    return {"label": terms}


def list_runs(labels: Any = None) -> Call[List[Run]]:
    return Call("GET", "/v1/runs", params=label_selector(labels), parse=parse_runs)


def get_run(run_id: str) -> Call[Run]:
    return Call("GET", run_path(run_id), parse=Run.from_json)


def delete_run(run_id: str) -> Call[None]:
    return Call("DELETE", run_path(run_id), empty=True)


def renew_run(run_id: str, ttl: int) -> Call[Run]:
    return Call("POST", f"{run_path(run_id)}/renew", json={"ttlSec": ttl}, parse=Run.from_json)


def pause_run(run_id: str) -> Call[Run]:
    return Call("POST", f"{run_path(run_id)}/pause", parse=Run.from_json)


def resume_run(run_id: str) -> Call[Run]:
    return Call("POST", f"{run_path(run_id)}/resume", parse=Run.from_json)


def hibernate_run(run_id: str) -> Call[Run]:
    return Call("POST", f"{run_path(run_id)}/hibernate", parse=Run.from_json)


def archive_run(run_id: str) -> Call[Run]:
    return Call("POST", f"{run_path(run_id)}/archive", parse=Run.from_json)


def move_run(run_id: str, node: Optional[str] = None) -> Call[Run]:
    return Call(
        "POST", f"{run_path(run_id)}/move", json=compact(node=node), parse=Run.from_json
    )


def wake_run(run_id: str) -> Call[Run]:
    return Call("POST", f"{run_path(run_id)}/wake", parse=Run.from_json)


def acquire_lease(run_id: str, owner: str, ttl: Optional[int] = None) -> Call[Lease]:
    return Call(
        "POST",
        f"{run_path(run_id)}/lease",
        json=compact(owner=owner, ttlSec=ttl),
        parse=lambda b: Lease.from_json(b["lease"]),
    )


def renew_lease(run_id: str, owner: str, generation: int, ttl: Optional[int] = None) -> Call[Lease]:
    return Call(
        "POST",
        f"{run_path(run_id)}/lease/renew",
        json=compact(owner=owner, generation=generation, ttlSec=ttl),
        parse=lambda b: Lease.from_json(b["lease"]),
    )


def release_lease(run_id: str, owner: str, generation: int) -> Call[None]:
    return Call(
        "POST",
        f"{run_path(run_id)}/lease/release",
        json={"owner": owner, "generation": generation},
        empty=True,
    )


def write_file(run_id: str, path: str, data: Union[bytes, str], lease: Lease_ = None) -> Call[None]:
    content = data.encode() if isinstance(data, str) else bytes(data)
    return Call(
        "PUT",
        f"{run_path(run_id)}/files/{file_path(path)}",
        content=content,
        params=lease_params(lease) or None,
        headers={"Content-Type": "application/octet-stream"},
        empty=True,
    )


def stat(run_id: str, path: str = "") -> Call[FileInfo]:
    return Call("GET", f"{run_path(run_id)}/fs/stat", params={"path": path}, parse=FileInfo.from_json)


def list_dir(run_id: str, path: str = "", depth: int = 1) -> Call[List[FileInfo]]:
    return Call(
        "GET", f"{run_path(run_id)}/fs/list", params={"path": path, "depth": depth}, parse=parse_entries
    )


def make_dir(run_id: str, path: str, mode: Optional[int] = None, lease: Lease_ = None) -> Call[FileInfo]:
    body = compact(path=path, mode=mode)
    if lease:
        body["owner"], body["generation"] = lease
    return Call("POST", f"{run_path(run_id)}/fs/mkdir", json=body, parse=FileInfo.from_json)


def move(run_id: str, src: str, dst: str, overwrite: bool = False, lease: Lease_ = None) -> Call[FileInfo]:
    body: Dict[str, Any] = {"from": src, "to": dst}
    if overwrite:
        body["overwrite"] = True
    if lease:
        body["owner"], body["generation"] = lease
    return Call("POST", f"{run_path(run_id)}/fs/move", json=body, parse=FileInfo.from_json)


def remove(run_id: str, path: str, recursive: bool = False, lease: Lease_ = None) -> Call[int]:
    body: Dict[str, Any] = {"path": path}
    if recursive:
        body["recursive"] = True
    if lease:
        body["owner"], body["generation"] = lease
    return Call("POST", f"{run_path(run_id)}/fs/remove", json=body, parse=lambda b: b["removed"])


def start_process(run_id: str, cmd: Union[str, List[str]], **kwargs: Any) -> Call[Process]:
    return Call(
        "POST", f"{run_path(run_id)}/processes", json=exec_body(cmd, **kwargs), parse=Process.from_json
    )


def processes(run_id: str) -> Call[List[Process]]:
    return Call("GET", f"{run_path(run_id)}/processes", parse=parse_processes)


def process(run_id: str, proc: Union[int, str]) -> Call[Process]:
    return Call("GET", process_path(run_id, proc), parse=Process.from_json)


def wait_process(run_id: str, proc: Union[int, str], timeout: int = 60) -> Call[Process]:
    return Call(
        "GET", f"{process_path(run_id, proc)}/wait", params={"timeoutSec": timeout}, parse=Process.from_json
    )


def signal_process(run_id: str, proc: Union[int, str], signal: Union[int, str] = "TERM", lease: Lease_ = None) -> Call[Process]:
    body: Dict[str, Any] = {"signal": signal}
    if lease:
        body["owner"], body["generation"] = lease
    return Call("POST", f"{process_path(run_id, proc)}/signal", json=body, parse=Process.from_json)


def send_stdin(run_id: str, proc: Union[int, str], data: Union[bytes, str], close: bool = False, lease: Lease_ = None) -> Call[Process]:
    content = data.encode() if isinstance(data, str) else bytes(data)
    params: Dict[str, Any] = {"close": "true" if close else "false", **lease_params(lease)}
    return Call(
        "POST",
        f"{process_path(run_id, proc)}/stdin",
        content=content,
        params=params,
        headers={"Content-Type": "application/octet-stream"},
        parse=Process.from_json,
    )


def mint_preview(run_id: str, port: int, ttl: Optional[int] = None) -> Call[Preview]:
    return Call(
        "POST", f"{run_path(run_id)}/preview", json=compact(port=port, ttlSec=ttl), parse=Preview.from_json
    )


def snapshot(run_id: str, name: Optional[str] = None, point: Optional[str] = None) -> Call[Dict[str, Any]]:
    return Call("POST", f"{run_path(run_id)}/snapshot", json=compact(name=name, point=point))


def fork(run_id: str, count: int = 1, ttl: Optional[int] = None, point: Optional[str] = None) -> Call[List[Run]]:
    return Call(
        "POST", f"{run_path(run_id)}/fork", json=compact(count=count, ttlSec=ttl, point=point), parse=parse_runs
    )


def history(run_id: str) -> Call[History]:
    return Call("GET", f"{run_path(run_id)}/history", parse=History.from_json)


def newest_point(run_id: str, kept: History) -> str:
    """The newest point of a run's history (what ``diff`` shows when it
    names none); a history with no point yet is ``point_not_found``, as the
    daemon answers for a point it does not have."""
    if not kept.points:
        raise NotFound(404, "point_not_found", f"run {run_id} has no history points yet")
    return kept.points[0].id


def diff(
    run_id: str,
    point: str,
    against: Optional[str] = None,
    patch: bool = False,
    limit: Optional[int] = None,
) -> Call[HistoryDiff]:
    params = compact(against=against, patch="true" if patch else None, limit=limit)
    return Call(
        "GET",
        f"{run_path(run_id)}/history/{segment('history point', point)}/diff",
        params=params or None,
        parse=HistoryDiff.from_json,
    )


def rollback(run_id: str, point: str, lease: Lease_ = None) -> Call[Run]:
    body: Dict[str, Any] = {"point": point}
    if lease:
        body["owner"], body["generation"] = lease
    return Call("POST", f"{run_path(run_id)}/rollback", json=body, parse=Run.from_json)


def checkpoint(run_id: str, labels: Optional[Dict[str, str]] = None) -> Call[Dict[str, Any]]:
    return Call("POST", f"{run_path(run_id)}/checkpoint", json=compact(labels=labels))


def list_checkpoints(labels: Any = None) -> Call[List[Dict[str, Any]]]:
    return Call(
        "GET",
        "/v1/checkpoints",
        params=label_selector(labels),
        parse=lambda body: list(body["checkpoints"]),
    )


def get_checkpoint(checkpoint_id: str) -> Call[Dict[str, Any]]:
    return Call("GET", f"/v1/checkpoints/{segment('checkpoint id', checkpoint_id)}")


def delete_checkpoint(checkpoint_id: str) -> Call[None]:
    return Call("DELETE", f"/v1/checkpoints/{segment('checkpoint id', checkpoint_id)}", empty=True)


def create_tenant(
    name: str,
    max_runs: Optional[int] = None,
    images: Optional[List[str]] = None,
    networks: Optional[List[str]] = None,
    sizes: Optional[List[str]] = None,
    egress_class: Optional[str] = None,
) -> Call[Dict[str, Any]]:
    body = compact(
        name=name, maxRuns=max_runs, images=images, networks=networks, sizes=sizes, egressClass=egress_class
    )
    return Call("POST", "/v1/tenants", json=body)


def list_tenants() -> Call[List[Dict[str, Any]]]:
    return Call("GET", "/v1/tenants", parse=lambda body: list(body["tenants"]))


def get_tenant(name: str) -> Call[Dict[str, Any]]:
    return Call("GET", f"/v1/tenants/{segment('tenant name', name)}")


def update_tenant(
    name: str,
    max_runs: Optional[int] = None,
    images: Optional[List[str]] = None,
    networks: Optional[List[str]] = None,
    sizes: Optional[List[str]] = None,
    egress_class: Optional[str] = None,
) -> Call[Dict[str, Any]]:
    body = compact(maxRuns=max_runs, images=images, networks=networks, sizes=sizes, egressClass=egress_class)
    return Call("PATCH", f"/v1/tenants/{segment('tenant name', name)}", json=body)


def rotate_tenant(name: str) -> Call[Dict[str, Any]]:
    return Call("POST", f"/v1/tenants/{segment('tenant name', name)}/rotate")


def delete_tenant(name: str) -> Call[None]:
    return Call("DELETE", f"/v1/tenants/{segment('tenant name', name)}", empty=True)


def create_volume(
    name: str, size_mb: Optional[int] = None, labels: Optional[Dict[str, str]] = None
) -> Call[Dict[str, Any]]:
    return Call("POST", "/v1/volumes", json=compact(name=name, sizeMb=size_mb, labels=labels))


def list_volumes(labels: Any = None) -> Call[List[Dict[str, Any]]]:
    return Call(
        "GET", "/v1/volumes", params=label_selector(labels), parse=lambda body: list(body["volumes"])
    )


def get_volume(name: str) -> Call[Dict[str, Any]]:
    return Call("GET", f"/v1/volumes/{segment('volume name', name)}")


def clone_volume(name: str, new_name: str, size_mb: Optional[int] = None) -> Call[Dict[str, Any]]:
    body = compact(name=new_name, sizeMb=size_mb)
    return Call("POST", f"/v1/volumes/{segment('volume name', name)}/clone", json=body)


def move_volume(name: str, node: Optional[str] = None) -> Call[Dict[str, Any]]:
    return Call("POST", f"/v1/volumes/{segment('volume name', name)}/move", json=compact(node=node))


def delete_volume(name: str) -> Call[None]:
    return Call("DELETE", f"/v1/volumes/{segment('volume name', name)}", empty=True)


def volume_path(name: str) -> str:
    return f"/v1/volumes/{segment('volume name', name)}"


def write_volume_file(
    name: str,
    path: str,
    data: Union[bytes, str],
    mode: Optional[int] = None,
    owner: Optional[Tuple[int, int]] = None,
    overwrite: bool = True,
) -> Call[FileInfo]:
    content = data.encode() if isinstance(data, str) else bytes(data)
    params: Dict[str, Any] = compact(mode=mode)
    if owner is not None:
        params["uid"], params["gid"] = owner
    if not overwrite:
        params["overwrite"] = "false"
    return Call(
        "PUT",
        f"{volume_path(name)}/files/{file_path(path.lstrip('/'))}",
        content=content,
        params=params or None,
        headers={"Content-Type": "application/octet-stream"},
        parse=FileInfo.from_json,
    )


def volume_stat(name: str, path: str = "") -> Call[FileInfo]:
    return Call("GET", f"{volume_path(name)}/fs/stat", params={"path": path}, parse=FileInfo.from_json)


def volume_list(name: str, path: str = "", depth: int = 1) -> Call[List[FileInfo]]:
    return Call(
        "GET", f"{volume_path(name)}/fs/list", params={"path": path, "depth": depth}, parse=parse_entries
    )


def volume_make_dir(
    name: str, path: str, mode: Optional[int] = None, owner: Optional[Tuple[int, int]] = None
) -> Call[FileInfo]:
    body = compact(path=path, mode=mode)
    if owner is not None:
        body["uid"], body["gid"] = owner
    return Call("POST", f"{volume_path(name)}/fs/mkdir", json=body, parse=FileInfo.from_json)


def volume_move(name: str, src: str, dst: str, overwrite: bool = False) -> Call[FileInfo]:
    body: Dict[str, Any] = {"from": src, "to": dst}
    if overwrite:
        body["overwrite"] = True
    return Call("POST", f"{volume_path(name)}/fs/move", json=body, parse=FileInfo.from_json)


def volume_remove(name: str, path: str, recursive: bool = False) -> Call[int]:
    body: Dict[str, Any] = {"path": path}
    if recursive:
        body["recursive"] = True
    return Call("POST", f"{volume_path(name)}/fs/remove", json=body, parse=lambda b: b["removed"])


def usage(since: Optional[str] = None, tenant: Optional[str] = None) -> Call[Dict[str, Any]]:
    return Call("GET", "/v1/usage", params=compact(since=since, tenant=tenant) or None)


def list_images() -> Call[List[Image]]:
    return Call("GET", "/v1/images", parse=parse_images)


def get_image(name: str) -> Call[Image]:
    return Call("GET", f"/v1/images/{segment('image name', name)}", parse=Image.from_json)


def import_image(name: str, tar: bytes) -> Call[Image]:
    return Call(
        "POST",
        f"/v1/images/{segment('image name', name)}",
        content=tar,
        headers={"Content-Type": "application/x-tar"},
        parse=Image.from_json,
    )


def delete_image(name: str) -> Call[None]:
    return Call("DELETE", f"/v1/images/{segment('image name', name)}", empty=True)


def info() -> Call[Dict[str, Any]]:
    return Call("GET", "/v1/info")


# -- image builds ---------------------------------------------------------


def context_tar(context: Union[bytes, str, "os.PathLike[str]"]) -> bytes:
    """A build context as the bytes of a tar: given bytes as they are, a
    directory archived whole (the daemon leaves out what its
    ``.dockerignore`` excludes when COPY reads it)."""
    if isinstance(context, (bytes, bytearray)):
        return bytes(context)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        root = os.fspath(context)
        if not os.path.isdir(root):
            raise ValueError(f"the build context {root!r} is not a directory")
        for name in sorted(os.listdir(root)):
            tar.add(os.path.join(root, name), arcname=name, recursive=True)
    return buf.getvalue()


def context_digest(tar: bytes) -> str:
    return "sha256:" + hashlib.sha256(tar).hexdigest()


def put_build_context(digest: str, tar: bytes) -> Call[Dict[str, Any]]:
    return Call(
        "PUT",
        f"/v1/build-contexts/{segment('context digest', digest)}",
        content=tar,
        headers={"Content-Type": "application/x-tar"},
    )


def build_body(
    name: str,
    dockerfile: Optional[str] = None,
    *,
    steps: Optional[List[Dict[str, Any]]] = None,
    from_image: Optional[str] = None,
    context: Optional[str] = None,
    build_args: Optional[Dict[str, str]] = None,
    target: Optional[str] = None,
    no_cache: bool = False,
    timeout: Optional[int] = None,
    labels: Optional[Dict[str, str]] = None,
) -> Dict[str, Any]:
    """The body of ``POST /v1/builds``. ``steps``: dicts of ``type``,
    ``args`` and (for COPY) ``files``."""
    body = compact(
        name=name,
        dockerfile=dockerfile,
        steps=steps,
        context=context,
        buildArgs=build_args,
        target=target,
        noCache=no_cache or None,
        timeoutSec=timeout,
        labels=labels,
    )
    if from_image is not None:
        body["from"] = from_image
    return body


def start_build(body: Dict[str, Any]) -> Call[Dict[str, Any]]:
    return Call("POST", "/v1/builds", json=body)


def get_build(build_id: str) -> Call[Dict[str, Any]]:
    return Call("GET", f"/v1/builds/{segment('build id', build_id)}")


def list_builds() -> Call[List[Dict[str, Any]]]:
    return Call("GET", "/v1/builds", parse=lambda body: body["builds"])


def cancel_build(build_id: str) -> Call[Dict[str, Any]]:
    return Call("POST", f"/v1/builds/{segment('build id', build_id)}/cancel")


def build_events_path(build_id: str) -> str:
    return f"/v1/builds/{segment('build id', build_id)}/events"


def build_event(event: Dict[str, Any], on_log: Optional[Callable[[Dict[str, Any]], None]]) -> Optional[Dict[str, Any]]:
    """One build event seen by ``build_image``: a log line goes to
    ``on_log``; ``done`` is the ended build, returned when it is ready and
    raised as :class:`BuildFailed` when not; anything else is None."""
    if event.get("event") == "log" and on_log is not None:
        on_log(event)
    elif event.get("event") == "done":
        event.pop("event", None)
        if event.get("status") != "ready":
            raise BuildFailed(event)
        return event
    return None
