"""The async client against a live daemon."""

from __future__ import annotations

import asyncio

import pytest

import runbox
from runbox import AsyncRunbox, Exit, Stdout


async def test_the_async_client_does_what_the_sync_one_does(daemon):
    async with AsyncRunbox(daemon.url, daemon.token) as rb:
        run = await rb.create_run("base")
        try:
            result = await rb.run(run.id, "echo async; exit 2")
            assert (result.stdout, result.exit_code) == (b"async\n", 2)
            events = [e async for e in rb.exec(run.id, "echo x")]
            assert isinstance(events[-1], Exit)
            # Several commands at once, reaching a paused run: it resumes once.
            assert (await rb.pause_run(run.id)).status == "paused"
            outs = await asyncio.gather(*(rb.run(run.id, f"echo {i}") for i in range(5)))
            assert (await rb.get_run(run.id)).status == "running"
            assert (await rb.resume_run(run.id)).status == "running"
            assert (await rb.hibernate_run(run.id)).status == "hibernated"
            assert (await rb.wake_run(run.id)).status == "running"
            assert [o.text for o in outs] == [f"{i}\n" for i in range(5)]
            await rb.write_file(run.id, "a.txt", b"bytes")
            assert await rb.read_file(run.id, "a.txt") == b"bytes"
            proc = await rb.start_process(run.id, "sleep 30", tag="s")
            assert (await rb.process(run.id, "s")).running
            await rb.signal_process(run.id, proc.pid, "INT")
            assert (await rb.wait_process(run.id, "s", timeout=20)).exit.signal == 2
            session = await rb.session(run.id, "read l; echo got=$l", pty=(5, 20))
            async with session:
                await session.send("x\r")
                done = await session.wait()
            assert b"got=x" in done.stdout
            with pytest.raises(runbox.NotFound):
                await rb.process(run.id, "nobody")
            attached = await rb.start_process(run.id, "echo kept; sleep 30", tag="k")
            chunks = b""
            async for event in rb.process_output(run.id, "k"):
                if isinstance(event, Stdout):
                    chunks += event.data
                    break
            assert chunks == b"kept\n"
            await rb.signal_process(run.id, attached.pid, "KILL")
        finally:
            await rb.delete_run(run.id)


async def test_the_async_client_reaches_volume_files(daemon):
    async with AsyncRunbox(daemon.url, daemon.token) as rb:
        await rb.create_volume("pyasyncfiles", size_mb=16)
        try:
            put = await rb.write_volume_file("pyasyncfiles", "d/a", b"bytes")
            assert (put.path, put.size) == ("/d/a", 5)
            assert await rb.read_volume_file("pyasyncfiles", "/d/a") == b"bytes"
            assert (await rb.volume_stat("pyasyncfiles", "d")).path == "/d"
            assert [e.path for e in await rb.volume_list("pyasyncfiles", "d")] == ["/d/a"]
            assert (await rb.volume_make_dir("pyasyncfiles", "e", owner=(7, 7))).uid == 7
            assert (await rb.volume_move("pyasyncfiles", "d/a", "e/a")).path == "/e/a"
            assert await rb.volume_remove("pyasyncfiles", "e", recursive=True) == 2
        finally:
            await rb.delete_volume("pyasyncfiles")


async def test_the_async_client_builds_images(daemon):
    async with AsyncRunbox(daemon.url, daemon.token) as rb:
        build = await rb.build_image("sdk-async-built", "FROM base\nRUN echo async > /made\n")
        try:
            assert build["status"] == "ready"
            assert (await rb.get_build(build["id"]))["name"] == "sdk-async-built"
            events = [e async for e in rb.build_events(build["id"])]
            assert events[-1]["event"] == "done" and events[-1]["status"] == "ready"
        finally:
            await rb.delete_image("sdk-async-built")


async def test_the_async_client_lists_diffs_and_rolls_back_history(daemon):
    async with AsyncRunbox(daemon.url, daemon.token) as rb:
        run = await rb.create_run("base", history=5)
        try:
            wrote = await rb.run(run.id, "echo async > /work/h.txt")
            assert wrote.point is not None
            kept = await rb.history(run.id)
            assert [p.cause.kind for p in kept.points] == ["exec", "create"]
            assert kept.head == wrote.point
            diff = await rb.diff(run.id, patch=True)
            assert [(c.path, c.change) for c in diff.changes] == [("/work/h.txt", "added")]
            assert "+async" in diff.changes[0].patch
            await rb.rollback(run.id, kept.points[1].id)
            assert (await rb.run(run.id, "cat /work/h.txt")).exit_code != 0
            forks = await rb.fork(run.id, point=wrote.point)
            try:
                assert (await rb.run(forks[0].id, "cat /work/h.txt")).stdout == b"async\n"
            finally:
                for f in forks:
                    await rb.delete_run(f.id)
            with pytest.raises(runbox.NotFound) as e:
                await rb.rollback(run.id, "01ARZ3NDEKTSV4RRFFQ69G5FAV")
            assert e.value.code == "point_not_found"
        finally:
            await rb.delete_run(run.id)
