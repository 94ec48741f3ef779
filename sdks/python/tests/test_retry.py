"""Retries of what is safe to repeat: the decision itself (pure logic),
then for real against a daemon at its capacity (``--max-runs 1``) and a
port nothing listens on."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from typing import Any, List, Optional

import httpx
import pytest

import runbox
from runbox import AsyncRunbox, Runbox
from runbox import _calls as calls
from runbox._core import Call, RetryPolicy, retry_after_seconds

from daemon import Daemon

# -- the decision -----------------------------------------------------------

POLICY = RetryPolicy()
KEYED_CREATE = calls.create_run("base")
UNKEYED_CREATE = Call("POST", "/v1/runs", json={"image": "base"})
GET = calls.get_run("01JZ3K8Q4M7T2V9XGH5R6NB0CD")
HEAD = Call("HEAD", "/health")
DELETE = calls.delete_run("01JZ3K8Q4M7T2V9XGH5R6NB0CD")
FORK = calls.fork("01JZ3K8Q4M7T2V9XGH5R6NB0CD")
WAKE = calls.wake_run("01JZ3K8Q4M7T2V9XGH5R6NB0CD")
PUT = calls.write_file("01JZ3K8Q4M7T2V9XGH5R6NB0CD", "a.txt", b"x")
PATCH = calls.update_tenant("acme", max_runs=3)
EXEC = Call("POST", "/v1/runs/01JZ3K8Q4M7T2V9XGH5R6NB0CD/exec", json={"cmd": ["true"]})
STREAMED = Call("PUT", "/v1/runs/01JZ3K8Q4M7T2V9XGH5R6NB0CD/files/a", content=iter([b"x"]))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "call, status, retry_after, wait",
    [
        # Safe to repeat, and the server said when: after that long.
        (GET, 429, "1", 1.0),
        (GET, 503, "30", 30.0),
        (HEAD, 429, "2", 2.0),
        (DELETE, 429, "1", 1.0),
        (DELETE, 503, "0", 0.0),
        (KEYED_CREATE, 429, "1", 1.0),
        (KEYED_CREATE, 503, " 30 ", 30.0),
        # Each wait is capped.
        (GET, 503, "3600", 30.0),
        # A POST other than a keyed create, a PUT, a PATCH may have done
        # something: never repeated once answered.
        (UNKEYED_CREATE, 429, "1", None),
        (FORK, 429, "1", None),
        (WAKE, 429, "1", None),
        (EXEC, 503, "1", None),
        (PUT, 503, "1", None),
        (PATCH, 503, "1", None),
        (STREAMED, 503, "1", None),
        # Only 429 and 503, and only with a Retry-After that can be read.
        (GET, 429, None, None),
        (KEYED_CREATE, 503, None, None),
        (GET, 429, "soon", None),
        (GET, 429, "-1", None),
        (GET, 429, "1.5", None),
        (GET, 500, "1", None),
        (GET, 502, "1", None),
        (GET, 404, "1", None),
        (KEYED_CREATE, 409, "1", None),
    ],
)
def test_which_answers_are_sent_again(call: Call[Any], status: int, retry_after: Optional[str], wait: Optional[float]):
    assert POLICY.after_answer(call, status, retry_after, 0) == wait


def test_a_call_that_met_a_moving_run_is_sent_again_whatever_its_method():
    assert POLICY.after_answer(EXEC, 503, "1", 0, "run_moved") == 1.0
    assert POLICY.after_answer(EXEC, 503, "1", 0, "draining") is None
    assert POLICY.after_answer(STREAMED, 503, "1", 0, "run_moved") is None
    assert POLICY.after_answer(EXEC, 409, "1", 0, "run_moved") is None


def test_retry_after_may_be_a_date():
    now = datetime(2030, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
    assert retry_after_seconds(format_datetime(now + timedelta(seconds=7), usegmt=True), now) == 7.0
    assert retry_after_seconds(format_datetime(now - timedelta(seconds=7), usegmt=True), now) == 0.0
    assert retry_after_seconds("17") == 17.0
    assert retry_after_seconds("") is None
    assert retry_after_seconds("Someday, 99 Foo 2030") is None


REFUSED = httpx.ConnectError("[Errno 111] Connection refused")
CONNECT_TIMEOUT = httpx.ConnectTimeout("timed out")
LOST = httpx.RemoteProtocolError("Server disconnected without sending a response.")
READ_ERROR = httpx.ReadError("[Errno 104] Connection reset by peer")
READ_TIMEOUT = httpx.ReadTimeout("timed out")


@pytest.mark.parametrize(
    "call, error, wait",
    [
        # Never reached the server: any method, after the first backoff.
        (GET, REFUSED, 0.2),
        (EXEC, REFUSED, 0.2),
        (FORK, REFUSED, 0.2),
        (PUT, REFUSED, 0.2),
        (PATCH, REFUSED, 0.2),
        (UNKEYED_CREATE, REFUSED, 0.2),
        (DELETE, CONNECT_TIMEOUT, 0.2),
        # The answer lost on the way: only what reads, and keyed creates.
        (GET, LOST, 0.2),
        (HEAD, READ_ERROR, 0.2),
        (KEYED_CREATE, LOST, 0.2),
        (KEYED_CREATE, READ_ERROR, 0.2),
        (UNKEYED_CREATE, LOST, None),
        (DELETE, LOST, None),
        (EXEC, READ_ERROR, None),
        (PUT, LOST, None),
        # A read timeout keeps bounding the call.
        (GET, READ_TIMEOUT, None),
        # A stream the first attempt consumed is never sent again.
        (STREAMED, REFUSED, None),
    ],
)
def test_which_failures_are_sent_again(call: Call[Any], error: Exception, wait: Optional[float]):
    assert POLICY.after_error(call, error, 0) == wait


def test_backoff_doubles_and_retries_are_bounded():
    assert [POLICY.after_error(EXEC, REFUSED, n) for n in range(4)] == [0.2, 0.4, 0.8, None]
    assert [POLICY.after_answer(GET, 429, "1", n) for n in range(4)] == [1.0, 1.0, 1.0, None]
    off = RetryPolicy(max_retries=0)
    assert off.after_error(GET, REFUSED, 0) is None
    assert off.after_answer(KEYED_CREATE, 429, "1", 0) is None
    short = RetryPolicy(max_retries=5, max_wait=0.5)
    assert [short.after_error(GET, REFUSED, n) for n in range(6)] == [0.2, 0.4, 0.5, 0.5, 0.5, None]
    assert short.after_answer(GET, 503, "30", 0) == 0.5
    with pytest.raises(ValueError):
        RetryPolicy(max_retries=-1)
    with pytest.raises(ValueError):
        Runbox("http://127.0.0.1:1", "t", max_retries=-1)


def test_every_create_carries_a_key_of_its_own():
    first, second = calls.create_run("base"), calls.create_run("base")
    assert first.headers["Idempotency-Key"] != second.headers["Idempotency-Key"]
    assert len(first.headers["Idempotency-Key"]) <= 128
    assert calls.create_run("base", idempotency_key="mine").headers == {"Idempotency-Key": "mine"}


# -- a daemon at its capacity ---------------------------------------------------


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


@pytest.fixture(scope="module")
def capped():
    """A daemon that holds one run at most: a second create answers
    ``429 capacity`` with ``Retry-After: 1``."""
    signal.signal(signal.SIGTERM, _interrupt)
    d = Daemon(name="pycap", octet=241, args=("--max-runs", "1"))
    try:
        yield d
    finally:
        d.stop()


class Seen:
    """What a client sent and was answered, as (method, path,
    Idempotency-Key, status); ``refused`` is set at the first 429."""

    def __init__(self) -> None:
        self.answers: List[tuple] = []
        self.refused = threading.Event()

    def record(self, response: httpx.Response) -> None:
        request = response.request
        self.answers.append((request.method, request.url.path, request.headers.get("idempotency-key"), response.status_code))
        if response.status_code == 429:
            self.refused.set()

    def creates(self) -> List[tuple]:
        return [a for a in self.answers if a[:2] == ("POST", "/v1/runs")]


def watched(d: Daemon, seen: Seen) -> httpx.Client:
    return httpx.Client(
        base_url=d.url,
        headers={"Authorization": f"Bearer {d.token}"},
        timeout=60,
        event_hooks={"response": [seen.record]},
    )


def assert_retried_with_one_key(seen: Seen, run_id: str, rb: Runbox) -> None:
    creates = seen.creates()
    assert [c[3] for c in creates][0] == 429 and creates[-1][3] == 201, creates
    assert all(c[3] == 429 for c in creates[:-1]), creates
    # Every attempt was the same create: one key.
    assert len({c[2] for c in creates}) == 1 and creates[0][2]
    # No second run from a repeated create.
    assert [r.id for r in rb.list_runs()] == [run_id]


def test_a_create_at_capacity_is_sent_again_until_there_is_room(capped: Daemon):
    seen = Seen()
    with Runbox(capped.url, capped.token) as rb, Runbox(capped.url, capped.token, http=watched(capped, seen)) as waiting:
        first = rb.create_run("base")
        outcome: dict = {}

        def create() -> None:
            try:
                outcome["run"] = waiting.create_run("base")
            except Exception as e:  # reported below
                outcome["error"] = e

        started = time.monotonic()
        thread = threading.Thread(target=create)
        thread.start()
        try:
            # Refused while the first run lives; it ends ~0.3 s later.
            assert seen.refused.wait(30), "the second create was never refused"
            time.sleep(max(0.0, 0.3 - (time.monotonic() - started)))
            rb.delete_run(first.id)
        finally:
            thread.join(60)
        assert "error" not in outcome, outcome
        run = outcome["run"]
        try:
            assert run.status == "running"
            # It waited out Retry-After: 1 before trying again.
            assert time.monotonic() - started >= 1.0
            assert_retried_with_one_key(seen, run.id, rb)
        finally:
            rb.delete_run(run.id)


async def test_an_async_create_at_capacity_is_sent_again_until_there_is_room(capped: Daemon):
    seen = Seen()

    async def record(response: httpx.Response) -> None:
        seen.record(response)

    http = httpx.AsyncClient(
        base_url=capped.url,
        headers={"Authorization": f"Bearer {capped.token}"},
        timeout=60,
        event_hooks={"response": [record]},
    )
    async with AsyncRunbox(capped.url, capped.token) as rb, AsyncRunbox(capped.url, capped.token, http=http) as waiting:
        first = await rb.create_run("base")
        started = time.monotonic()
        second = asyncio.create_task(waiting.create_run("base"))
        # Refused while the first run lives; it ends ~0.3 s later.
        while not seen.refused.is_set():
            assert time.monotonic() - started < 30, "the second create was never refused"
            await asyncio.sleep(0.02)
        await asyncio.sleep(max(0.0, 0.3 - (time.monotonic() - started)))
        assert not second.done()
        await rb.delete_run(first.id)
        run = await asyncio.wait_for(second, 60)
        try:
            assert run.status == "running"
            with Runbox(capped.url, capped.token) as sync:
                assert_retried_with_one_key(seen, run.id, sync)
        finally:
            await rb.delete_run(run.id)


def test_without_retries_a_create_at_capacity_fails_at_once(capped: Daemon):
    seen = Seen()
    with Runbox(capped.url, capped.token) as rb, Runbox(
        capped.url, capped.token, http=watched(capped, seen), max_retries=0
    ) as impatient:
        first = rb.create_run("base")
        try:
            started = time.monotonic()
            with pytest.raises(runbox.Unavailable) as e:
                impatient.create_run("base")
            # Not after Retry-After: 1.
            assert time.monotonic() - started < 1.0
            assert (e.value.status, e.value.code) == (429, "capacity")
            assert [c[3] for c in seen.creates()] == [429]
            assert [r.id for r in rb.list_runs()] == [first.id]
        finally:
            rb.delete_run(first.id)


# -- nothing listening ------------------------------------------------------


@pytest.fixture
def refusing_url():
    """A URL whose port is bound and never listened on: every connection
    to it is refused (and nothing else can take the port meanwhile)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{holder.getsockname()[1]}"


def test_a_daemon_that_is_not_there_is_tried_again_then_given_up(refusing_url: str):
    attempts: List[str] = []
    http = httpx.Client(base_url=refusing_url, event_hooks={"request": [lambda r: attempts.append(r.method)]})
    with Runbox(refusing_url, "t", http=http, max_retries=2) as rb:
        started = time.monotonic()
        with pytest.raises(runbox.RunboxError) as e:
            rb.renew_run("01JZ3K8Q4M7T2V9XGH5R6NB0CD", 60)
        # Any method: the request never reached a server. 0.2 s, then 0.4 s.
        assert time.monotonic() - started >= 0.2 + 0.4
    assert (e.value.status, e.value.code) == (0, "unreachable")
    assert attempts == ["POST"] * 3
    # Turned off: one attempt.
    attempts.clear()
    http = httpx.Client(base_url=refusing_url, event_hooks={"request": [lambda r: attempts.append(r.method)]})
    with Runbox(refusing_url, "t", http=http, max_retries=0) as rb:
        with pytest.raises(runbox.RunboxError) as e:
            rb.health()
    assert e.value.code == "unreachable" and attempts == ["GET"]


def test_a_stream_to_a_daemon_that_is_not_there_is_tried_again(refusing_url: str):
    with Runbox(refusing_url, "t", max_retries=1) as rb:
        started = time.monotonic()
        with pytest.raises(runbox.StreamEnded):
            rb.run("01JZ3K8Q4M7T2V9XGH5R6NB0CD", "true")
        assert time.monotonic() - started >= 0.2


async def test_the_async_client_tries_again_then_gives_up(refusing_url: str):
    async with AsyncRunbox(refusing_url, "t") as rb:
        started = time.monotonic()
        with pytest.raises(runbox.RunboxError) as e:
            await rb.create_run("base")
        # The default: three retries, 0.2 + 0.4 + 0.8 s apart.
        assert time.monotonic() - started >= 0.2 + 0.4 + 0.8
    assert (e.value.status, e.value.code) == (0, "unreachable")
