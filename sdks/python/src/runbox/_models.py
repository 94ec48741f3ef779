"""Typed views of the API's JSON answers.

Each model keeps the answer it came from in ``raw``, so fields a newer
daemon adds are never lost; unknown fields are ignored, missing optional
ones are ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Dict, List, Optional


def _time(value: Optional[str]) -> Optional[datetime]:
    if not value:
        return None
    # Python before 3.11 does not take "Z" or nanoseconds.
    text = value.replace("Z", "+00:00")
    if "." in text:
        head, rest = text.split(".", 1)
        digits = "".join(c for c in rest if c.isdigit())
        zone = rest[len(digits):]
        text = f"{head}.{digits[:6]}{zone}"
    return datetime.fromisoformat(text)


@dataclass
class Limits:
    cpus: float
    memory_mb: int
    pids: int
    disk_mb: Optional[int]

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "Limits":
        return cls(d["cpus"], d["memoryMb"], d["pids"], d.get("diskMb"))


@dataclass
class Lease:
    holder: str
    generation: int
    expires_at: Optional[datetime]

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "Lease":
        return cls(d["holder"], d["generation"], _time(d.get("expiresAt")))


@dataclass
class Run:
    """A run (sandbox)."""

    id: str
    image: str
    network: str
    status: str
    limits: Limits
    created_at: Optional[datetime]
    expires_at: Optional[datetime]
    lease: Optional[Lease]
    labels: Dict[str, str]
    pooled: bool
    raw: Dict[str, Any] = field(repr=False)
    auto_resume: bool = True
    on_expire: str = "delete"
    on_node_loss: str = "restore"
    #: Set when the run came back on another node after its node was lost:
    #: ``node``, ``checkpoint``, ``stateAt`` and what was ``lost``.
    recovered: Optional[Dict[str, Any]] = None
    idle: Dict[str, int] = field(default_factory=dict)
    restarts: int = 0
    allow_privilege_escalation: bool = False
    volumes: List[Dict[str, Any]] = field(default_factory=list)
    egress_allow: List[Any] = field(default_factory=list)
    secrets: List[str] = field(default_factory=list)
    socks5: bool = False
    upstream: Optional[str] = None
    failure: Optional[str] = None
    tenant: Optional[str] = None
    token: Optional[str] = field(default=None, repr=False)
    lease_generation: int = 0
    #: ``{"keep": N}`` when the run keeps a history (see :meth:`Runbox.history`).
    history: Optional[Dict[str, int]] = None

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "Run":
        lease = d.get("lease")
        return cls(
            id=d["id"],
            image=d["image"],
            network=d["network"],
            status=d["status"],
            limits=Limits.from_json(d["limits"]),
            created_at=_time(d.get("createdAt")),
            expires_at=_time(d.get("expiresAt")),
            lease=Lease.from_json(lease) if lease else None,
            lease_generation=int(d.get("leaseGeneration") or 0),
            labels=dict(d.get("labels") or {}),
            pooled=bool(d.get("pooled", False)),
            raw=d,
            auto_resume=bool(d.get("autoResume", True)),
            on_expire=d.get("onExpire", "delete"),
            on_node_loss=d.get("onNodeLoss", "restore"),
            recovered=d.get("recovered"),
            idle=dict(d.get("idle") or {}),
            restarts=int(d.get("restarts", 0)),
            allow_privilege_escalation=bool(d.get("allowPrivilegeEscalation", False)),
            volumes=list(d.get("volumes") or []),
            egress_allow=list(d.get("egressAllow") or []),
            secrets=list(d.get("secrets") or []),
            socks5=bool(d.get("egressSocks5", False)),
            upstream=d.get("egressUpstream"),
            failure=d.get("failure"),
            tenant=d.get("tenant"),
            token=d.get("token"),
            history=d.get("history"),
        )


@dataclass
class Exit:
    """How a command ended: ``exit_code`` (128 + signal when a signal ended
    it, -1 when unknown), ``signal``, ``timed_out``, and ``reason``
    (``exited``, ``signaled``, ``timeout``, ``run_expired``, ``run_deleted``,
    ``run_moved``, ``agent_lost``); in a run with a history, ``point``: the
    history point the command's changes were kept as (None when it changed
    no file)."""

    exit_code: int
    timed_out: bool
    signal: Optional[int]
    reason: str
    point: Optional[str] = None

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "Exit":
        return cls(
            d["exitCode"], bool(d.get("timedOut")), d.get("signal"), d.get("reason", "exited"), d.get("point")
        )


@dataclass
class ExecResult:
    """Everything a finished command produced."""

    pid: Optional[int]
    stdout: bytes
    stderr: bytes
    exit: Exit

    @property
    def exit_code(self) -> int:
        return self.exit.exit_code

    @property
    def point(self) -> Optional[str]:
        """The history point the command's changes were kept as (runs with a
        history; None when it changed no file)."""
        return self.exit.point

    @property
    def text(self) -> str:
        """stdout as text (UTF-8, undecodable bytes replaced)."""
        return self.stdout.decode("utf-8", "replace")


@dataclass
class Started:
    """The command started with this pid (always the first event)."""

    pid: int


@dataclass
class Stdout:
    data: bytes


@dataclass
class Stderr:
    data: bytes


@dataclass
class Lost:
    """An attached reader fell behind and this many chunks were skipped."""

    chunks: int


ExecEvent = Any  # Started | Stdout | Stderr | Lost | Exit


@dataclass
class FileInfo:
    path: str
    kind: str
    size: int
    mode: int
    uid: int
    gid: int
    modified_at: Optional[datetime]
    target: Optional[str]

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "FileInfo":
        return cls(
            d["path"], d["kind"], d["size"], d["mode"], d["uid"], d["gid"],
            _time(d.get("modifiedAt")), d.get("target"),
        )


@dataclass
class ProcessExit:
    exit_code: int
    signal: Optional[int]
    timed_out: bool


@dataclass
class Process:
    """A process in a run."""

    pid: int
    tag: Optional[str]
    cmd: List[str]
    cwd: str
    background: bool
    pty: bool
    stdin_open: bool
    running: bool
    exit: Optional[ProcessExit]
    started_at: Optional[datetime]
    ended_at: Optional[datetime]

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "Process":
        e = d.get("exit")
        return cls(
            pid=d["pid"],
            tag=d.get("tag"),
            cmd=list(d.get("cmd") or []),
            cwd=d.get("cwd", ""),
            background=bool(d.get("background")),
            pty=bool(d.get("pty")),
            stdin_open=bool(d.get("stdinOpen")),
            running=bool(d.get("running")),
            exit=ProcessExit(e["exitCode"], e.get("signal"), bool(e.get("timedOut"))) if e else None,
            started_at=_time(d.get("startedAt")),
            ended_at=_time(d.get("endedAt")),
        )


@dataclass
class Image:
    name: str
    size_bytes: int
    source: str
    layers: List[str]
    created_at: Optional[datetime]
    raw: Dict[str, Any] = field(repr=False)

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "Image":
        return cls(d["name"], d["sizeBytes"], d["source"], list(d["layers"]), _time(d.get("createdAt")), d)


@dataclass
class Preview:
    url: str
    token: str
    port: int
    expires_at: Optional[datetime]

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "Preview":
        return cls(d["url"], d["token"], d["port"], _time(d.get("expiresAt")))


@dataclass
class ChangeSummary:
    """How many paths a history point changed against the point before it,
    and ``bytes``: the size of the files added or modified."""

    added: int
    modified: int
    removed: int
    bytes: int

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "ChangeSummary":
        return cls(d["added"], d["modified"], d["removed"], d["bytes"])


@dataclass
class PointCause:
    """What made a history point: ``kind`` (``create``, ``exec``,
    ``process``, ``file``, ``rollback``); a command's ``argv``,
    ``exit_code`` and ``user``; a file call's ``op`` (``write``, ``mkdir``,
    ``move``, ``remove``) and ``path``."""

    kind: str
    argv: Optional[List[str]] = None
    exit_code: Optional[int] = None
    user: Optional[str] = None
    op: Optional[str] = None
    path: Optional[str] = None

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "PointCause":
        argv = d.get("argv")
        return cls(
            d["kind"],
            list(argv) if argv is not None else None,
            d.get("exitCode"),
            d.get("user"),
            d.get("op"),
            d.get("path"),
        )


@dataclass
class HistoryPoint:
    """One point of a run's history: its files as they were right after
    what made it (``cause``); ``parent`` is the point before it."""

    id: str
    created_at: Optional[datetime]
    parent: Optional[str]
    cause: PointCause
    changes: ChangeSummary

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "HistoryPoint":
        return cls(
            d["id"],
            _time(d.get("createdAt")),
            d.get("parent"),
            PointCause.from_json(d["cause"]),
            ChangeSummary.from_json(d["changes"]),
        )


@dataclass
class History:
    """A run's history: its ``points``, newest first; ``head``, the point
    its files are at (or descend from); how many it ``keep``s; ``bytes``,
    what the points alone hold on disk (None where the storage does not
    count it)."""

    points: List[HistoryPoint]
    head: Optional[str]
    keep: int
    bytes: Optional[int]
    raw: Dict[str, Any] = field(repr=False)

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "History":
        return cls(
            [HistoryPoint.from_json(p) for p in d["points"]], d.get("head"), d["keep"], d.get("bytes"), d
        )


@dataclass
class PathState:
    """A path's entry on one side of a diff (``kind``, ``mode``, ``uid``,
    ``gid`` as the run sees them, ``size``, a link's ``target``)."""

    kind: str
    mode: int
    uid: int
    gid: int
    size: int
    target: Optional[str] = None

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "PathState":
        return cls(d["kind"], d["mode"], d["uid"], d["gid"], d["size"], d.get("target"))


@dataclass
class PathChange:
    """One changed path (absolute, as the run sees it): ``change``
    (``added``, ``modified``, ``removed``), its entry ``before`` and
    ``after``; with ``patch=True`` a text file's unified diff (``patch``),
    or ``binary`` for a file shown without one."""

    path: str
    change: str
    before: Optional[PathState]
    after: Optional[PathState]
    patch: Optional[str] = None
    binary: bool = False

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "PathChange":
        before, after = d.get("before"), d.get("after")
        return cls(
            d["path"],
            d["change"],
            PathState.from_json(before) if before else None,
            PathState.from_json(after) if after else None,
            d.get("patch"),
            bool(d.get("binary", False)),
        )


@dataclass
class HistoryDiff:
    """What a history ``point`` changed against ``against`` (its parent, or
    the point asked for): the ``changes`` in path order, ``truncated`` when
    more paths changed than are listed, and their ``summary``."""

    point: str
    against: Optional[str]
    changes: List[PathChange]
    truncated: bool
    summary: ChangeSummary
    raw: Dict[str, Any] = field(repr=False)

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "HistoryDiff":
        return cls(
            d["point"],
            d.get("against"),
            [PathChange.from_json(c) for c in d["changes"]],
            bool(d.get("truncated", False)),
            ChangeSummary.from_json(d["summary"]),
            d,
        )
