"""runbox: self-hosted sandboxes for AI agents.

>>> from runbox import Runbox
>>> with Runbox() as rb:
...     run = rb.create_run("base")
...     print(rb.run(run.id, "echo hi").text)
...     rb.delete_run(run.id)

:class:`Runbox` is synchronous, :class:`AsyncRunbox` (in ``runbox.aio``)
the same surface with ``await``. Errors are :class:`RunboxError` (and its
subclasses by HTTP status), carrying the API's stable ``code``.
"""

from ._errors import (
    BadRequest,
    BuildFailed,
    Conflict,
    Forbidden,
    NotFound,
    RunboxError,
    StreamEnded,
    TooLarge,
    Unauthorized,
    Unavailable,
)
from ._models import (
    ChangeSummary,
    ExecResult,
    Exit,
    FileInfo,
    History,
    HistoryDiff,
    HistoryPoint,
    Image,
    Lease,
    Limits,
    Lost,
    PathChange,
    PathState,
    PointCause,
    Preview,
    Process,
    ProcessExit,
    Run,
    Started,
    Stderr,
    Stdout,
)
from ._session import Session
from .aio import AsyncRunbox, AsyncSession
from .client import Runbox

__all__ = [
    "AsyncRunbox",
    "AsyncSession",
    "BadRequest",
    "BuildFailed",
    "ChangeSummary",
    "Conflict",
    "ExecResult",
    "Exit",
    "FileInfo",
    "Forbidden",
    "History",
    "HistoryDiff",
    "HistoryPoint",
    "Image",
    "Lease",
    "Limits",
    "Lost",
    "NotFound",
    "PathChange",
    "PathState",
    "PointCause",
    "Preview",
    "Process",
    "ProcessExit",
    "Run",
    "Runbox",
    "RunboxError",
    "Session",
    "Started",
    "Stderr",
    "Stdout",
    "StreamEnded",
    "TooLarge",
    "Unauthorized",
    "Unavailable",
]
