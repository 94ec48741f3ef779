"""The E2B Python SDK, unmodified, against runbox: what docs/e2b.md says
works, works; what it says answers 501 does."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from e2b import CommandExitException, PtySize, Sandbox, SandboxQuery
from e2b.exceptions import (
    AuthenticationException,
    InvalidArgumentException,
    NotFoundException,
    SandboxException,
    SandboxNotRunningException,
    TimeoutException,
)


def test_create_run_and_kill():
    sbx = Sandbox.create(timeout=120, envs={"GREETING": "hello"}, metadata={"suite": "e2b"})
    try:
        r = sbx.commands.run("echo $GREETING; echo oops >&2")
        assert (r.stdout, r.stderr, r.exit_code) == ("hello\n", "oops\n", 0)
        with pytest.raises(CommandExitException) as failed:
            sbx.commands.run("exit 3")
        assert failed.value.exit_code == 3
        # Per-command environment and working directory.
        r = sbx.commands.run("echo $X; pwd", envs={"X": "y"}, cwd="/tmp")
        assert r.stdout == "y\n/tmp\n"
        info = sbx.get_info()
        assert info.sandbox_id == sbx.sandbox_id
        assert info.template_id == "base"
        assert info.metadata == {"suite": "e2b"}
        assert sbx.is_running()
    finally:
        assert sbx.kill()
    assert not sbx.is_running()
    with pytest.raises(SandboxNotRunningException):
        sbx.commands.run("echo too late")
    # Killing it again is not an error: it is simply not found.
    assert not Sandbox.kill(sbx.sandbox_id)


def test_background_commands_wait_and_take_stdin(sbx):
    h = sbx.commands.run("sleep 0.3; echo done", background=True)
    assert h.wait().stdout == "done\n"

    cat = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(cat.pid, "line one\n")
    sbx.commands.stream_input(cat.pid, ["line ", "two\n"])
    sbx.commands.close_stdin(cat.pid)
    assert cat.wait().stdout == "line one\nline two\n"

    sleeper = sbx.commands.run("sleep 60", background=True)
    assert sleeper.pid in [p.pid for p in sbx.commands.list()]
    # A second client follows it by pid.
    other = Sandbox.connect(sbx.sandbox_id)
    follower = other.commands.connect(sleeper.pid)
    assert sbx.commands.kill(sleeper.pid)
    with pytest.raises(CommandExitException):
        follower.wait()
    assert not sbx.commands.kill(sleeper.pid)


def test_a_command_past_its_timeout_ends_the_call_not_the_command(sbx):
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 30", timeout=1)
    # As with E2B, the timeout bounds the connection: the command runs on
    # until it is killed.
    running = [p for p in sbx.commands.list() if "sleep 30" in " ".join(p.args)]
    assert len(running) == 1
    assert sbx.commands.kill(running[0].pid)


def test_a_pty_session(sbx):
    pty = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.resize(pty.pid, PtySize(rows=40, cols=120))
    sbx.pty.send_stdin(pty.pid, b"stty size; echo pty-$((6*7))\nexit\n")
    out = []
    pty.wait(on_pty=lambda data: out.append(data))
    text = b"".join(out).decode()
    assert "40 120" in text
    assert "pty-42" in text


def test_files_anywhere_in_the_sandbox(sbx):
    info = sbx.files.write("/tmp/notes/a.txt", "first")
    assert (info.name, info.path) == ("a.txt", "/tmp/notes/a.txt")
    assert sbx.files.read("/tmp/notes/a.txt") == "first"
    blob = bytes(range(256)) * 1000
    sbx.files.write("/opt/blob.bin", blob)
    assert bytes(sbx.files.read("/opt/blob.bin", format="bytes")) == blob
    # Several at once, and a relative path (taken from the user's home).
    sbx.files.write_files([{"path": "/tmp/notes/b.txt", "data": "b"}, {"path": "rel.txt", "data": "r"}])
    assert sbx.commands.run("cat /tmp/notes/b.txt /root/rel.txt").stdout == "br"
    # The image's own files are there too.
    assert "root:" in sbx.files.read("/etc/passwd")

    names = sorted(e.name for e in sbx.files.list("/tmp/notes"))
    assert names == ["a.txt", "b.txt"]
    entry = sbx.files.get_info("/tmp/notes/a.txt")
    assert entry.size == 5 and entry.type.value == "file"
    assert sbx.files.exists("/tmp/notes") and not sbx.files.exists("/tmp/none")
    assert sbx.files.make_dir("/tmp/notes/sub") is True
    assert sbx.files.make_dir("/tmp/notes/sub") is False
    moved = sbx.files.rename("/tmp/notes/a.txt", "/tmp/notes/sub/a2.txt")
    assert moved.path == "/tmp/notes/sub/a2.txt"
    sbx.files.remove("/tmp/notes")
    assert not sbx.files.exists("/tmp/notes")
    with pytest.raises(NotFoundException):
        sbx.files.read("/tmp/notes/sub/a2.txt")


def test_watching_a_directory(sbx):
    sbx.files.make_dir("/tmp/watched")
    watcher = sbx.files.watch_dir("/tmp/watched")
    try:
        sbx.files.write("/tmp/watched/new.txt", "x")
        sbx.commands.run("rm /tmp/watched/new.txt")
        seen = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            seen += [(e.name, e.type.value) for e in watcher.get_new_events()]
            if ("new.txt", "remove") in seen:
                break
            time.sleep(0.1)
        assert ("new.txt", "create") in seen
        assert ("new.txt", "remove") in seen
        # runbox's upload temporaries never show.
        assert all(not name.startswith(".runbox-upload-") for name, _ in seen)
    finally:
        watcher.stop()


def test_paths_stay_inside_the_sandbox(sbx):
    # An absolute symlink inside the sandbox resolves inside it: the write
    # lands in the sandbox's /etc, never the host's.
    sbx.commands.run("ln -s /etc /tmp/etc-link")
    probe = f"runbox-e2b-probe-{sbx.sandbox_id}"
    sbx.files.write(f"/tmp/etc-link/{probe}", "inside")
    assert sbx.commands.run(f"cat /etc/{probe}").stdout == "inside"
    assert not Path("/etc", probe).exists()
    with pytest.raises(InvalidArgumentException):
        sbx.files.write("/tmp/../../etc/escape", "no")
    with pytest.raises(InvalidArgumentException):
        sbx.files.read("/proc/self/root/etc/passwd")


def test_timeout_listing_and_metrics(sbx):
    before = sbx.get_info().end_at
    sbx.set_timeout(1800)
    assert sbx.get_info().end_at > before

    tagged = Sandbox.create(timeout=120, metadata={"team": "list-test"})
    try:
        mine = Sandbox.list(query=SandboxQuery(metadata={"team": "list-test"})).next_items()
        assert [s.sandbox_id for s in mine] == [tagged.sandbox_id]
        assert Sandbox.list(query=SandboxQuery(metadata={"team": "nobody"})).next_items() == []
        # Pages of one, with a next token, cover both.
        pager = Sandbox.list(limit=1)
        ids = []
        while pager.has_next:
            page = pager.next_items()
            assert len(page) <= 1
            ids += [s.sandbox_id for s in page]
        assert {sbx.sandbox_id, tagged.sandbox_id} <= set(ids)
    finally:
        tagged.kill()

    sbx.commands.run("head -c 20000000 /dev/zero > /tmp/fill")
    metrics = sbx.get_metrics()
    assert len(metrics) >= 1
    assert metrics[0].mem_used > 0
    assert metrics[0].mem_total == 1 << 30 or metrics[0].mem_total > 0
    assert metrics[0].cpu_count >= 1


def test_snapshots_become_templates(sbx):
    sbx.files.write("/work/state.txt", "kept")
    snap = sbx.create_snapshot()
    child = Sandbox.create(template=snap.snapshot_id, timeout=120)
    try:
        assert child.files.read("/work/state.txt") == "kept"
    finally:
        child.kill()


@pytest.fixture
def upstreams():
    """Two HTTP servers on loopback addresses of their own, each answering
    with its address: the internet, as far as the network tests go."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Hello(BaseHTTPRequestHandler):
        def do_GET(self):
            body = f"hello from {self.server.server_address[0]}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_):
            pass

    servers = [ThreadingHTTPServer((ip, 0), Hello) for ip in ("127.0.0.7", "127.0.0.8")]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield [server.server_address for server in servers]
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def test_network_allow_and_deny_out_with_live_updates(upstreams):
    (a, port_a), (b, port_b) = upstreams

    def fetch(sbx, ip, port):
        # busybox wget goes through the proxy named in http_proxy (its -T
        # with a proxy crashes busybox 1.35, so none is given).
        return sbx.commands.run(f"wget -q -O - http://{ip}:{port}/").stdout

    sbx = Sandbox.create(network={"deny_out": ["0.0.0.0/0"], "allow_out": [a]}, timeout=120)
    try:
        assert fetch(sbx, a, port_a) == f"hello from {a}"
        with pytest.raises(CommandExitException):
            fetch(sbx, b, port_b)
        # A live update replaces the rules: b now, not a.
        sbx.update_network({"deny_out": ["0.0.0.0/0"], "allow_out": [b]})
        assert fetch(sbx, b, port_b) == f"hello from {b}"
        with pytest.raises(CommandExitException):
            fetch(sbx, a, port_a)
        # No internet at all.
        sbx.update_network({"allow_internet_access": False})
        with pytest.raises(CommandExitException):
            fetch(sbx, b, port_b)
        # Opening a sandbox that was made closed is not something runbox
        # does live: a clear 400, nothing changed.
        with pytest.raises(SandboxException) as opening:
            sbx.update_network({})
        assert "400" in str(opening.value)
    finally:
        sbx.kill()
    # What runbox cannot enforce is refused, never widened.
    with pytest.raises(SandboxException) as partial:
        Sandbox.create(network={"deny_out": ["8.8.8.8"]})
    assert "400" in str(partial.value) and "0.0.0.0/0" in str(partial.value)
    with pytest.raises(SandboxException) as unreachable:
        Sandbox.create(
            network={
                "deny_out": ["0.0.0.0/0"],
                "rules": {"api.example.com": [{"transform": {"headers": {"X-Key": "v"}}}]},
            }
        )
    assert "not in allowOut" in str(unreachable.value)


def test_egress_proxy_tunnels_the_sandbox_through_socks5(upstreams, tmp_path):
    import socket
    import subprocess

    (a, port_a), _ = upstreams
    with socket.socket() as probe:
        probe.bind(("127.0.0.9", 0))
        socks_port = probe.getsockname()[1]
    log = tmp_path / "microsocks.log"
    with open(log, "wb") as out:
        socks = subprocess.Popen(
            ["microsocks", "-i", "127.0.0.9", "-p", str(socks_port), "-u", "e2b-user", "-P", "e2b-pass-5d"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.9", socks_port)) == 0:
                    break
            time.sleep(0.05)
        proxy = {"address": f"127.0.0.9:{socks_port}", "username": "e2b-user", "password": "e2b-pass-5d"}
        fetch = f"wget -q -O - http://{a}:{port_a}/"
        sbx = Sandbox.create(
            network={"deny_out": ["0.0.0.0/0"], "allow_out": [a], "egress_proxy": proxy}, timeout=120
        )
        try:
            assert sbx.commands.run(fetch).stdout == f"hello from {a}"
            assert f"connected to {a}:{port_a}" in log.read_text()
            # An update replaces the whole setting: without the proxy the
            # sandbox goes out directly.
            seen = log.read_text().count("connected to")
            sbx.update_network({"deny_out": ["0.0.0.0/0"], "allow_out": [a]})
            assert sbx.commands.run(fetch).stdout == f"hello from {a}"
            assert log.read_text().count("connected to") == seen
            # Wrong credentials fail closed.
            wrong = {**proxy, "password": "not-it"}
            sbx.update_network({"deny_out": ["0.0.0.0/0"], "allow_out": [a], "egress_proxy": wrong})
            with pytest.raises(CommandExitException):
                sbx.commands.run(fetch)
        finally:
            sbx.kill()
        # A proxy the operator does not admit, or one for an open sandbox.
        with pytest.raises(SandboxException) as refused:
            Sandbox.create(
                network={"deny_out": ["0.0.0.0/0"], "allow_out": [a], "egress_proxy": {"address": "10.9.9.9:1080"}}
            )
        assert "400" in str(refused.value) and "10.9.9.9:1080" in str(refused.value)
        with pytest.raises(SandboxException) as open_:
            Sandbox.create(network={"egress_proxy": proxy})
        assert "400" in str(open_.value) and "e2b-pass-5d" not in str(open_.value)
    finally:
        socks.kill()
        socks.wait()


def test_unsupported_calls_answer_what_the_docs_say(sbx):
    with pytest.raises(SandboxException) as net:
        Sandbox.create(template="base", network={"mask_request_host": "example.com"})
    assert "501" in str(net.value)
    with pytest.raises(NotFoundException):
        Sandbox.connect("01ARZ3NDEKTSV4RRFFQ69G5FAV")


def test_keys_and_access_tokens_are_checked(daemon, sbx):
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="e2b_" + "0" * 40)
    other = Sandbox.create(timeout=120)
    try:
        # One sandbox's access token does not open another.
        token = sbx._envd_access_token
        r = httpx.get(
            f"{daemon.url}/health",
            headers={"E2b-Sandbox-Id": other.sandbox_id, "X-Access-Token": token},
        )
        assert r.status_code == 401
        r = httpx.get(
            f"{daemon.url}/health",
            headers={"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": token},
        )
        assert r.status_code == 204
    finally:
        other.kill()


def test_a_warm_pool_serves_sdk_creates(daemon):
    auth = {"Authorization": f"Bearer {daemon.token}"}
    pools = {"pools": [{"image": "base", "size": "small", "warm": 1, "warmMax": 2}]}
    r = httpx.put(f"{daemon.url}/v1/pools", json=pools, headers=auth)
    assert r.status_code == 200, r.text
    try:
        deadline = time.monotonic() + 60
        while httpx.get(f"{daemon.url}/v1/pools", headers=auth).json()["pools"][0]["ready"] < 1:
            assert time.monotonic() < deadline, "the pool never filled"
            time.sleep(0.2)
        sbx = Sandbox.create(timeout=120, envs={"FROM": "pool"})
        try:
            run = httpx.get(f"{daemon.url}/v1/runs/{sbx.sandbox_id}", headers=auth).json()
            assert run["pooled"] is True
            assert sbx.commands.run("echo $FROM").stdout == "pool\n"
            assert sbx.sandbox_id in [s.sandbox_id for s in Sandbox.list().next_items()]
        finally:
            sbx.kill()
    finally:
        httpx.put(f"{daemon.url}/v1/pools", json={"pools": []}, headers=auth)



def test_forks_start_from_the_sandboxs_files(sbx):
    sbx.files.write("/work/fork-me.txt", "shared")
    forks = sbx.fork(timeout=120, count=2)
    try:
        assert len(forks) == 2
        assert len({f.sandbox_id for f in forks} | {sbx.sandbox_id}) == 3
        for child in forks:
            assert not isinstance(child, Exception), child
            assert child.files.read("/work/fork-me.txt") == "shared"
        # They are copies: a change in one is not in the source.
        forks[0].files.write("/work/fork-me.txt", "changed")
        assert sbx.files.read("/work/fork-me.txt") == "shared"
    finally:
        for child in forks:
            if not isinstance(child, Exception):
                child.kill()
