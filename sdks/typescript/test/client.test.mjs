// The SDK against a live daemon: runs, exec, errors, files, watch,
// background processes, leases, snapshots, forks, history and previews.
import assert from "node:assert/strict";
import { after, before, test } from "node:test";

import { BadRequest, Conflict, Forbidden, NotFound, Runbox, RunboxError, Unauthorized } from "../dist/index.js";
import { Daemon } from "./daemon.mjs";

let daemon;
let rb;
const text = (bytes) => new TextDecoder().decode(bytes);

before(async () => {
  daemon = await Daemon.start();
  rb = new Runbox({ url: daemon.url, token: daemon.token });
});

after(() => daemon?.stop());

/** Runs `body` with a fresh run, deleted after. */
async function withRun(body) {
  const run = await rb.createRun("base");
  try {
    await body(run.id);
  } finally {
    await rb.deleteRun(run.id).catch(() => {});
  }
}

async function rejectsWith(promise, Class, code) {
  await assert.rejects(promise, (e) => {
    assert.ok(e instanceof Class, `${e} is not a ${Class.name}`);
    assert.equal(e.code, code);
    return true;
  });
}

test("health and a run's lifecycle", async () => {
  assert.equal((await rb.health()).status, "ok");
  const run = await rb.createRun("base", { env: { GREETING: "hi" }, ttlSec: 600, labels: { team: "sdk" } });
  try {
    assert.equal(run.status, "running");
    assert.deepEqual(run.labels, { team: "sdk" });
    assert.ok(run.limits.memoryMb > 0);
    assert.ok((await rb.listRuns()).some((r) => r.id === run.id));
    // A label selector: exactly the runs it names.
    assert.deepEqual((await rb.listRuns({ labels: { team: "sdk" } })).map((r) => r.id), [run.id]);
    assert.deepEqual((await rb.listRuns({ labels: ["team"] })).map((r) => r.id), [run.id]);
    assert.deepEqual(await rb.listRuns({ labels: { team: "other" } }), []);
    assert.deepEqual(await rb.listRuns({ labels: { team: null, job: null } }), []);
    const vol = await rb.createVolume("ts-labelled", { sizeMb: 16, labels: { team: "sdk" } });
    try {
      assert.deepEqual(vol.labels, { team: "sdk" });
      assert.deepEqual((await rb.listVolumes({ labels: { team: "sdk" } })).map((v) => v.name), ["ts-labelled"]);
      assert.deepEqual(await rb.listVolumes({ labels: ["nope"] }), []);
    } finally {
      await rb.deleteVolume("ts-labelled");
    }
    assert.equal((await rb.getRun(run.id)).image, "base");
    const renewed = await rb.renewRun(run.id, 1200);
    assert.ok(Date.parse(renewed.expiresAt) > Date.parse(run.expiresAt));
    assert.equal((await rb.pauseRun(run.id)).status, "paused");
    assert.equal((await rb.getRun(run.id)).status, "paused");
    assert.equal((await rb.resumeRun(run.id)).status, "running");
    await rb.pauseRun(run.id);
    const result = await rb.run(run.id, "echo $GREETING; echo oops >&2; exit 3");
    assert.equal(result.text, "hi\n");
    assert.equal(result.stderrText, "oops\n");
    assert.equal(result.exitCode, 3);
    assert.equal(result.exit.reason, "exited");
    // Hibernated: files kept, the next call (or a wake) boots it again.
    await rb.writeFile(run.id, "kept.txt", "kept");
    assert.equal((await rb.hibernateRun(run.id)).status, "hibernated");
    assert.equal((await rb.getRun(run.id)).status, "hibernated");
    assert.equal(new TextDecoder().decode(await rb.readFile(run.id, "kept.txt")), "kept");
    await rb.hibernateRun(run.id);
    assert.equal((await rb.wakeRun(run.id)).status, "running");
  } finally {
    await rb.deleteRun(run.id);
  }
  const sleepy = await rb.createRun("base", { onExpire: "hibernate", idle: { hibernateAfterSec: 600 }, autoResume: false });
  try {
    assert.equal(sleepy.onExpire, "hibernate");
    assert.equal(sleepy.autoResume, false);
    assert.deepEqual(sleepy.idle, { hibernateAfterSec: 600 });
    await rb.hibernateRun(sleepy.id);
    await assert.rejects(rb.run(sleepy.id, "true"), (e) => e.code === "run_paused" && e.status === 409);
  } finally {
    await rb.deleteRun(sleepy.id);
  }
  // setuid programs work in a run that allows it (user namespaces are the
  // daemon's default); every other run's commands have no_new_privs.
  assert.equal(run.allowPrivilegeEscalation, false);
  const loose = await rb.createRun("base", { allowPrivilegeEscalation: true });
  try {
    assert.equal(loose.allowPrivilegeEscalation, true);
    const status = await rb.run(loose.id, "grep NoNewPrivs /proc/self/status");
    assert.equal(text(status.stdout), "NoNewPrivs:\t0\n");
  } finally {
    await rb.deleteRun(loose.id);
  }
  await assert.rejects(rb.getRun(run.id), (e) => e instanceof NotFound && e.code === "run_not_found" && e.status === 404);
});

test("volumes outlive their runs", async () => {
  const made = await rb.createVolume("tsdata", { sizeMb: 32 });
  assert.deepEqual([made.name, made.sizeMb, made.holders], ["tsdata", 32, []]);
  try {
    const writer = await rb.createRun("base", { volumes: [{ name: "tsdata" }] });
    assert.deepEqual(writer.volumes, [{ name: "tsdata", path: "/volumes/tsdata", mode: "rw" }]);
    await rb.run(writer.id, "echo kept > /volumes/tsdata/f");
    await assert.rejects(
      rb.createRun("base", { volumes: [{ name: "tsdata", mode: "ro" }] }),
      (e) => e.code === "volume_busy" && e.status === 409,
    );
    await rb.deleteRun(writer.id);
    const reader = await rb.createRun("base", { volumes: [{ name: "tsdata", path: "/data", mode: "ro" }] });
    try {
      assert.equal(text((await rb.run(reader.id, "cat /data/f")).stdout), "kept\n");
      assert.deepEqual((await rb.getVolume("tsdata")).holders.map((h) => h.mode), ["ro"]);
      assert.deepEqual((await rb.listVolumes()).map((v) => v.name), ["tsdata"]);
      const copy = await rb.cloneVolume("tsdata", "tscopy");
      assert.deepEqual([copy.name, copy.sizeMb], ["tscopy", 32]);
      await rb.deleteVolume("tscopy");
    } finally {
      await rb.deleteRun(reader.id);
    }
  } finally {
    await rb.deleteVolume("tsdata");
  }
  await assert.rejects(rb.getVolume("tsdata"), (e) => e instanceof NotFound && e.code === "volume_not_found");
});

test("secrets a caller brings stay out of the run", async () => {
  const secret = {
    name: "VENDOR_KEY",
    value: "ts-v4lue-7",
    hosts: ["api.vendor.example"],
    header: "Authorization",
    scheme: "Bearer",
    methods: ["GET"],
    pathPrefixes: ["/v1/"],
  };
  const run = await rb.createRun("base", { network: "allowlist", secrets: [secret] });
  try {
    assert.deepEqual(run.secrets, ["VENDOR_KEY"]);
    assert.ok(!JSON.stringify(await rb.getRun(run.id)).includes(secret.value));
    assert.equal(text((await rb.run(run.id, 'printf %s "$VENDOR_KEY"')).stdout), "runbox-secret:VENDOR_KEY");
    const rule = { host: "db.example.com", ports: [5432], methods: ["GET"] };
    const changed = await rb.updateEgress(run.id, { egressAllow: ["registry.npmjs.org", rule], secrets: [] });
    assert.deepEqual([changed.egressAllow, changed.secrets ?? []], [["registry.npmjs.org", rule], []]);
    assert.equal(changed.egressSocks5, undefined);
    const door = await rb.updateEgress(run.id, { egressSocks5: true });
    assert.equal(door.egressSocks5, true);
    assert.equal(text((await rb.run(run.id, 'printf %s "$ALL_PROXY"')).stdout), "socks5h://127.0.0.1:1080");
    const closed = await rb.updateEgress(run.id, { network: "none" });
    assert.equal(closed.network, "none");
  } finally {
    await rb.deleteRun(run.id);
  }
  await assert.rejects(
    rb.createRun("base", { network: "allowlist", secrets: [{ ...secret, header: "Host" }] }),
    (e) => e.code === "bad_secret" && e.status === 400 && !e.message.includes(secret.value),
  );
  // This server admits no upstream proxy: refused, the password not echoed.
  await assert.rejects(
    rb.createRun("base", { network: "allowlist", egressUpstream: "socks5://u:pw-77@10.9.9.9:1080" }),
    (e) => e.code === "bad_egress" && !e.message.includes("pw-77"),
  );
});

test("a volume's files without a run", async () => {
  await rb.createVolume("tsfiles", { sizeMb: 16 });
  try {
    const put = await rb.writeVolumeFile("tsfiles", "/seed/a.txt", "hello", { mode: 0o640, owner: [1000, 1000] });
    assert.deepEqual([put.path, put.size, put.mode, put.uid], ["/seed/a.txt", 5, 0o640, 1000]);
    assert.equal(text(await rb.readVolumeFile("tsfiles", "seed/a.txt")), "hello");
    assert.equal((await rb.volumeMakeDir("tsfiles", "out", { owner: [7, 7] })).uid, 7);
    assert.deepEqual((await rb.volumeList("tsfiles", "/", 2)).map((e) => e.path), ["/out", "/seed", "/seed/a.txt"]);
    await assert.rejects(
      rb.writeVolumeFile("tsfiles", "seed/a.txt", "again", { overwrite: false }),
      (e) => e.code === "file_exists",
    );
    const run = await rb.createRun("base", { volumes: [{ name: "tsfiles" }] });
    try {
      await rb.run(run.id, "echo result > /volumes/tsfiles/out/r");
      assert.equal(text(await rb.readVolumeFile("tsfiles", "out/r")), "result\n");
      await assert.rejects(rb.writeVolumeFile("tsfiles", "late", "x"), (e) => e.code === "volume_busy" && e.status === 409);
    } finally {
      await rb.deleteRun(run.id);
    }
    assert.equal((await rb.volumeMove("tsfiles", "out/r", "r")).path, "/r");
    assert.equal((await rb.volumeStat("tsfiles", "r")).size, 7);
    assert.equal(await rb.volumeRemove("tsfiles", "seed", { recursive: true }), 2);
  } finally {
    await rb.deleteVolume("tsfiles");
  }
});

test("exec streams its events in order, with stdin, a terminal, a timeout and a user", () =>
  withRun(async (id) => {
    const events = [];
    for await (const event of rb.exec(id, ["sh", "-c", "echo a; echo b >&2"])) events.push(event);
    assert.equal(events[0].type, "started");
    assert.equal(events.at(-1).type, "exit");
    assert.equal(events.filter((e) => e.type === "stdout").map((e) => text(e.data)).join(""), "a\n");
    assert.equal(events.filter((e) => e.type === "stderr").map((e) => text(e.data)).join(""), "b\n");
    assert.equal((await rb.run(id, ["cat"], { stdin: "piped" })).text, "piped");
    assert.match((await rb.run(id, "stty size", { pty: { rows: 10, cols: 40 } })).text, /10 40/);
    const timed = await rb.run(id, "sleep 30", { timeoutSec: 1 });
    assert.equal(timed.exit.timedOut, true);
    assert.equal(timed.exit.reason, "timeout");
    assert.equal((await rb.run(id, "id -u", { user: "nobody" })).text.trim(), "65534");
  }));

test("leaving an exec loop early kills the command", () =>
  withRun(async (id) => {
    for await (const event of rb.exec(id, "echo started; sleep 60")) {
      if (event.type === "stdout") break;
    }
    // The command is gone: no process of it is left in the run.
    for (let i = 0; ; i++) {
      const left = (await rb.processes(id)).filter((p) => p.cmd.includes("echo started; sleep 60"));
      if (left.length === 0) break;
      assert.ok(i < 100, `still running: ${JSON.stringify(left)}`);
      await new Promise((r) => setTimeout(r, 100));
    }
    // An AbortSignal stops one too.
    const abort = new AbortController();
    const pending = rb.run(id, "sleep 60", { signal: abort.signal });
    setTimeout(() => abort.abort(new Error("enough")), 200);
    await assert.rejects(pending, /enough/);
  }));

test("errors carry the API's stable code", () =>
  withRun(async (id) => {
    await rejectsWith(rb.run(id, ["no-such-command"]), BadRequest, "command_not_found");
    await rejectsWith(rb.createRun("base", { ttlSec: 0 }), BadRequest, "bad_ttl");
    await rejectsWith(rb.createRun("no-such-image"), NotFound, "image_not_found");
    await rejectsWith(rb.stat(id, "../etc"), BadRequest, "bad_path");
    await rb.run(id, "ln -sf /etc /work/etc-link");
    await rejectsWith(rb.readFile(id, "etc-link/passwd"), Forbidden, "path_escape");
    // A node alone has nowhere to move a run to.
    await assert.rejects(rb.moveRun(id), (e) => e instanceof RunboxError && e.code === "not_movable" && e.status === 409);
    await rb.createVolume("stays");
    await assert.rejects(rb.moveVolume("stays", "n2"), (e) => e instanceof RunboxError && e.code === "not_movable" && e.status === 409);
    await rb.deleteVolume("stays");
    // Segments that would become another route are refused before sending.
    await assert.rejects(rb.getRun(".."), (e) => e instanceof RunboxError && e.code === "bad_request");
    await rejectsWith(new Runbox({ url: daemon.url, token: "wrong-token" }).listRuns(), Unauthorized, "unauthorized");
    // Nothing listens on port 9 of loopback.
    await assert.rejects(new Runbox({ url: "http://127.0.0.1:9", token: "x" }).health(), (e) => e.code === "unreachable");
    assert.throws(() => new Runbox({ url: "ftp://example" }), /http:\/\/ or https:\/\//);
  }));

test("files and fs operations", () =>
  withRun(async (id) => {
    await rb.writeFile(id, "src/hello.txt", "hello\n");
    assert.equal(await rb.readText(id, "src/hello.txt"), "hello\n");
    const binary = new Uint8Array(256 * 1000).map((_, i) => i % 256);
    await rb.writeFile(id, "/work/blob.bin", binary);
    assert.deepEqual(await rb.readFile(id, "blob.bin"), binary);
    const info = await rb.stat(id, "src/hello.txt");
    assert.equal(info.kind, "file");
    assert.equal(info.size, 6);
    await rb.makeDir(id, "a/b/c");
    await rb.move(id, "src/hello.txt", "a/b/hello.txt");
    assert.deepEqual((await rb.listDir(id, "a", 3)).map((e) => e.path), ["a/b", "a/b/c", "a/b/hello.txt"]);
    assert.equal(await rb.remove(id, "a", { recursive: true }), 4);
    await rejectsWith(rb.readFile(id, "a/b/hello.txt"), NotFound, "file_not_found");
    // A name with spaces and a percent sign travels as one segment.
    await rb.writeFile(id, "odd name %2e.txt", "odd");
    assert.equal((await rb.run(id, "cat '/work/odd name %2e.txt'")).text, "odd");
  }));

test("watch sees a write", () =>
  withRun(async (id) => {
    const events = rb.watch(id);
    assert.equal((await events.next()).value.kind, "ready");
    await rb.writeFile(id, "watched.txt", "x");
    for await (const event of events) {
      // Uploads land by rename, so the name shows up as a rename's target.
      if (["written", "created", "renamed"].includes(event.kind) && event.path.endsWith("watched.txt")) break;
    }
  }));

test("background processes", () =>
  withRun(async (id) => {
    const proc = await rb.startProcess(id, "echo up; read x; echo got=$x; exit 4", { tag: "job", openStdin: true });
    assert.ok(proc.running && proc.background);
    assert.equal(proc.tag, "job");
    assert.ok((await rb.processes(id)).some((p) => p.pid === proc.pid));
    await rb.sendStdin(id, "job", "hi\n");
    const done = await rb.waitProcess(id, "job", 20);
    assert.equal(done.running, false);
    assert.equal(done.exit.exitCode, 4);
    const output = [];
    for await (const event of rb.processOutput(id, proc.pid)) output.push(event);
    assert.equal(output.filter((e) => e.type === "stdout").map((e) => text(e.data)).join(""), "up\ngot=hi\n");
    assert.equal(output.at(-1).exitCode, 4);
    const sleeper = await rb.startProcess(id, ["sleep", "30"]);
    await rb.signalProcess(id, sleeper.pid, "KILL");
    assert.equal((await rb.waitProcess(id, sleeper.pid, 20)).exit.signal, 9);
    await rejectsWith(rb.signalProcess(id, sleeper.pid, "TERM"), Conflict, "process_ended");
    await rejectsWith(rb.signalProcess(id, "job", "NOPE"), BadRequest, "bad_signal");
  }));

test("leases fence writes", () =>
  withRun(async (id) => {
    const lease = await rb.acquireLease(id, "alice", 60);
    assert.equal(lease.holder, "alice");
    await rejectsWith(rb.run(id, "true"), Conflict, "leased");
    const held = { owner: lease.holder, generation: lease.generation };
    assert.equal((await rb.run(id, "echo ok", { lease: held })).text, "ok\n");
    await rb.writeFile(id, "leased.txt", "x", held);
    await rb.releaseLease(id, held);
    assert.equal((await rb.run(id, "cat /work/leased.txt")).text, "x");
  }));

test("checkpoints", () =>
  withRun(async (id) => {
    await rb.run(id, "echo kept > /work/ck.txt");
    const ck = await rb.checkpoint(id, { sdk: "ts" });
    assert.equal(ck.run, id);
    assert.deepEqual(ck.labels, { sdk: "ts" });
    assert.ok((await rb.listCheckpoints()).some((c) => c.id === ck.id));
    assert.ok((await rb.getCheckpoint(ck.id)).storedBytes > 0);
    const child = await rb.createRun(undefined, { checkpoint: ck.id });
    try {
      assert.equal((await rb.run(child.id, "cat /work/ck.txt")).text, "kept\n");
    } finally {
      await rb.deleteRun(child.id);
    }
    await rb.deleteCheckpoint(ck.id);
    assert.equal((await rb.archiveRun(id)).status, "archived");
    assert.equal((await rb.run(id, "cat /work/ck.txt")).text, "kept\n");
    assert.equal((await rb.getRun(id)).status, "running");
    await assert.rejects(rb.getCheckpoint(ck.id), (e) => e.code === "checkpoint_not_found");
  }));

test("snapshots, forks and previews", () =>
  withRun(async (id) => {
    await rb.run(id, "echo state > /work/state.txt");
    const snap = await rb.snapshot(id, `ts-snap-${Date.now()}`);
    assert.ok((await rb.listImages()).some((i) => i.name === snap.image));
    const child = await rb.createRun(snap.image);
    try {
      assert.equal((await rb.run(child.id, "cat /work/state.txt")).text, "state\n");
    } finally {
      await rb.deleteRun(child.id);
    }
    const forks = await rb.fork(id, 2);
    try {
      assert.equal(forks.length, 2);
      assert.equal((await rb.run(forks[0].id, "cat /work/state.txt")).text, "state\n");
    } finally {
      for (const f of forks) await rb.deleteRun(f.id);
    }
    await rb.deleteImage(snap.image);
    await rb.startProcess(id, "mkdir -p /work/www && echo page > /work/www/index.html && exec httpd -f -p 8080 -h /work/www");
    const preview = await rb.mintPreview(id, 8080, 60);
    assert.match(preview.url, /\/p\//);
    assert.equal(preview.port, 8080);
    let body = "";
    for (let i = 0; i < 100 && body !== "page\n"; i++) {
      const response = await fetch(preview.url).catch(() => undefined);
      if (response?.ok) body = await response.text();
      else await new Promise((r) => setTimeout(r, 100));
    }
    assert.equal(body, "page\n");
  }));

test("history: points, diffs, rollbacks, and forks and snapshots of points", async () => {
  const run = await rb.createRun("base", { history: { keep: 10 } });
  const unknown = "01ARZ3NDEKTSV4RRFFQ69G5FAV";
  try {
    assert.deepEqual(run.history, { keep: 10 });
    // A command that changes a file leaves a point, named by its exit.
    const wrote = await rb.run(run.id, "mkdir /work/app && echo one > /work/app/a.txt");
    assert.equal(wrote.exitCode, 0);
    assert.ok(wrote.point);
    assert.equal(wrote.exit.point, wrote.point);
    // One that only reads leaves none.
    const read = await rb.run(run.id, "cat /work/app/a.txt");
    assert.equal(read.text, "one\n");
    assert.equal(read.point, undefined);
    const kept = await rb.history(run.id);
    assert.equal(kept.keep, 10);
    assert.equal(kept.head, wrote.point);
    assert.deepEqual(kept.points.map((p) => p.cause.kind), ["exec", "create"]);
    const [newest, created] = kept.points;
    assert.equal(newest.id, wrote.point);
    assert.equal(newest.parent, created.id);
    assert.deepEqual(newest.cause.argv, ["sh", "-c", "mkdir /work/app && echo one > /work/app/a.txt"]);
    assert.equal(newest.cause.exitCode, 0);
    assert.equal(newest.changes.added, 2);
    // The newest point's diff, by default against its parent.
    const diff = await rb.diff(run.id);
    assert.equal(diff.point, wrote.point);
    assert.equal(diff.against, created.id);
    assert.deepEqual(diff.changes.map((c) => [c.path, c.change]), [["/work/app", "added"], ["/work/app/a.txt", "added"]]);
    assert.equal(diff.changes[1].after.size, 4);
    assert.equal(diff.changes[1].patch ?? undefined, undefined);
    const patched = await rb.diff(run.id, wrote.point, { patch: true });
    assert.match(patched.changes[1].patch, /\+one/);
    assert.equal((await rb.diff(run.id, wrote.point, { limit: 1 })).changes.length, 1);
    // A file call leaves a point too.
    await rb.writeFile(run.id, "app/a.txt", "two\n");
    const changed = (await rb.history(run.id)).points[0];
    assert.deepEqual([changed.cause.kind, changed.cause.op, changed.cause.path], ["file", "write", "/work/app/a.txt"]);
    // Back to before everything: the files go.
    const back = await rb.rollback(run.id, created.id);
    assert.equal(back.id, run.id);
    assert.equal(back.status, "running");
    assert.notEqual((await rb.run(run.id, "cat /work/app/a.txt")).exitCode, 0);
    assert.equal((await rb.run(run.id, "ls /work")).text, "");
    assert.equal((await rb.history(run.id)).head, created.id);
    // And forward again: the later points stayed.
    await rb.rollback(run.id, wrote.point);
    assert.equal((await rb.run(run.id, "cat /work/app/a.txt")).text, "one\n");
    assert.equal((await rb.diff(run.id, changed.id, { against: created.id })).summary.added, 2);
    // A fork and a snapshot of a point: the files as they were then.
    await rb.run(run.id, "echo three > /work/app/a.txt");
    const forks = await rb.fork(run.id, 1, undefined, wrote.point);
    try {
      assert.equal((await rb.run(forks[0].id, "cat /work/app/a.txt")).text, "one\n");
    } finally {
      for (const f of forks) await rb.deleteRun(f.id);
    }
    const snap = await rb.snapshot(run.id, `ts-point-${Date.now()}`, created.id);
    try {
      const child = await rb.createRun(snap.image);
      try {
        assert.equal((await rb.run(child.id, "ls /work")).text, "");
      } finally {
        await rb.deleteRun(child.id);
      }
    } finally {
      await rb.deleteImage(snap.image);
    }
    assert.equal((await rb.run(run.id, "cat /work/app/a.txt")).text, "three\n");
    // A point the run does not have.
    await rejectsWith(rb.diff(run.id, unknown), NotFound, "point_not_found");
    await rejectsWith(rb.rollback(run.id, unknown), NotFound, "point_not_found");
    await rejectsWith(rb.fork(run.id, 1, undefined, unknown), NotFound, "point_not_found");
  } finally {
    await rb.deleteRun(run.id);
  }
  // A run without history has no points; nor has one that changed nothing yet.
  await withRun(async (id) => {
    await rb.run(id, "echo x > /work/x");
    await rejectsWith(rb.history(id), NotFound, "point_not_found");
    await rejectsWith(rb.diff(id), NotFound, "point_not_found");
  });
  const fresh = await rb.createRun("base", { history: { keep: 3 } });
  try {
    assert.deepEqual((await rb.history(fresh.id)).points, []);
    await rejectsWith(rb.diff(fresh.id), NotFound, "point_not_found");
  } finally {
    await rb.deleteRun(fresh.id);
  }
  await rejectsWith(rb.createRun("base", { history: { keep: 1_000_000 } }), BadRequest, "bad_history");
});

test("tenants, run tokens and usage", async () => {
  const name = `ts${Date.now() % 100000000}`;
  const made = await rb.createTenant({ name, maxRuns: 1, networks: ["none"] });
  assert.equal(made.tenant.name, name);
  assert.equal(made.token.length, 64);
  assert.ok((await rb.listTenants()).some((t) => t.name === name));
  const tenant = new Runbox({ url: daemon.url, token: made.token });
  const run = await tenant.createRun("base");
  try {
    assert.equal(run.tenant, name);
    assert.ok(run.token.startsWith("run_"));
    const driver = new Runbox({ url: daemon.url, token: run.token });
    assert.equal(text((await driver.run(run.id, "echo hi")).stdout), "hi\n");
    await rejectsWith(driver.listRuns(), Forbidden, "forbidden");
    await rejectsWith(tenant.info(), Forbidden, "forbidden");
    await rejectsWith(tenant.createRun("base"), RunboxError, "tenant_quota");
    assert.deepEqual((await tenant.listRuns()).map((r) => r.id), [run.id]);
    const report = await tenant.usage({ since: "1h" });
    assert.deepEqual(Object.keys(report.tenants), [name]);
    assert.equal(report.tenants[name].events.create, 1);
  } finally {
    await tenant.deleteRun(run.id);
  }
  assert.equal((await rb.updateTenant(name, { maxRuns: 3 })).maxRuns, 3);
  const rotated = await rb.rotateTenant(name);
  assert.notEqual(rotated.token, made.token);
  await rb.deleteTenant(name);
  await rejectsWith(rb.getTenant(name), NotFound, "tenant_not_found");
});

test("images are built from a Dockerfile and a context", async () => {
  const { execFileSync } = await import("node:child_process");
  const { mkdtempSync, writeFileSync, rmSync } = await import("node:fs");
  const { tmpdir } = await import("node:os");
  const { join } = await import("node:path");
  const dir = mkdtempSync(join(tmpdir(), "runbox-ts-build-"));
  try {
    writeFileSync(join(dir, "hello.txt"), "hello from ts\n");
    const tar = new Uint8Array(execFileSync("tar", ["-c", "-C", dir, "hello.txt"]));
    const lines = [];
    const build = await rb.buildImage("ts-built", {
      dockerfile: "FROM base\nCOPY hello.txt /h.txt\nRUN cat /h.txt\n",
      context: tar,
      onLog: (line) => lines.push(line.text),
    });
    assert.equal(build.status, "ready");
    assert.deepEqual(build.steps.map((s) => s.status), ["done", "done"]);
    assert.ok(lines.includes("hello from ts"), JSON.stringify(lines));
    assert.equal((await rb.getBuild(build.id)).status, "ready");
    assert.ok((await rb.listBuilds()).some((b) => b.id === build.id));
    const run = await rb.createRun("ts-built");
    try {
      assert.equal((await rb.run(run.id, "cat /h.txt")).text, "hello from ts\n");
    } finally {
      await rb.deleteRun(run.id);
    }
    // A failing step rejects with BuildFailed: the step, its exit code, its output.
    await assert.rejects(rb.buildImage("ts-broken", { dockerfile: "FROM base\nRUN echo no >&2; exit 5\n" }), (e) => {
      assert.equal(e.name === "BuildFailed" || e.constructor.name === "BuildFailed", true);
      assert.equal(e.code, "step_failed");
      assert.equal(e.build.error.exitCode, 5);
      assert.deepEqual(e.build.error.output, ["no"]);
      return true;
    });
    await rejectsWith(rb.buildImage("ts-bad", { dockerfile: "FROM base\nNOPE\n" }), BadRequest, "bad_dockerfile");
  } finally {
    rmSync(dir, { recursive: true, force: true });
    await rb.deleteImage("ts-built").catch(() => {});
  }
});
