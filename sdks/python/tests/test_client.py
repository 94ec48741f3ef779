"""The synchronous client against a live daemon."""

from __future__ import annotations

import time

import pytest

import runbox
from runbox import Exit, Runbox, Started, Stderr, Stdout


def test_health_and_a_run_lifecycle(rb: Runbox):
    assert rb.health()["status"] == "ok"
    run = rb.create_run("base", env={"GREETING": "hi"}, ttl=600, labels={"team": "sdk"})
    try:
        assert run.status == "running"
        assert run.labels == {"team": "sdk"}
        assert run.limits.memory_mb > 0
        assert any(r.id == run.id for r in rb.list_runs())
        # A label selector: exactly the runs it names.
        assert [r.id for r in rb.list_runs(labels={"team": "sdk"})] == [run.id]
        assert [r.id for r in rb.list_runs(labels=["team"])] == [run.id]
        assert rb.list_runs(labels={"team": "other"}) == []
        assert rb.list_runs(labels={"team": None, "job": None}) == []
        vol = rb.create_volume("sdk-labelled", size_mb=16, labels={"team": "sdk"})
        try:
            assert vol["labels"] == {"team": "sdk"}
            assert [v["name"] for v in rb.list_volumes(labels={"team": "sdk"})] == ["sdk-labelled"]
            assert rb.list_volumes(labels=["nope"]) == []
        finally:
            rb.delete_volume("sdk-labelled")
        assert rb.get_run(run.id).image == "base"
        renewed = rb.renew_run(run.id, 1200)
        assert renewed.expires_at > run.expires_at
        assert rb.pause_run(run.id).status == "paused"
        assert rb.get_run(run.id).status == "paused"
        assert rb.resume_run(run.id).status == "running"
        rb.pause_run(run.id)
        result = rb.run(run.id, "echo $GREETING; echo oops >&2; exit 3")
        assert (result.stdout, result.stderr, result.exit_code) == (b"hi\n", b"oops\n", 3)
        assert result.exit.reason == "exited"
        # Hibernated: files kept, the next call (or a wake) boots it again.
        rb.write_file(run.id, "kept.txt", b"kept")
        assert rb.hibernate_run(run.id).status == "hibernated"
        assert rb.get_run(run.id).status == "hibernated"
        assert rb.read_file(run.id, "kept.txt") == b"kept"
        rb.hibernate_run(run.id)
        assert rb.wake_run(run.id).status == "running"
        assert run.restarts == 0 and run.on_expire == "delete"
    finally:
        rb.delete_run(run.id)
    sleepy = rb.create_run("base", on_expire="hibernate", idle_hibernate_after=600, auto_resume=False)
    try:
        assert (sleepy.on_expire, sleepy.auto_resume) == ("hibernate", False)
        assert sleepy.idle == {"hibernateAfterSec": 600}
        rb.hibernate_run(sleepy.id)
        with pytest.raises(runbox.RunboxError) as e:
            rb.run(sleepy.id, "true")
        assert e.value.code == "run_paused"
    finally:
        rb.delete_run(sleepy.id)
    # setuid programs work in a run that allows it (the daemon's runs have
    # user namespaces by default); every other run's commands have
    # no_new_privs.
    assert not run.allow_privilege_escalation
    loose = rb.create_run("base", allow_privilege_escalation=True)
    try:
        assert loose.allow_privilege_escalation
        assert rb.run(loose.id, "grep NoNewPrivs /proc/self/status").stdout == b"NoNewPrivs:\t0\n"
    finally:
        rb.delete_run(loose.id)
    with pytest.raises(runbox.NotFound) as e:
        rb.get_run(run.id)
    assert e.value.code == "run_not_found" and e.value.status == 404


def test_volumes_outlive_their_runs(rb: Runbox):
    made = rb.create_volume("pydata", size_mb=32)
    assert (made["name"], made["sizeMb"], made["holders"]) == ("pydata", 32, [])
    try:
        writer = rb.create_run("base", volumes=[{"name": "pydata"}])
        assert writer.volumes == [{"name": "pydata", "path": "/volumes/pydata", "mode": "rw"}]
        rb.run(writer.id, "echo kept > /volumes/pydata/f")
        with pytest.raises(runbox.RunboxError) as e:
            rb.create_run("base", volumes=[{"name": "pydata", "mode": "ro"}])
        assert (e.value.code, e.value.status) == ("volume_busy", 409)
        rb.delete_run(writer.id)
        reader = rb.create_run("base", volumes=[{"name": "pydata", "path": "/data", "mode": "ro"}])
        try:
            assert rb.run(reader.id, "cat /data/f").stdout == b"kept\n"
            assert [h["mode"] for h in rb.get_volume("pydata")["holders"]] == ["ro"]
            assert [v["name"] for v in rb.list_volumes()] == ["pydata"]
            copy = rb.clone_volume("pydata", "pycopy")
            assert (copy["name"], copy["sizeMb"]) == ("pycopy", 32)
            rb.delete_volume("pycopy")
        finally:
            rb.delete_run(reader.id)
    finally:
        rb.delete_volume("pydata")
    with pytest.raises(runbox.NotFound) as e:
        rb.get_volume("pydata")
    assert e.value.code == "volume_not_found"


def test_secrets_a_caller_brings_stay_out_of_the_run(rb: Runbox):
    secret = {
        "name": "VENDOR_KEY",
        "value": "py-v4lue-7",
        "hosts": ["api.vendor.example"],
        "header": "Authorization",
        "scheme": "Bearer",
        "methods": ["GET"],
        "path_prefixes": ["/v1/"],
    }
    run = rb.create_run("base", network="allowlist", secrets=[secret])
    try:
        assert run.secrets == ["VENDOR_KEY"]
        assert rb.run(run.id, 'printf %s "$VENDOR_KEY"').stdout == b"runbox-secret:VENDOR_KEY"
        rule = {"host": "db.example.com", "ports": [5432], "methods": ["GET"]}
        changed = rb.update_egress(run.id, egress_allow=["pypi.org", rule], secrets=[])
        assert (changed.egress_allow, changed.secrets) == (["pypi.org", rule], [])
        assert not changed.socks5
        door = rb.update_egress(run.id, socks5=True)
        assert door.socks5 and door.egress_allow == ["pypi.org", rule]
        env = rb.run(run.id, 'printf %s "$ALL_PROXY"').stdout
        assert env == b"socks5h://127.0.0.1:1080"
        closed = rb.update_egress(run.id, network="none")
        assert (closed.network, closed.egress_allow) == ("none", [])
    finally:
        rb.delete_run(run.id)
    with pytest.raises(runbox.RunboxError) as e:
        rb.create_run("base", network="allowlist", secrets=[{**secret, "header": "Host"}])
    assert e.value.code == "bad_secret" and "py-v4lue-7" not in str(e.value)
    # This server admits no upstream proxy: refused, the password not echoed.
    with pytest.raises(runbox.RunboxError) as e:
        rb.create_run("base", network="allowlist", upstream="socks5://u:pw-77@10.9.9.9:1080")
    assert e.value.code == "bad_egress" and "pw-77" not in str(e.value)


def test_volume_files_without_a_run(rb: Runbox):
    rb.create_volume("pyfiles", size_mb=16)
    try:
        put = rb.write_volume_file("pyfiles", "/seed/a.txt", "hello", mode=0o640, owner=(1000, 1000))
        assert (put.path, put.size, put.mode, put.uid) == ("/seed/a.txt", 5, 0o640, 1000)
        assert rb.read_volume_file("pyfiles", "seed/a.txt") == b"hello"
        assert rb.volume_make_dir("pyfiles", "out").path == "/out"
        assert [e.path for e in rb.volume_list("pyfiles", "/", depth=2)] == ["/out", "/seed", "/seed/a.txt"]
        with pytest.raises(runbox.RunboxError) as e:
            rb.write_volume_file("pyfiles", "seed/a.txt", "again", overwrite=False)
        assert e.value.code == "file_exists"
        run = rb.create_run("base", volumes=[{"name": "pyfiles"}])
        try:
            rb.run(run.id, "echo result > /volumes/pyfiles/out/r")
            assert rb.read_volume_file("pyfiles", "out/r") == b"result\n"
            with pytest.raises(runbox.RunboxError) as e:
                rb.write_volume_file("pyfiles", "late", "x")
            assert (e.value.code, e.value.status) == ("volume_busy", 409)
        finally:
            rb.delete_run(run.id)
        assert rb.volume_move("pyfiles", "out/r", "r").path == "/r"
        assert rb.volume_stat("pyfiles", "r").size == 7
        assert rb.volume_remove("pyfiles", "seed", recursive=True) == 2
    finally:
        rb.delete_volume("pyfiles")


def test_exec_streams_events_in_order(rb: Runbox, run_id: str):
    events = list(rb.exec(run_id, ["sh", "-c", "echo a; echo b >&2"]))
    assert isinstance(events[0], Started) and isinstance(events[-1], Exit)
    assert b"".join(e.data for e in events if isinstance(e, Stdout)) == b"a\n"
    assert b"".join(e.data for e in events if isinstance(e, Stderr)) == b"b\n"
    # stdin as text, a terminal, a timeout, a user.
    assert rb.run(run_id, ["cat"], stdin="piped").stdout == b"piped"
    assert b"10 40" in rb.run(run_id, "stty size", pty=(10, 40)).stdout
    timed = rb.run(run_id, "sleep 30", timeout=1)
    assert timed.exit.timed_out and timed.exit.reason == "timeout"
    assert rb.run(run_id, "id -u", user="nobody").text.strip() == "65534"


def test_errors_carry_the_stable_code(rb: Runbox, run_id: str):
    with pytest.raises(runbox.BadRequest) as e:
        rb.run(run_id, ["no-such-command"])
    assert e.value.code == "command_not_found"
    with pytest.raises(runbox.BadRequest) as e:
        rb.create_run("base", ttl=0)
    assert e.value.code == "bad_ttl"
    with pytest.raises(runbox.NotFound) as e:
        rb.create_run("no-such-image")
    assert e.value.code == "image_not_found"
    with pytest.raises(runbox.BadRequest) as e:
        rb.stat(run_id, "../etc")
    assert e.value.code == "bad_path"
    rb.run(run_id, "ln -sf /etc /work/etc-link")
    with pytest.raises(runbox.Forbidden) as e:
        rb.read_file(run_id, "etc-link/passwd")
    assert e.value.code == "path_escape"
    with pytest.raises(ValueError):
        rb.get_run("..")
    # A node alone has nowhere to move a run to, and says so.
    with pytest.raises(runbox.RunboxError) as e:
        rb.move_run(run_id)
    assert (e.value.code, e.value.status) == ("not_movable", 409)
    assert "not part of a fleet" in str(e.value)
    rb.create_volume("stays")
    with pytest.raises(runbox.RunboxError) as e:
        rb.move_volume("stays", "n2")
    assert (e.value.code, e.value.status) == ("not_movable", 409)
    rb.delete_volume("stays")
    bad = Runbox(rb.url, "wrong-token")
    with pytest.raises(runbox.Unauthorized):
        bad.list_runs()
    bad.close()


def test_files_and_fs_operations(rb: Runbox, run_id: str):
    rb.write_file(run_id, "src/hello.txt", "hello\n")
    assert rb.read_file(run_id, "src/hello.txt") == b"hello\n"
    binary = bytes(range(256)) * 1000
    rb.write_file(run_id, "/work/blob.bin", binary)
    assert rb.read_file(run_id, "blob.bin") == binary
    info = rb.stat(run_id, "src/hello.txt")
    assert (info.kind, info.size) == ("file", 6)
    rb.make_dir(run_id, "a/b/c")
    rb.move(run_id, "src/hello.txt", "a/b/hello.txt")
    names = [e.path for e in rb.list_dir(run_id, "a", depth=3)]
    assert names == ["a/b", "a/b/c", "a/b/hello.txt"]
    assert rb.remove(run_id, "a", recursive=True) == 4
    with pytest.raises(runbox.NotFound) as e:
        rb.read_file(run_id, "a/b/hello.txt")
    assert e.value.code == "file_not_found"


def test_watch_sees_a_write(rb: Runbox, run_id: str):
    events = rb.watch(run_id)
    first = next(events)
    assert first["kind"] == "ready"
    rb.write_file(run_id, "watched.txt", "x")
    seen = []
    for event in events:
        seen.append(event)
        # Uploads land by rename, so the name shows up as a rename's target.
        if event["kind"] in ("written", "created", "renamed") and event["path"].endswith("watched.txt"):
            break
    events.close()
    assert seen


def test_background_processes(rb: Runbox, run_id: str):
    proc = rb.start_process(run_id, "echo up; read x; echo got=$x; exit 4", tag="job", open_stdin=True)
    assert proc.running and proc.tag == "job" and proc.background
    assert any(p.pid == proc.pid for p in rb.processes(run_id))
    rb.send_stdin(run_id, "job", "hi\n")
    done = rb.wait_process(run_id, "job", timeout=20)
    assert not done.running and done.exit.exit_code == 4
    output = list(rb.process_output(run_id, proc.pid))
    text = b"".join(e.data for e in output if isinstance(e, Stdout))
    assert text == b"up\ngot=hi\n"
    assert output[-1].exit_code == 4
    sleeper = rb.start_process(run_id, ["sleep", "30"])
    rb.signal_process(run_id, sleeper.pid, "KILL")
    ended = rb.wait_process(run_id, sleeper.pid, timeout=20)
    assert ended.exit.signal == 9
    with pytest.raises(runbox.Conflict) as e:
        rb.signal_process(run_id, sleeper.pid, "TERM")
    assert e.value.code == "process_ended"
    with pytest.raises(runbox.BadRequest) as e:
        rb.signal_process(run_id, "job", "NOPE")
    assert e.value.code == "bad_signal"


def test_a_terminal_session(rb: Runbox, run_id: str):
    with rb.session(run_id, "stty size; read line; echo got=$line; exit 5", pty=(12, 34)) as s:
        assert s.pid > 1
        s.send("typed\r")
        result = s.wait()
    assert b"12 34" in result.stdout and b"got=typed" in result.stdout
    assert result.exit_code == 5
    # stdin streamed to cat, then closed.
    with rb.session(run_id, ["cat"]) as s:
        s.send(b"one ")
        s.send("two")
        s.eof()
        assert s.wait().stdout == b"one two"


def test_attach_to_a_background_process(rb: Runbox, run_id: str):
    rb.start_process(run_id, "echo first; while read l; do echo echo:$l; done", tag="echo", open_stdin=True)
    with rb.attach(run_id, "echo") as s:
        s.send("ping\n")
        seen = b""
        for event in s.events():
            if isinstance(event, Stdout):
                seen += event.data
            if b"echo:ping" in seen:
                break
    assert seen.startswith(b"first\n")
    # Detaching left it running.
    assert rb.process(run_id, "echo").running
    rb.signal_process(run_id, "echo", "TERM")


def test_leases_fence_writes(rb: Runbox, run_id: str):
    lease = rb.acquire_lease(run_id, "alice", ttl=60)
    assert lease.holder == "alice" and lease.generation >= 1
    with pytest.raises(runbox.Conflict) as e:
        rb.run(run_id, "true")
    assert e.value.code == "leased"
    held = (lease.holder, lease.generation)
    assert rb.run(run_id, "echo ok", lease=held).stdout == b"ok\n"
    rb.write_file(run_id, "leased.txt", "x", lease=held)
    rb.release_lease(run_id, "alice", lease.generation)
    assert rb.run(run_id, "cat /work/leased.txt").stdout == b"x"
    # Released, the run still says which generation was issued last.
    after = rb.get_run(run_id)
    assert after.lease is None and after.lease_generation == lease.generation


def test_checkpoints(rb: Runbox, run_id: str):
    rb.run(run_id, "echo kept > /work/ck.txt")
    ck = rb.checkpoint(run_id, labels={"sdk": "python"})
    assert ck["run"] == run_id and ck["labels"] == {"sdk": "python"}
    assert any(c["id"] == ck["id"] for c in rb.list_checkpoints())
    assert rb.get_checkpoint(ck["id"])["storedBytes"] > 0
    child = rb.create_run(checkpoint=ck["id"])
    try:
        assert rb.run(child.id, "cat /work/ck.txt").stdout == b"kept\n"
    finally:
        rb.delete_run(child.id)
    rb.delete_checkpoint(ck["id"])
    archived = rb.archive_run(run_id)
    assert archived.status == "archived"
    assert rb.run(run_id, "cat /work/ck.txt").stdout == b"kept\n"
    assert rb.get_run(run_id).status == "running"
    with pytest.raises(runbox.NotFound) as e:
        rb.get_checkpoint(ck["id"])
    assert e.value.code == "checkpoint_not_found"


def test_snapshots_forks_and_previews(rb: Runbox, run_id: str, daemon):
    rb.run(run_id, "echo state > /work/state.txt")
    snap = rb.snapshot(run_id, name=f"py-snap-{int(time.time())}")
    image = snap["image"]
    assert any(i.name == image for i in rb.list_images())
    child = rb.create_run(image)
    try:
        assert rb.run(child.id, "cat /work/state.txt").stdout == b"state\n"
    finally:
        rb.delete_run(child.id)
    forks = rb.fork(run_id, count=2)
    try:
        assert len(forks) == 2
        assert rb.run(forks[0].id, "cat /work/state.txt").stdout == b"state\n"
    finally:
        for f in forks:
            rb.delete_run(f.id)
    rb.delete_image(image)
    rb.start_process(run_id, "mkdir -p /work/www && echo page > /work/www/index.html && exec httpd -f -p 8080 -h /work/www")
    preview = rb.mint_preview(run_id, 8080, ttl=60)
    assert "/p/" in preview.url and preview.port == 8080
    import httpx

    for _ in range(100):
        try:
            response = httpx.get(preview.url)
            if response.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    assert response.text == "page\n"


def test_tenants_tokens_and_usage(rb: Runbox, daemon):
    name = f"py{int(time.time() * 1000) % 100000000}"
    made = rb.create_tenant(name, max_runs=1, networks=["none"])
    assert made["tenant"]["name"] == name and len(made["token"]) == 64
    assert any(t["name"] == name for t in rb.list_tenants())
    with Runbox(daemon.url, made["token"]) as tenant:
        run = tenant.create_run("base", ttl=300)
        try:
            assert run.tenant == name and run.token.startswith("run_")
            # The run token drives its run, nothing else.
            with Runbox(daemon.url, run.token) as driver:
                assert driver.run(run.id, "echo hi").stdout == b"hi\n"
                with pytest.raises(runbox.RunboxError) as e:
                    driver.list_runs()
                assert e.value.code == "forbidden"
            with pytest.raises(runbox.RunboxError) as e:
                tenant.create_run("base", ttl=300)
            assert e.value.code == "tenant_quota"
            with pytest.raises(runbox.RunboxError) as e:
                tenant.info()
            assert e.value.code == "forbidden"
            assert [r.id for r in tenant.list_runs()] == [run.id]
            report = tenant.usage(since="1h")
            assert list(report["tenants"]) == [name]
            assert report["tenants"][name]["events"]["create"] == 1
        finally:
            tenant.delete_run(run.id)
    assert rb.update_tenant(name, max_runs=3)["maxRuns"] == 3
    rotated = rb.rotate_tenant(name)
    assert rotated["token"] != made["token"]
    rb.delete_tenant(name)
    with pytest.raises(runbox.NotFound):
        rb.get_tenant(name)


def test_an_image_is_built_from_a_dockerfile_and_a_directory(rb: Runbox, tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM base\nCOPY app/ /app/\nRUN cat /app/hello.txt > /app/copied\n")
    (tmp_path / ".dockerignore").write_text("app/skip.txt\n")
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "hello.txt").write_text("hello from the context\n")
    (tmp_path / "app" / "skip.txt").write_text("left out\n")
    lines = []
    build = rb.build_image(
        "sdk-built",
        (tmp_path / "Dockerfile").read_text(),
        context=tmp_path,
        on_log=lambda line: lines.append(line["text"]),
        labels={"team": "sdk"},
    )
    try:
        assert build["status"] == "ready"
        assert [s["status"] for s in build["steps"]] == ["done", "done"]
        assert any("RUN cat" in text for text in lines), lines
        assert rb.get_build(build["id"])["status"] == "ready"
        assert build["id"] in [b["id"] for b in rb.list_builds()]
        run = rb.create_run("sdk-built")
        try:
            out = rb.run(run.id, "cat /app/copied; ls /app")
            assert out.stdout == b"hello from the context\ncopied\nhello.txt\n"
        finally:
            rb.delete_run(run.id)
        # A failing step: BuildFailed with the step, its code and output.
        with pytest.raises(runbox.BuildFailed) as failed:
            rb.build_image("sdk-broken", "FROM base\nRUN echo nope >&2; exit 4\n")
        error = failed.value.build["error"]
        assert (failed.value.code, error["step"], error["exitCode"], error["output"]) == (
            "step_failed",
            1,
            4,
            ["nope"],
        )
        # A step list instead of a Dockerfile; bad input is a BadRequest.
        listed = rb.build_image(
            "sdk-steps",
            steps=[{"type": "ENV", "args": ["A", "1"]}, {"type": "RUN", "args": ["echo $A > /a"]}],
            from_image="base",
        )
        assert listed["status"] == "ready"
        with pytest.raises(runbox.BadRequest) as bad:
            rb.build_image("sdk-bad", "FROM base\nNOPE x\n")
        assert bad.value.code == "bad_dockerfile"
    finally:
        for name in ("sdk-built", "sdk-steps"):
            rb.delete_image(name)


def test_history_diff_rollback_and_points_forked(rb: Runbox):
    run = rb.create_run("base", history=10)
    try:
        assert run.history == {"keep": 10}
        # A command that changes a file leaves a point, named by its exit.
        wrote = rb.run(run.id, "mkdir /work/app && echo one > /work/app/a.txt")
        assert wrote.exit_code == 0 and wrote.point is not None
        assert wrote.exit.point == wrote.point
        # One that only reads leaves none.
        read = rb.run(run.id, "cat /work/app/a.txt")
        assert (read.stdout, read.point) == (b"one\n", None)
        kept = rb.history(run.id)
        assert (kept.keep, kept.head) == (10, wrote.point)
        assert [p.cause.kind for p in kept.points] == ["exec", "create"]
        newest, created = kept.points
        assert newest.id == wrote.point and newest.parent == created.id
        assert newest.cause.argv == ["sh", "-c", "mkdir /work/app && echo one > /work/app/a.txt"]
        assert newest.cause.exit_code == 0
        assert (newest.changes.added, newest.changes.removed) == (2, 0)
        # The newest point's diff, by default against its parent.
        diff = rb.diff(run.id)
        assert (diff.point, diff.against, diff.truncated) == (wrote.point, created.id, False)
        assert [(c.path, c.change) for c in diff.changes] == [
            ("/work/app", "added"),
            ("/work/app/a.txt", "added"),
        ]
        a = diff.changes[1]
        assert a.before is None and (a.after.kind, a.after.size) == ("file", 4)
        assert a.patch is None and diff.summary.added == 2
        patched = rb.diff(run.id, wrote.point, patch=True)
        assert "+one" in patched.changes[1].patch
        assert len(rb.diff(run.id, wrote.point, limit=1).changes) == 1
        # A file call leaves a point too.
        rb.write_file(run.id, "app/a.txt", "two\n")
        changed = rb.history(run.id).points[0]
        assert (changed.cause.kind, changed.cause.op, changed.cause.path) == ("file", "write", "/work/app/a.txt")
        assert changed.parent == wrote.point
        # Back to before everything: the files go.
        back = rb.rollback(run.id, created.id)
        assert back.id == run.id and back.status == "running"
        gone = rb.run(run.id, "cat /work/app/a.txt")
        assert gone.exit_code != 0 and gone.point is None
        assert rb.run(run.id, "ls /work").stdout == b""
        assert rb.history(run.id).head == created.id
        # And forward again: the later points stayed.
        rb.rollback(run.id, wrote.point)
        assert rb.run(run.id, "cat /work/app/a.txt").stdout == b"one\n"
        assert rb.diff(run.id, changed.id, against=created.id).summary.added == 2
        # A fork and a snapshot of a point: the files as they were then.
        rb.run(run.id, "echo three > /work/app/a.txt")
        forks = rb.fork(run.id, point=wrote.point)
        try:
            assert len(forks) == 1
            assert rb.run(forks[0].id, "cat /work/app/a.txt").stdout == b"one\n"
        finally:
            for f in forks:
                rb.delete_run(f.id)
        snap = rb.snapshot(run.id, name=f"py-point-{int(time.time())}", point=created.id)
        try:
            child = rb.create_run(snap["image"])
            try:
                assert rb.run(child.id, "ls /work").stdout == b""
            finally:
                rb.delete_run(child.id)
        finally:
            rb.delete_image(snap["image"])
        assert rb.run(run.id, "cat /work/app/a.txt").stdout == b"three\n"
        # A point the run does not have.
        for call in (
            lambda: rb.diff(run.id, "01ARZ3NDEKTSV4RRFFQ69G5FAV"),
            lambda: rb.rollback(run.id, "01ARZ3NDEKTSV4RRFFQ69G5FAV"),
            lambda: rb.fork(run.id, point="01ARZ3NDEKTSV4RRFFQ69G5FAV"),
        ):
            with pytest.raises(runbox.NotFound) as e:
                call()
            assert (e.value.code, e.value.status) == ("point_not_found", 404)
    finally:
        rb.delete_run(run.id)


def test_history_refusals(rb: Runbox, run_id: str):
    # A run without history has no points to list, diff or return to.
    assert rb.get_run(run_id).history is None
    rb.run(run_id, "echo x > /work/x")
    for call in (lambda: rb.history(run_id), lambda: rb.diff(run_id)):
        with pytest.raises(runbox.NotFound) as e:
            call()
        assert e.value.code == "point_not_found"
    # More points than the server keeps.
    with pytest.raises(runbox.BadRequest) as e:
        rb.create_run("base", history=1_000_000)
    assert e.value.code == "bad_history"
    # A run with history but no change yet: no newest point to diff.
    fresh = rb.create_run("base", history=3)
    try:
        assert rb.history(fresh.id).points == []
        with pytest.raises(runbox.NotFound) as e:
            rb.diff(fresh.id)
        assert e.value.code == "point_not_found"
    finally:
        rb.delete_run(fresh.id)
