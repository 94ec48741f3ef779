"""What E2B's own SDK suite checks of the behaviours runbox claims, held
here through the released SDK (scripts/e2b-conformance runs the suite
itself; docs/e2b.md has its counts)."""

from __future__ import annotations

import os
import time

import pytest
from e2b import FileType, Sandbox, SandboxQuery, SandboxState
from e2b.exceptions import AuthenticationException


def test_a_key_of_e2bs_shape_is_the_token(daemon):
    # SDK releases that check a key's shape accept e2b_<hex>; runbox takes
    # e2b_<token> as its token.
    sbx = Sandbox.create(api_key=f"e2b_{daemon.token}", timeout=60)
    try:
        assert sbx.commands.run("echo ok").stdout == "ok\n"
    finally:
        assert Sandbox.kill(sbx.sandbox_id, api_key=f"e2b_{daemon.token}")
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="e2b_" + "0" * 64)


def test_relative_paths_and_commands_start_at_the_users_home(sbx):
    # base's user is root, whose home is /root; the image sets no WorkingDir.
    assert sbx.commands.run("pwd").stdout == "/root\n"
    sbx.commands.run("echo made > made.txt")
    assert sbx.files.read("made.txt") == "made\n"
    assert sbx.files.read("~/made.txt") == "made\n"
    info = sbx.files.write("rel/a.txt", "r")
    assert info.path == "/root/rel/a.txt"
    assert sbx.commands.run("cat a.txt", cwd="rel").stdout == "r"
    assert sbx.commands.run("pwd", cwd="rel").stdout == "/root/rel\n"
    assert sbx.files.get_info("rel").path == "/root/rel"
    assert [e.path for e in sbx.files.list("rel")] == ["/root/rel/a.txt"]
    assert sbx.files.rename("rel/a.txt", "rel/b.txt").path == "/root/rel/b.txt"


def add_alice(sbx):
    # busybox-static has no adduser: the files it would write.
    sbx.commands.run(
        "echo alice:x:1000:1000::/home/alice:/bin/sh >> /etc/passwd"
        " && echo alice:x:1000: >> /etc/group"
        " && mkdir -p /home/alice && chown 1000:1000 /home/alice"
    )


def test_what_a_user_makes_is_theirs(sbx):
    add_alice(sbx)
    assert sbx.commands.run("pwd", user="alice").stdout == "/home/alice\n"
    info = sbx.files.write("notes/a.txt", "hi", user="alice")
    assert info.path == "/home/alice/notes/a.txt"
    for path in ("notes", "notes/a.txt"):
        entry = sbx.files.get_info(path, user="alice")
        assert (entry.owner, entry.group) == ("alice", "alice"), path
    assert sbx.files.make_dir("made/deep", user="alice") is True
    for path in ("/home/alice/made", "/home/alice/made/deep"):
        assert sbx.files.get_info(path).owner == "alice", path
    # So the user's own commands can write in them.
    sbx.commands.run("touch made/deep/x notes/y", user="alice")
    # Root's are root's, named as the sandbox names them.
    sbx.files.make_dir("/srv/data")
    entry = sbx.files.get_info("/srv/data")
    assert (entry.owner, entry.group) == ("root", "root")
    # A user the sandbox does not have is refused, not guessed.
    with pytest.raises(Exception):
        sbx.files.write("x.txt", "x", user="nobody-here")


def test_removing_what_is_not_there_is_done(sbx):
    sbx.files.remove("/tmp/never-was")
    sbx.files.remove("never/was/either")


def test_a_symlink_reads_as_what_it_points_at(sbx):
    sbx.files.write("/tmp/links/target.txt", "hello")
    sbx.commands.run("ln -s target.txt link; ln -s /nowhere dangling", cwd="/tmp/links")
    link = sbx.files.get_info("/tmp/links/link")
    assert link.type == FileType.FILE
    assert link.size == 5
    assert link.symlink_target == "/tmp/links/target.txt"
    dangling = sbx.files.get_info("/tmp/links/dangling")
    assert dangling.symlink_target == "/nowhere"
    listed = {e.name: e for e in sbx.files.list("/tmp/links")}
    assert listed["link"].symlink_target == "/tmp/links/target.txt"


def test_an_upload_is_seen_as_envd_makes_files(sbx):
    sbx.files.make_dir("/tmp/seen")
    watcher = sbx.files.watch_dir("/tmp/seen")
    try:
        sbx.files.write("/tmp/seen/new.txt", "x")
        seen = []
        deadline = time.monotonic() + 10
        while len(seen) < 3 and time.monotonic() < deadline:
            seen += [(e.name, e.type.value) for e in watcher.get_new_events()]
            time.sleep(0.05)
        assert seen == [("new.txt", "create"), ("new.txt", "chmod"), ("new.txt", "write")]
    finally:
        watcher.stop()


def test_listing_is_newest_first_and_filters_apply(daemon):
    from datetime import timedelta


    tag = {"suite": f"order-{time.monotonic_ns()}"}
    first = Sandbox.create(timeout=120, metadata=tag)
    second = Sandbox.create(timeout=120, metadata=tag)
    try:
        ids = [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(metadata=tag)).next_items()]
        assert ids == [second.sandbox_id, first.sandbox_id]
        ids = [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(metadata=tag), order="asc").next_items()]
        assert ids == [first.sandbox_id, second.sandbox_id]
        # Pages follow the same order.
        pager = Sandbox.list(query=SandboxQuery(metadata=tag), limit=1)
        assert [s.sandbox_id for s in pager.next_items()] == [second.sandbox_id]
        assert [s.sandbox_id for s in pager.next_items()] == [first.sandbox_id]
        assert not pager.has_next

        started = second.get_info().started_at
        later = Sandbox.list(query=SandboxQuery(metadata=tag, started_after=started)).next_items()
        assert [s.sandbox_id for s in later] == [second.sandbox_id]
        none = Sandbox.list(
            query=SandboxQuery(metadata=tag, started_after=started + timedelta(seconds=1))
        ).next_items()
        assert none == []
        assert len(Sandbox.list(query=SandboxQuery(metadata=tag, template="base")).next_items()) == 2
        assert Sandbox.list(query=SandboxQuery(metadata=tag, template="elsewhere")).next_items() == []
    finally:
        first.kill()
        second.kill()


def test_snapshots_are_listed_found_and_deleted(sbx):
    from e2b import Template

    named = sbx.create_snapshot(name=f"snap-{sbx.sandbox_id.lower()}")
    plain = sbx.create_snapshot()
    try:
        # Newest first, to the second images record: these two may tie.
        mine = [s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items()]
        assert sorted(mine) == sorted([plain.snapshot_id, named.snapshot_id])
        by_name = Sandbox.list_snapshots(name=named.snapshot_id).next_items()
        assert [s.snapshot_id for s in by_name] == [named.snapshot_id]
        assert Sandbox.list_snapshots(name=named.snapshot_id + "-none").next_items() == []
        pager = Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id, limit=1)
        paged = [s.snapshot_id for s in pager.next_items()]
        paged += [s.snapshot_id for s in pager.next_items()]
        assert paged == mine
        assert not pager.has_next
        assert Template.exists(named.snapshot_id) is True
        assert Template.exists("base") is True
        assert Template.exists("no-such-template") is False
    finally:
        assert Sandbox.delete_snapshot(named.snapshot_id) is True
        assert Sandbox.delete_snapshot(plain.snapshot_id) is True
    assert Sandbox.delete_snapshot(plain.snapshot_id) is False
    assert Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items() == []
    # An image that is not a snapshot is not deleted this way.
    assert Sandbox.delete_snapshot("base") is False
    assert Template.exists("base") is True


def test_a_sandbox_killed_under_a_command_breaks_its_stream():
    from e2b.exceptions import TimeoutException

    sbx = Sandbox.create(timeout=60)
    cmd = sbx.commands.run("sleep 60", background=True)
    sbx.kill()
    with pytest.raises(TimeoutException) as gone:
        cmd.wait()
    assert "sandbox was killed" in str(gone.value)


def test_metrics_keep_a_history_that_windows_select(sbx):
    from datetime import datetime, timedelta, timezone

    begun = datetime.now(timezone.utc) - timedelta(seconds=60)
    got = []
    # The sampler takes every running sandbox every 5 s.
    for _ in range(60):
        got = sbx.get_metrics(start=begun, end=datetime.now(timezone.utc))
        if got:
            break
        time.sleep(0.5)
    assert got, "no sample within 30 s"
    assert all(m.timestamp >= begun - timedelta(seconds=1) for m in got)
    assert got[0].mem_total > 0 and got[0].cpu_count >= 1
    # A window before the sandbox existed holds nothing.
    assert sbx.get_metrics(start=begun - timedelta(hours=1), end=begun - timedelta(minutes=30)) == []


def test_file_metadata_is_kept_with_the_file(sbx):
    meta = {"author": "mish", "purpose": "upload"}
    info = sbx.files.write("/tmp/meta/a.txt", "x", metadata=meta)
    assert info.metadata == meta
    assert sbx.files.get_info("/tmp/meta/a.txt").metadata == meta
    listed = {e.name: e for e in sbx.files.list("/tmp/meta")}
    assert listed["a.txt"].metadata == meta
    assert sbx.files.rename("/tmp/meta/a.txt", "/tmp/meta/b.txt").metadata == meta
    # Each file of a multi-file upload gets it; octet-stream uploads too.
    for entry in sbx.files.write_files(
        [{"path": "/tmp/meta/c.txt", "data": "c"}, {"path": "/tmp/meta/d.txt", "data": "d"}],
        metadata={"source": "suite"},
    ):
        assert sbx.files.get_info(entry.path).metadata == {"source": "suite"}
    # An overwrite without metadata drops the old.
    assert sbx.files.write("/tmp/meta/b.txt", "y").metadata is None
    assert sbx.files.get_info("/tmp/meta/b.txt").metadata is None
    # Set from inside the sandbox, it shows too (busybox has no setfattr:
    # the attribute is written through the SDK's own upload, then read
    # back after a rename done by a command, which keeps it).
    sbx.commands.run("mv /tmp/meta/c.txt /tmp/meta/e.txt")
    assert sbx.files.get_info("/tmp/meta/e.txt").metadata == {"source": "suite"}


def test_watch_events_can_carry_their_entry(sbx):
    sbx.files.make_dir("/tmp/entries")
    watcher = sbx.files.watch_dir("/tmp/entries", include_entry=True)
    try:
        sbx.files.write("/tmp/entries/f.txt", "12345")
        seen = []
        deadline = time.monotonic() + 10
        while len(seen) < 3 and time.monotonic() < deadline:
            seen += watcher.get_new_events()
            time.sleep(0.05)
        write = [e for e in seen if e.type.value == "write"][-1]
        assert write.entry is not None
        assert (write.entry.path, write.entry.size) == ("/tmp/entries/f.txt", 5)
    finally:
        watcher.stop()


def serve_http(sbx, port):
    sbx.commands.run(f"mkdir -p /tmp/www && echo hello-from-{port} > /tmp/www/index.html")
    sbx.commands.run(f"httpd -f -p {port} -h /tmp/www", background=True)
    time.sleep(0.3)


def test_any_port_is_reachable_by_e2bs_host_addressing(daemon):
    import httpx

    sbx = Sandbox.create(timeout=120)
    closed = Sandbox.create(timeout=120, network={"allow_public_traffic": False})
    try:
        for box in (sbx, closed):
            serve_http(box, 8001)
        # Public by default, as on E2B: the host names the port.
        r = httpx.get(f"{daemon.url}/index.html", headers={"Host": sbx.get_host(8001)})
        assert (r.status_code, r.text) == (200, "hello-from-8001\n")
        assert sbx.traffic_access_token is None
        # A sandbox that is not public wants its traffic token.
        host = {"Host": closed.get_host(8001)}
        assert httpx.get(f"{daemon.url}/index.html", headers=host).status_code == 403
        wrong = {**host, "e2b-traffic-access-token": sbx._envd_access_token or "x"}
        assert httpx.get(f"{daemon.url}/index.html", headers=wrong).status_code == 403
        token = {**host, "e2b-traffic-access-token": closed.traffic_access_token}
        r = httpx.get(f"{daemon.url}/index.html", headers=token)
        assert (r.status_code, r.text) == (200, "hello-from-8001\n")
        # A port nothing listens on, and a sandbox that is gone.
        r = httpx.get(f"{daemon.url}/", headers={"Host": sbx.get_host(8002)})
        assert r.status_code == 502, r.text
    finally:
        sbx.kill()
        closed.kill()
    r = httpx.get(f"{daemon.url}/", headers={"Host": sbx.get_host(8001)})
    assert r.status_code == 502
    assert r.json() == {"code": 502, "message": "The sandbox was not found", "sandboxId": sbx.sandbox_id}


def test_signed_file_urls_work_for_secure_sandboxes():
    import httpx

    sbx = Sandbox.create(timeout=120, secure=True)
    try:
        sbx.files.write("signed.txt", "through a signed URL")
        r = httpx.get(sbx.download_url("signed.txt"))
        assert (r.status_code, r.text) == (200, "through a signed URL")
        r = httpx.get(sbx.download_url("signed.txt", use_signature_expiration=120))
        assert r.status_code == 200
        r = httpx.get(sbx.download_url("signed.txt", use_signature_expiration=-120))
        assert r.status_code == 401
        assert r.json() == {"code": 401, "message": "signature is already expired"}
        # A signature is for its one path and operation.
        tampered = sbx.download_url("signed.txt").replace("signed.txt", "other.txt")
        assert httpx.get(tampered).status_code == 401
        up = sbx.upload_url("uploaded.txt")
        r = httpx.post(up, files={"file": ("uploaded.txt", b"sent up")})
        assert r.status_code == 200, r.text
        assert sbx.files.read("uploaded.txt") == "sent up"
        assert httpx.post(sbx.download_url("x.txt"), files={"file": ("x", b"x")}).status_code == 401
    finally:
        sbx.kill()


def test_runbox_runs_serve_ports_by_host_only_when_public(daemon):
    import httpx

    auth = {"Authorization": f"Bearer {daemon.token}"}

    def create(**extra):
        r = httpx.post(f"{daemon.url}/v1/runs", json={"image": "base", "ttlSec": 120, **extra}, headers=auth)
        assert r.status_code == 201, r.text
        return r.json()

    private, public = create(), create(publicPorts=True)
    try:
        assert (private["publicPorts"], public["publicPorts"]) == (False, True)
        for run in (private, public):
            box = Sandbox.connect(run["id"])
            serve_http(box, 8001)
        r = httpx.get(f"{daemon.url}/index.html", headers={"Host": f"8001-{public['id']}.x"})
        assert (r.status_code, r.text) == (200, "hello-from-8001\n")
        r = httpx.get(f"{daemon.url}/index.html", headers={"Host": f"8001-{private['id']}.x"})
        assert r.status_code == 403
    finally:
        for run in (private, public):
            httpx.delete(f"{daemon.url}/v1/runs/{run['id']}", headers=auth)


def test_pause_keeps_the_sandbox_and_connect_resumes_it(sbx):
    # A counter in memory: after a pause and a connect it goes on from
    # where it stood (a full pause, not a reboot).
    sbx.commands.run(
        "sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/n.new; mv /tmp/n.new /tmp/n; sleep 0.05; done'",
        background=True,
    )
    time.sleep(0.5)
    assert sbx.pause() is True
    assert not sbx.is_running()
    # Pausing again is a no-op the SDK reports as False (E2B answers 409).
    assert Sandbox.pause(sbx.sandbox_id) is False
    paused = [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()]
    assert sbx.sandbox_id in paused
    assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED
    resumed = sbx.connect()
    assert resumed.sandbox_id == sbx.sandbox_id
    assert sbx.is_running()
    first = int(sbx.files.read("/tmp/n"))
    time.sleep(0.3)
    assert int(sbx.files.read("/tmp/n")) > first
    running = [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING])).next_items()]
    assert sbx.sandbox_id in running


def test_a_paused_sandbox_resumes_on_traffic_only_with_auto_resume():
    plain = Sandbox.create(timeout=120)
    waking = Sandbox.create(timeout=120, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        for s in (plain, waking):
            s.files.write("/tmp/x", "kept")
            assert s.pause() is True
        # Without autoResume, a call to the paused sandbox is refused as
        # by E2B; with it, the call wakes the sandbox.
        assert not plain.is_running()
        assert Sandbox.get_info(plain.sandbox_id).state == SandboxState.PAUSED
        assert waking.files.read("/tmp/x") == "kept"
        assert Sandbox.get_info(waking.sandbox_id).state == SandboxState.RUNNING
        Sandbox.connect(plain.sandbox_id)
        assert plain.files.read("/tmp/x") == "kept"
    finally:
        plain.kill()
        waking.kill()


def test_a_sandbox_that_pauses_at_its_timeout_is_kept_and_connect_wakes_it():
    sbx = Sandbox.create(timeout=120, lifecycle={"on_timeout": "pause"})
    try:
        sbx.commands.run("echo $$ > /tmp/pid; sleep 600", background=True)
        pid = sbx.files.read("/tmp/pid").strip()
        sbx.set_timeout(0)
        deadline = time.time() + 15
        while Sandbox.get_info(sbx.sandbox_id).state != SandboxState.PAUSED:
            assert time.time() < deadline, "not paused at its timeout"
            time.sleep(0.2)
        assert sbx.connect().sandbox_id == sbx.sandbox_id
        # The same machine: the background command is still there.
        assert sbx.commands.run(f"kill -0 {pid} && echo alive").stdout == "alive\n"
    finally:
        sbx.kill()


def test_a_filesystem_only_pause_keeps_files_and_connect_boots_it_again(sbx):
    # keep_memory=False is runbox's hibernation: processes and memory go,
    # the filesystem stays, and connect boots the same sandbox again.
    sbx.files.write("/home/user/kept.txt", "kept")
    sbx.commands.run("echo $$ > /tmp/pid; sleep 600", background=True)
    time.sleep(0.3)
    pid = sbx.files.read("/tmp/pid").strip()
    assert sbx.pause(keep_memory=False) is True
    assert not sbx.is_running()
    assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED
    paused = [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()]
    assert sbx.sandbox_id in paused
    # Pausing again is a no-op the SDK reports as False (E2B answers 409).
    assert Sandbox.pause(sbx.sandbox_id) is False
    assert sbx.connect().sandbox_id == sbx.sandbox_id
    assert sbx.is_running()
    assert sbx.files.read("/home/user/kept.txt") == "kept"
    # The pid may be reused in the new sandbox: look for the command.
    sleeping = sbx.commands.run("cat /proc/[0-9]*/comm 2>/dev/null | grep -cx sleep || true")
    assert sleeping.stdout.strip() == "0", pid


def test_a_sandbox_that_hibernates_at_its_timeout_is_kept_and_connect_boots_it():
    sbx = Sandbox.create(timeout=120, lifecycle={"on_timeout": {"action": "pause", "keep_memory": False}})
    try:
        sbx.files.write("/home/user/kept.txt", "kept")
        sbx.set_timeout(0)
        deadline = time.time() + 15
        while Sandbox.get_info(sbx.sandbox_id).state != SandboxState.PAUSED:
            assert time.time() < deadline, "not paused at its timeout"
            time.sleep(0.2)
        assert sbx.connect().sandbox_id == sbx.sandbox_id
        assert sbx.files.read("/home/user/kept.txt") == "kept"
    finally:
        sbx.kill()

def test_an_archived_sandbox_is_paused_to_the_sdk_and_connect_restores_it(sbx):
    # runbox's archive (its disk to the checkpoint store, nothing left on the
    # node) is one more kind of E2B pause: listed as paused, and a connect
    # brings the sandbox back with its files.
    import httpx

    sbx.files.write("/home/user/kept.txt", "kept")
    archived = httpx.post(
        f"{os.environ['E2B_API_URL']}/v1/runs/{sbx.sandbox_id}/archive",
        headers={"Authorization": f"Bearer {os.environ['E2B_API_KEY']}"},
        timeout=120,
    )
    assert archived.status_code == 200, archived.text
    assert archived.json()["status"] == "archived"
    assert not sbx.is_running()
    assert Sandbox.get_info(sbx.sandbox_id).state == SandboxState.PAUSED
    assert sbx.connect().sandbox_id == sbx.sandbox_id
    assert sbx.is_running()
    assert sbx.files.read("/home/user/kept.txt") == "kept"


def test_files_of_proc_that_report_no_size_are_read_whole(sbx):
    # /proc and /sys files say they hold 0 bytes; their content is read all
    # the same.
    boot_id = sbx.files.read("/proc/sys/kernel/random/boot_id").strip()
    assert len(boot_id) == 36 and boot_id.count("-") == 4, boot_id
    assert "Name:" in sbx.files.read("/proc/self/status")
    # An empty regular file is still empty.
    sbx.files.write("/home/user/empty.txt", "")
    assert sbx.files.read("/home/user/empty.txt") == ""


def test_sandboxes_may_gain_privileges_as_e2b_templates_expect(daemon, sbx):
    # E2B's templates give their user passwordless sudo, and E2B's suite
    # uses it: sandboxes made through the E2B surface let setuid programs
    # work wherever runs have a user namespace of their own.
    import httpx

    auth = {"Authorization": f"Bearer {daemon.token}"}
    private = httpx.get(f"{daemon.url}/v1/info", headers=auth).json()["userns"] == "private"
    run = httpx.get(f"{daemon.url}/v1/runs/{sbx.sandbox_id}", headers=auth).json()
    assert run["allowPrivilegeEscalation"] is private
    status = sbx.commands.run("grep NoNewPrivs /proc/self/status").stdout
    assert status == f"NoNewPrivs:\t{0 if private else 1}\n"
    # A run made through runbox's own API keeps no_new_privs unless asked.
    r = httpx.post(f"{daemon.url}/v1/runs", json={"image": "base", "ttlSec": 60}, headers=auth)
    assert r.status_code == 201, r.text
    try:
        assert r.json()["allowPrivilegeEscalation"] is False
        box = Sandbox.connect(r.json()["id"])
        assert box.commands.run("grep NoNewPrivs /proc/self/status").stdout == "NoNewPrivs:\t1\n"
    finally:
        httpx.delete(f"{daemon.url}/v1/runs/{r.json()['id']}", headers=auth)


def test_volume_mounts_at_create_mount_the_callers_volumes(daemon):
    # A volume made through runbox's API, mounted by name through E2B's
    # create (test_volumes_through_e2bs_volume_api uses E2B's own volume API).
    import httpx

    auth = {"Authorization": f"Bearer {daemon.token}"}
    r = httpx.post(f"{daemon.url}/v1/volumes", json={"name": "e2bvol", "sizeMb": 32}, headers=auth)
    assert r.status_code == 201, r.text
    try:
        sbx = Sandbox.create(timeout=60, volume_mounts={"/mnt/shared": "e2bvol"})
        try:
            sbx.commands.run("echo from-e2b > /mnt/shared/f")
            info = httpx.get(f"{daemon.url}/v1/runs/{sbx.sandbox_id}", headers=auth).json()
            assert info["volumes"] == [{"name": "e2bvol", "path": "/mnt/shared", "mode": "rw"}]
        finally:
            sbx.kill()
        again = Sandbox.create(timeout=60, volume_mounts={"/data": "e2bvol"})
        try:
            assert again.commands.run("cat /data/f").stdout == "from-e2b\n"
        finally:
            again.kill()
        with pytest.raises(Exception):
            Sandbox.create(timeout=60, volume_mounts={"/data": "no-such-volume"})
    finally:
        assert httpx.delete(f"{daemon.url}/v1/volumes/e2bvol", headers=auth).status_code == 204


def test_volumes_through_e2bs_volume_api(daemon):
    # Volume.create/get_info/list/connect/destroy on the control plane, the
    # file calls on the content API with the volume's token, and a sandbox
    # mounting the volume by the Volume object.
    from e2b import Volume
    from e2b.exceptions import NotFoundException, VolumeNotFoundException

    vol = Volume.create("e2b-api-vol")
    try:
        assert vol.name == "e2b-api-vol" and vol.token
        assert [v.name for v in Volume.list()] == ["e2b-api-vol"]
        info = Volume.get_info(vol.volume_id)
        assert (info.volume_id, info.name, info.token) == (vol.volume_id, vol.name, vol.token)

        # Seeding without a sandbox.
        made = vol.make_dir("/data")
        assert (made.path, made.type.value, made.name) == ("/data", "directory", "data")
        written = vol.write_file("/data/a.txt", "hello", uid=1000, gid=1000, mode=0o640)
        assert (written.path, written.size, written.uid, written.mode) == ("/data/a.txt", 5, 1000, 0o640)
        assert vol.read_file("/data/a.txt") == "hello"
        assert vol.read_file("data/a.txt", format="bytes") == b"hello"
        assert b"".join(vol.read_file("/data/a.txt", format="stream")) == b"hello"
        assert vol.exists("/data/a.txt") and not vol.exists("/nope")
        with pytest.raises(Exception):
            vol.write_file("/data/a.txt", "again")  # exists, no force
        assert vol.write_file("/data/a.txt", "again", force=True, uid=1000, gid=1000).size == 5
        with pytest.raises(NotFoundException):
            vol.write_file("/missing/parent.txt", "x")
        with pytest.raises(Exception):
            vol.make_dir("/x/y")  # missing parent without force
        assert vol.make_dir("/x/y", force=True).path == "/x/y"
        assert vol.make_dir("/x/y", force=True).path == "/x/y"  # exists: fine with force
        assert sorted(e.path for e in vol.list("/")) == ["/data", "/x"]
        assert sorted(e.path for e in vol.list("/", depth=2)) == ["/data", "/data/a.txt", "/x", "/x/y"]
        updated = vol.update_metadata("/data/a.txt", mode=0o600)
        assert (updated.mode, updated.uid) == (0o600, 1000)
        vol.remove("/x")
        assert not vol.exists("/x/y")
        with pytest.raises(NotFoundException):
            vol.get_info("/x")

        # A connected handle works the same; a wrong token is refused.
        again = Volume.connect(vol.volume_id)
        assert again.read_file("/data/a.txt") == "again"
        forged = Volume(volume_id=vol.volume_id, name=vol.name, token="forged")
        with pytest.raises(Exception):
            forged.read_file("/data/a.txt")

        # A sandbox mounts it; while it does, reads go on and writes wait.
        sbx = Sandbox.create(timeout=60, volume_mounts={"/mnt/v": vol})
        try:
            assert sbx.commands.run("cat /mnt/v/data/a.txt; stat -c %u /mnt/v/data/a.txt").stdout == "again1000\n"
            sbx.commands.run("echo from-sandbox > /mnt/v/out.txt")
            assert vol.read_file("/out.txt") == "from-sandbox\n"
            with pytest.raises(Exception) as busy:
                vol.write_file("/late.txt", "x")
            assert "mounted" in str(busy.value)
            with pytest.raises(Exception):
                Volume.destroy(vol.volume_id)
        finally:
            sbx.kill()
    finally:
        assert Volume.destroy(vol.volume_id) is True
    assert Volume.destroy(vol.volume_id) is False
    with pytest.raises(VolumeNotFoundException):
        Volume.get_info(vol.volume_id)
    with pytest.raises(Exception):
        Volume.create("bad.name")  # E2B's names: letters, digits, _ and -
