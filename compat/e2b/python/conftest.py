"""The unmodified E2B SDK pointed at a real runbox daemon of its own (the
daemon helper of the runbox SDK's tests): E2B_API_URL, E2B_SANDBOX_URL and
E2B_VOLUME_API_URL name the runbox listener, E2B_API_KEY is the runbox
token."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "sdks" / "python" / "tests"))

from daemon import Daemon  # noqa: E402


def _interrupt(*_: object) -> None:
    # pytest runs finalizers on KeyboardInterrupt, not on SIGTERM.
    raise KeyboardInterrupt


@pytest.fixture(scope="session", autouse=True)
def daemon():
    signal.signal(signal.SIGTERM, _interrupt)
    # Loopback upstreams on 127.0.0.7 and .8 stand for the internet in the
    # network tests; the proxy refuses loopback unless admitted.
    # An egress proxy (microsocks) on 127.0.0.9 stands for a customer's
    # SOCKS5 exit; the operator admits it.
    d = Daemon(
        name="e2bpy",
        octet=235,
        args=(
            "--egress-internal-allow",
            "127.0.0.0/8",
            "--egress-upstream-allow",
            "127.0.0.9",
        ),
    )
    names = ("E2B_API_KEY", "E2B_API_URL", "E2B_SANDBOX_URL", "E2B_VOLUME_API_URL")
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update(
        E2B_API_KEY=d.token, E2B_API_URL=d.url, E2B_SANDBOX_URL=d.url, E2B_VOLUME_API_URL=d.url
    )
    try:
        yield d
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        d.stop()


@pytest.fixture
def sbx():
    from e2b import Sandbox

    sandbox = Sandbox.create(timeout=300)
    try:
        yield sandbox
    finally:
        sandbox.kill()
