"""The SDK's fixtures over a real daemon (see daemon.py)."""

from __future__ import annotations

import signal

import pytest

from daemon import Daemon


def _interrupt(*_: object) -> None:
    # pytest runs finalizers on KeyboardInterrupt, not on SIGTERM: a killed
    # test session must still tear its daemon and runs down.
    raise KeyboardInterrupt


@pytest.fixture(scope="session")
def daemon():
    signal.signal(signal.SIGTERM, _interrupt)
    d = Daemon()
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def rb(daemon):
    from runbox import Runbox

    with Runbox(daemon.url, daemon.token) as client:
        yield client


@pytest.fixture
def run_id(rb):
    run = rb.create_run("base")
    try:
        yield run.id
    finally:
        try:
            rb.delete_run(run.id)
        except Exception:
            pass
