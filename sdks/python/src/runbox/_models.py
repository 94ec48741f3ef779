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
        )


@dataclass
class Exit:
    """How a command ended: ``exit_code`` (128 + signal when a signal ended
    it, -1 when unknown), ``signal``, ``timed_out``, and ``reason``
    (``exited``, ``signaled``, ``timeout``, ``run_expired``, ``run_deleted``,
    ``run_moved``, ``agent_lost``)."""

    exit_code: int
    timed_out: bool
    signal: Optional[int]
    reason: str

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "Exit":
        return cls(d["exitCode"], bool(d.get("timedOut")), d.get("signal"), d.get("reason", "exited"))


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
