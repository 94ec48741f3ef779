"""E2B's template build API, driven by the unmodified SDK: Template builds
(files, commands, workdir, start and ready commands), failures in E2B's
words, tags, background builds and the signed upload link."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, Template
from e2b.exceptions import BuildException


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def context(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A build context: folder/test.txt and a relative symlink beside it."""
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "test.txt").write_text("This is a test file.")
    (folder / "symlink.txt").symlink_to("test.txt")
    (tmp_path / "top.txt").write_text("top")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_template_builds_and_starts_sandboxes(context: Path) -> None:
    name = unique("tpl")
    logs = []
    template = (
        Template(file_context_path=str(context))
        .from_image("base")
        .copy("folder/*", "folder")
        .copy("top.txt", "/opt/data/top.txt", mode=0o640)
        .run_cmd("cat folder/test.txt && id -u > uid.txt")
        .set_envs({"GREETING": "hello"})
        .set_workdir("/app")
        .run_cmd("touch made-in-app")
        .set_start_cmd("echo started > /tmp/started", "[ -f /tmp/started ]")
    )
    info = Template.build(template, name, on_build_logs=logs.append)
    assert info.name == name
    messages = "\n".join(entry.message for entry in logs)
    assert "This is a test file." in messages
    sandbox = Sandbox.create(name, timeout=120)
    try:
        run = sandbox.commands.run
        assert run("cat /home/user/folder/test.txt").stdout == "This is a test file."
        assert run("cat /home/user/folder/symlink.txt").stdout == "This is a test file."
        # Steps run as the template's `user` (busybox's whoami cannot name
        # it in this image, so its uid is compared).
        uid = run("id -u user").stdout.strip()
        assert run("cat /home/user/uid.txt").stdout.strip() == uid
        # Copies belong to the current user unless they name one.
        assert run("stat -c '%u %a' /opt/data/top.txt").stdout.strip() == f"{uid} 640"
        assert run("stat -c %u /home/user/folder/test.txt").stdout.strip() == uid
        assert run("ls /app").stdout.strip() == "made-in-app"
        assert run("echo $GREETING").stdout.strip() == "hello"
        # The start command ran, and the ready command passed, before the
        # sandbox was handed over.
        assert run("cat /tmp/started").stdout.strip() == "started"
    finally:
        sandbox.kill()
    # A rebuild of the same template reuses every step.
    again = []
    Template.build(template, name, on_build_logs=again.append)
    assert any("cached" in entry.message for entry in again), [e.message for e in again]


def test_a_failed_command_fails_the_build_in_e2bs_words(context: Path) -> None:
    failing = Template().from_image("base").run_cmd("echo nearly && exit 3")
    with pytest.raises(BuildException) as failed:
        Template.build(failing, unique("fail"))
    assert "failed to run command 'echo nearly && exit 3': command failed: exit status 3" in str(
        failed.value
    )
    stranger = Template().from_image("base").run_cmd("whoami", user="root123")
    with pytest.raises(BuildException) as failed:
        Template.build(stranger, unique("fail"))
    assert (
        "failed to run command 'whoami': command failed: unauthenticated: invalid username: 'root123'"
        in str(failed.value)
    )


def test_tags_name_builds_and_exists_answers(context: Path) -> None:
    name = unique("tags")
    assert not Template.exists(name)
    template = Template().from_image("base").run_cmd("echo v1 > /home/user/version")
    info = Template.build(template, f"{name}:v1")
    assert info.tags == ["v1"]
    assert Template.exists(f"{name}:v1")
    assigned = Template.assign_tags(f"{name}:v1", ["prod", "stable"])
    assert sorted(assigned.tags) == ["prod", "stable"]
    tags = {t.tag: t for t in Template.get_tags(name)}
    assert set(tags) == {"v1", "prod", "stable"}
    assert tags["prod"].build_id == tags["v1"].build_id
    sandbox = Sandbox.create(f"{name}:prod", timeout=60)
    try:
        assert sandbox.commands.run("cat /home/user/version").stdout.strip() == "v1"
    finally:
        sandbox.kill()
    Template.remove_tags(name, "stable")
    assert {t.tag for t in Template.get_tags(name)} == {"v1", "prod"}
    with pytest.raises(Exception):
        Template.assign_tags(f"{name}:v1", ":bad-tag")
    with pytest.raises(Exception):
        Template.assign_tags(f"{name}:missing", "x")
    # Deleting the template (as Sandbox.delete_snapshot's route) takes every tag.
    api = {"X-API-Key": os.environ["E2B_API_KEY"]}
    assert httpx.delete(f"{os.environ['E2B_API_URL']}/templates/{name}", headers=api).status_code == 204
    assert not Template.exists(f"{name}:v1")
    assert not Template.exists(f"{name}:prod")


def test_a_background_build_reports_building_then_ready(context: Path) -> None:
    template = Template().from_image("base").run_cmd("sleep 2")
    info = Template.build_in_background(template, unique("bg"))
    status = Template.get_build_status(info)
    assert status.status.value == "building"
    deadline = time.monotonic() + 120
    while status.status.value == "building" and time.monotonic() < deadline:
        time.sleep(0.5)
        status = Template.get_build_status(info)
    assert status.status.value == "ready"


def test_upload_links_are_signed(daemon, context: Path) -> None:
    headers = {"X-API-Key": daemon.token}
    reserved = httpx.post(
        f"{daemon.url}/v3/templates", json={"name": unique("links"), "cpuCount": 1, "memoryMB": 512},
        headers=headers,
    )
    assert reserved.status_code == 202
    template_id = reserved.json()["templateID"]
    link = httpx.get(f"{daemon.url}/templates/{template_id}/files/{'c' * 64}", headers=headers)
    assert link.status_code == 201
    assert link.json()["present"] is False
    url = link.json()["url"]
    # A link altered in any way is refused; a bad hash is a 400.
    forged = url[:-2] + ("AA" if not url.endswith("AA") else "BB")
    assert httpx.put(forged, content=b"x").status_code == 401
    bad = httpx.get(f"{daemon.url}/templates/{template_id}/files/nothex", headers=headers)
    assert bad.status_code == 400
    # Not a tar: refused, nothing stored.
    assert httpx.put(url, content=b"not a tar").status_code == 400
    again = httpx.get(f"{daemon.url}/templates/{template_id}/files/{'c' * 64}", headers=headers)
    assert again.json()["present"] is False
    # Without the API key, the template routes refuse.
    assert httpx.post(f"{daemon.url}/v3/templates", json={"name": "x"}).status_code == 401


def test_tenants_build_their_own_templates(daemon, context: Path) -> None:
    root = {"Authorization": f"Bearer {daemon.token}"}
    keys = {}
    for tenant in ("tpl-acme", "tpl-other"):
        made = httpx.post(f"{daemon.url}/v1/tenants", json={"name": tenant}, headers=root)
        assert made.status_code == 201, made.text
        keys[tenant] = made.json()["token"]
    acme, other = keys["tpl-acme"], keys["tpl-other"]
    name = unique("tenant")
    template = Template().from_image("base").run_cmd("echo acme > /home/user/owner")
    Template.build(template, name, api_key=acme)
    assert Template.exists(name, api_key=acme)
    # Another tenant neither sees it nor builds over it.
    assert not Template.exists(name, api_key=other)
    with pytest.raises(Exception) as refused:
        Template.build(template, name, api_key=other)
    assert "403" in str(refused.value) or "already used" in str(refused.value)
    # The image is the tenant's.
    image = httpx.get(f"{daemon.url}/v1/images/{name}", headers=root).json()
    assert image["tenant"] == "tpl-acme"
    # An upload link is for its tenant: files another tenant uploads are
    # not present for this one.
    headers = {"X-API-Key": other}
    link = httpx.get(f"{daemon.url}/templates/{name}/files/{'d' * 64}", headers=headers).json()
    assert link["present"] is False
