// What E2B's own SDK suite checks of the behaviours runbox claims, held here
// through the released JavaScript SDK (scripts/e2b-conformance runs the suite
// itself; docs/e2b.md has its counts).
import assert from "node:assert/strict";
import { test } from "node:test";

import { Sandbox, Volume } from "e2b";

import { sleep, useDaemon, withSandbox } from "../harness.mjs";

// This whole file runs with E2B_API_KEY=e2b_<token>.
const daemon = useDaemon({ name: "e2bjsc", octet: 237, keyPrefix: "e2b_" });

// busybox-static has no adduser: the files it would write.
const addAlice = (sbx) =>
  sbx.commands.run(
    "echo alice:x:1000:1000::/home/alice:/bin/sh >> /etc/passwd" +
      " && echo alice:x:1000: >> /etc/group && mkdir -p /home/alice && chown 1000:1000 /home/alice",
  );

test("a key of E2B's shape is the token", async () => {
  // This whole file runs with E2B_API_KEY=e2b_<token>.
  await withSandbox({}, async (sbx) => {
    assert.equal((await sbx.commands.run("echo ok")).stdout, "ok\n");
  });
  await assert.rejects(Sandbox.create({ apiKey: `e2b_${"0".repeat(64)}` }), /API key/i);
});

test("relative paths and commands start at the user's home", async () => {
  await withSandbox({}, async (sbx) => {
    assert.equal((await sbx.commands.run("pwd")).stdout, "/root\n");
    await sbx.commands.run("echo made > made.txt");
    assert.equal(await sbx.files.read("made.txt"), "made\n");
    assert.equal(await sbx.files.read("~/made.txt"), "made\n");
    const info = await sbx.files.write("rel/a.txt", "r");
    assert.equal(info.path, "/root/rel/a.txt");
    assert.equal((await sbx.commands.run("pwd", { cwd: "rel" })).stdout, "/root/rel\n");
    assert.equal((await sbx.files.getInfo("rel")).path, "/root/rel");
    assert.deepEqual((await sbx.files.list("rel")).map((e) => e.path), ["/root/rel/a.txt"]);
  });
});

test("what a user makes is theirs", async () => {
  await withSandbox({}, async (sbx) => {
    await addAlice(sbx);
    assert.equal((await sbx.commands.run("pwd", { user: "alice" })).stdout, "/home/alice\n");
    const info = await sbx.files.write("notes/a.txt", "hi", { user: "alice" });
    assert.equal(info.path, "/home/alice/notes/a.txt");
    for (const path of ["notes", "notes/a.txt"]) {
      const entry = await sbx.files.getInfo(path, { user: "alice" });
      assert.deepEqual([entry.owner, entry.group], ["alice", "alice"], path);
    }
    assert.equal(await sbx.files.makeDir("made/deep", { user: "alice" }), true);
    assert.equal((await sbx.files.getInfo("/home/alice/made/deep")).owner, "alice");
    await sbx.commands.run("touch made/deep/x notes/y", { user: "alice" });
    await sbx.files.makeDir("/srv/data");
    const root = await sbx.files.getInfo("/srv/data");
    assert.deepEqual([root.owner, root.group], ["root", "root"]);
  });
});

test("removing what is not there is done", async () => {
  await withSandbox({}, async (sbx) => {
    await sbx.files.remove("/tmp/never-was");
    await sbx.files.remove("never/was/either");
  });
});

test("a symlink reads as what it points at", async () => {
  await withSandbox({}, async (sbx) => {
    await sbx.files.write("/tmp/links/target.txt", "hello");
    await sbx.commands.run("ln -s target.txt link", { cwd: "/tmp/links" });
    const link = await sbx.files.getInfo("/tmp/links/link");
    assert.equal(link.type, "file");
    assert.equal(link.size, 5);
    assert.equal(link.symlinkTarget, "/tmp/links/target.txt");
  });
});

test("an upload is seen as envd makes files", async () => {
  await withSandbox({}, async (sbx) => {
    await sbx.files.makeDir("/tmp/seen");
    const seen = [];
    const handle = await sbx.files.watchDir("/tmp/seen", (e) => seen.push([e.name, e.type]));
    try {
      await sbx.files.write("/tmp/seen/new.txt", "x");
      for (let i = 0; i < 100 && seen.length < 3; i++) await sleep(50);
      assert.deepEqual(seen, [
        ["new.txt", "create"],
        ["new.txt", "chmod"],
        ["new.txt", "write"],
      ]);
    } finally {
      await handle.stop();
    }
  });
});

test("listing is newest first and its filters apply", async () => {
  const metadata = { suite: `order-${process.hrtime.bigint()}` };
  const first = await Sandbox.create({ timeoutMs: 120_000, metadata });
  const second = await Sandbox.create({ timeoutMs: 120_000, metadata });
  try {
    const ids = async (opts) => (await Sandbox.list(opts).nextItems()).map((s) => s.sandboxId);
    assert.deepEqual(await ids({ query: { metadata } }), [second.sandboxId, first.sandboxId]);
    assert.deepEqual(await ids({ query: { metadata }, order: "asc" }), [first.sandboxId, second.sandboxId]);
    const startedAfter = (await second.getInfo()).startedAt;
    assert.deepEqual(await ids({ query: { metadata, startedAfter } }), [second.sandboxId]);
    const later = new Date(startedAfter.getTime() + 1000);
    assert.deepEqual(await ids({ query: { metadata, startedAfter: later } }), []);
    assert.equal((await ids({ query: { metadata, template: "base" } })).length, 2);
    assert.deepEqual(await ids({ query: { metadata, template: "elsewhere" } }), []);
  } finally {
    await first.kill();
    await second.kill();
  }
});

test("snapshots are listed, found and deleted", async () => {
  await withSandbox({}, async (sbx) => {
    const named = await sbx.createSnapshot({ name: `snap-js-${sbx.sandboxId.toLowerCase()}` });
    const plain = await sbx.createSnapshot();
    const ids = async (opts) => (await Sandbox.listSnapshots(opts).nextItems()).map((s) => s.snapshotId);
    try {
      // Newest first, to the second images record: these two may tie.
      const mine = await ids({ sandboxId: sbx.sandboxId });
      assert.deepEqual([...mine].sort(), [plain.snapshotId, named.snapshotId].sort());
      const pager = Sandbox.listSnapshots({ sandboxId: sbx.sandboxId, limit: 1 });
      const paged = [...(await pager.nextItems()), ...(await pager.nextItems())].map((s) => s.snapshotId);
      assert.deepEqual(paged, mine);
      assert.equal(pager.hasNext, false);
      assert.deepEqual(await ids({ name: named.snapshotId }), [named.snapshotId]);
      assert.deepEqual(await ids({ name: `${named.snapshotId}-none` }), []);
    } finally {
      assert.equal(await Sandbox.deleteSnapshot(named.snapshotId), true);
      assert.equal(await Sandbox.deleteSnapshot(plain.snapshotId), true);
    }
    assert.equal(await Sandbox.deleteSnapshot(plain.snapshotId), false);
    assert.deepEqual(await ids({ sandboxId: sbx.sandboxId }), []);
    assert.equal(await Sandbox.deleteSnapshot("base"), false);
  });
});

test("a sandbox killed under a command breaks its stream", async () => {
  const sbx = await Sandbox.create({ timeoutMs: 60_000 });
  const cmd = await sbx.commands.run("sleep 60", { background: true });
  await sbx.kill();
  await assert.rejects(cmd.wait(), (e) => {
    assert.doesNotMatch(String(e), /exit status 137/);
    return true;
  });
});

test("metrics keep a history that windows select", async () => {
  await withSandbox({}, async (sbx) => {
    const begun = new Date(Date.now() - 60_000);
    let got = [];
    // The sampler takes every running sandbox every 5 s.
    for (let i = 0; i < 60 && got.length === 0; i++) {
      got = await sbx.getMetrics({ start: begun, end: new Date() });
      if (got.length === 0) await sleep(500);
    }
    assert.ok(got.length > 0, "no sample within 30 s");
    assert.ok(got.every((m) => m.timestamp.getTime() >= begun.getTime() - 1000));
    const past = await sbx.getMetrics({
      start: new Date(begun.getTime() - 3_600_000),
      end: new Date(begun.getTime() - 1_800_000),
    });
    assert.deepEqual(past, []);
  });
});

test("file metadata is kept with the file", async () => {
  await withSandbox({}, async (sbx) => {
    const metadata = { author: "mish", purpose: "upload" };
    const info = await sbx.files.write("/tmp/meta/a.txt", "x", { metadata });
    assert.deepEqual(info.metadata, metadata);
    assert.deepEqual((await sbx.files.getInfo("/tmp/meta/a.txt")).metadata, metadata);
    const listed = await sbx.files.list("/tmp/meta");
    assert.deepEqual(listed.find((e) => e.name === "a.txt").metadata, metadata);
    assert.deepEqual((await sbx.files.rename("/tmp/meta/a.txt", "/tmp/meta/b.txt")).metadata, metadata);
    await sbx.files.write("/tmp/meta/b.txt", "y");
    assert.equal((await sbx.files.getInfo("/tmp/meta/b.txt")).metadata, undefined);
  });
});

test("watch events can carry their entry", async () => {
  await withSandbox({}, async (sbx) => {
    await sbx.files.makeDir("/tmp/entries");
    const seen = [];
    const handle = await sbx.files.watchDir("/tmp/entries", (e) => seen.push(e), { includeEntry: true });
    try {
      await sbx.files.write("/tmp/entries/f.txt", "12345");
      for (let i = 0; i < 100 && seen.length < 3; i++) await sleep(50);
      const write = seen.filter((e) => e.type === "write").at(-1);
      assert.ok(write?.entry, JSON.stringify(seen));
      assert.equal(write.entry.path, "/tmp/entries/f.txt");
      assert.equal(write.entry.size, 5);
    } finally {
      await handle.stop();
    }
  });
});

// A GET through the daemon with the Host header set (fetch will not set it).
async function getWithHost(host, path, headers = {}) {
  const { request } = await import("node:http");
  const url = new URL(path, daemon().url);
  return await new Promise((resolve, reject) => {
    const req = request(url, { headers: { ...headers, host } }, (res) => {
      let body = "";
      res.on("data", (d) => (body += d));
      res.on("end", () => resolve({ status: res.statusCode, body }));
    });
    req.on("error", reject);
    req.end();
  });
}

async function serveHttp(sbx, port) {
  await sbx.commands.run(`mkdir -p /tmp/www && echo hello-from-${port} > /tmp/www/index.html`);
  await sbx.commands.run(`httpd -f -p ${port} -h /tmp/www`, { background: true });
  await sleep(300);
}

test("any port is reachable by E2B's host addressing", async () => {
  const open = await Sandbox.create({ timeoutMs: 120_000 });
  const closed = await Sandbox.create({ timeoutMs: 120_000, network: { allowPublicTraffic: false } });
  try {
    await serveHttp(open, 8001);
    await serveHttp(closed, 8001);
    assert.deepEqual(await getWithHost(open.getHost(8001), "/index.html"), {
      status: 200,
      body: "hello-from-8001\n",
    });
    assert.equal((await getWithHost(closed.getHost(8001), "/index.html")).status, 403);
    const withToken = await getWithHost(closed.getHost(8001), "/index.html", {
      "e2b-traffic-access-token": closed.trafficAccessToken,
    });
    assert.equal(withToken.status, 200);
  } finally {
    await open.kill();
    await closed.kill();
  }
  const gone = await getWithHost(open.getHost(8001), "/");
  assert.equal(gone.status, 502);
  assert.deepEqual(JSON.parse(gone.body), { code: 502, message: "The sandbox was not found", sandboxId: open.sandboxId });
});

test("signed file URLs work for secure sandboxes", async () => {
  await withSandbox({ secure: true }, async (sbx) => {
    await sbx.files.write("signed.txt", "through a signed URL");
    const ok = await fetch(await sbx.downloadUrl("signed.txt"));
    assert.equal(ok.status, 200);
    assert.equal(await ok.text(), "through a signed URL");
    const expired = await fetch(await sbx.downloadUrl("signed.txt", { useSignatureExpiration: -120 }));
    assert.equal(expired.status, 401);
    assert.deepEqual(await expired.json(), { code: 401, message: "signature is already expired" });
    const form = new FormData();
    form.append("file", new Blob(["sent up"]), "up.txt");
    const up = await fetch(await sbx.uploadUrl("up.txt"), { method: "POST", body: form });
    assert.equal(up.status, 200);
    assert.equal(await sbx.files.read("up.txt"), "sent up");
  });
});

test("a paused sandbox keeps its processes and memory, and connect resumes it", async () => {
  await withSandbox({}, async (sbx) => {
    await sbx.commands.run(
      "sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/n.new; mv /tmp/n.new /tmp/n; sleep 0.05; done'",
      { background: true },
    );
    await sleep(500);
    assert.equal(await sbx.pause(), true);
    assert.equal(await sbx.isRunning(), false);
    // Pausing again is a no-op the SDK reports as false (E2B answers 409).
    assert.equal(await Sandbox.pause(sbx.sandboxId), false);
    const paused = await Sandbox.list({ query: { state: ["paused"] } }).nextItems();
    assert.ok(paused.some((s) => s.sandboxId === sbx.sandboxId));
    assert.equal((await Sandbox.getInfo(sbx.sandboxId)).state, "paused");
    const resumed = await sbx.connect();
    assert.equal(resumed.sandboxId, sbx.sandboxId);
    assert.equal(await sbx.isRunning(), true);
    const first = Number(await sbx.files.read("/tmp/n"));
    await sleep(300);
    assert.ok(Number(await sbx.files.read("/tmp/n")) > first);
  });
});

test("a paused sandbox resumes on traffic only with autoResume", async () => {
  await withSandbox({}, async (plain) => {
    await withSandbox({ lifecycle: { onTimeout: "pause", autoResume: true } }, async (waking) => {
      for (const s of [plain, waking]) {
        await s.files.write("/tmp/x", "kept");
        assert.equal(await s.pause(), true);
      }
      assert.equal(await plain.isRunning(), false);
      assert.equal(await waking.files.read("/tmp/x"), "kept");
      assert.equal((await Sandbox.getInfo(waking.sandboxId)).state, "running");
      await Sandbox.connect(plain.sandboxId);
      assert.equal(await plain.files.read("/tmp/x"), "kept");
    });
  });
});

test("a filesystem-only pause keeps the files, and connect boots the sandbox again", async () => {
  await withSandbox({}, async (sbx) => {
    await sbx.files.write("/home/user/kept.txt", "kept");
    await sbx.commands.run("echo $$ > /tmp/pid; sleep 600", { background: true });
    await sleep(300);
    const pid = (await sbx.files.read("/tmp/pid")).trim();
    assert.equal(await sbx.pause({ keepMemory: false }), true);
    assert.equal(await sbx.isRunning(), false);
    assert.equal((await Sandbox.getInfo(sbx.sandboxId)).state, "paused");
    assert.equal(await Sandbox.pause(sbx.sandboxId), false);
    assert.equal((await sbx.connect()).sandboxId, sbx.sandboxId);
    assert.equal(await sbx.files.read("/home/user/kept.txt"), "kept");
    // The pid may be reused in the new sandbox: look for the command.
    const sleeping = await sbx.commands.run("cat /proc/[0-9]*/comm 2>/dev/null | grep -cx sleep || true");
    assert.equal(sleeping.stdout.trim(), "0", pid);
  });
});

test("a sandbox that hibernates at its timeout is kept, and connect boots it", async () => {
  await withSandbox({ lifecycle: { onTimeout: { action: "pause", keepMemory: false } } }, async (sbx) => {
    await sbx.files.write("/home/user/kept.txt", "kept");
    await sbx.setTimeout(0);
    const deadline = Date.now() + 15_000;
    while ((await Sandbox.getInfo(sbx.sandboxId)).state !== "paused") {
      assert.ok(Date.now() < deadline, "not paused at its timeout");
      await sleep(200);
    }
    assert.equal((await sbx.connect()).sandboxId, sbx.sandboxId);
    assert.equal(await sbx.files.read("/home/user/kept.txt"), "kept");
  });
});

test("an archived sandbox is paused to the SDK, and connect restores it", async () => {
  await withSandbox({}, async (sbx) => {
    await sbx.files.write("/home/user/kept.txt", "kept");
    // runbox's archive: its disk to the checkpoint store, nothing on the node.
    const archived = await fetch(`${process.env.E2B_API_URL}/v1/runs/${sbx.sandboxId}/archive`, {
      method: "POST",
      headers: { Authorization: `Bearer ${process.env.E2B_API_KEY.replace(/^e2b_/, "")}` },
    });
    assert.equal(archived.status, 200, await archived.clone().text());
    assert.equal((await archived.json()).status, "archived");
    assert.equal(await sbx.isRunning(), false);
    assert.equal((await Sandbox.getInfo(sbx.sandboxId)).state, "paused");
    assert.equal((await sbx.connect()).sandboxId, sbx.sandboxId);
    assert.equal(await sbx.files.read("/home/user/kept.txt"), "kept");
  });
});

test("a sandbox that pauses at its timeout is kept, and connect wakes it", async () => {
  await withSandbox({ lifecycle: { onTimeout: "pause" } }, async (sbx) => {
    await sbx.commands.run("echo $$ > /tmp/pid; sleep 600", { background: true });
    const pid = (await sbx.files.read("/tmp/pid")).trim();
    await sbx.setTimeout(0);
    const deadline = Date.now() + 15_000;
    while ((await Sandbox.getInfo(sbx.sandboxId)).state !== "paused") {
      assert.ok(Date.now() < deadline, "not paused at its timeout");
      await sleep(200);
    }
    assert.equal((await sbx.connect()).sandboxId, sbx.sandboxId);
    assert.equal((await sbx.commands.run(`kill -0 ${pid} && echo alive`)).stdout, "alive\n");
  });
});

test("volumes through E2B's volume API", async () => {
  const vol = await Volume.create("e2b-js-vol");
  try {
    assert.equal(vol.name, "e2b-js-vol");
    assert.ok(vol.token);
    assert.deepEqual((await Volume.list()).map((v) => v.name), ["e2b-js-vol"]);
    const info = await Volume.getInfo(vol.volumeId);
    assert.equal(info.token, vol.token);

    const dir = await vol.makeDir("/data");
    assert.equal(dir.type, "directory");
    const written = await vol.writeFile("/data/a.txt", "hello", { uid: 1000, gid: 1000, mode: 0o640 });
    assert.deepEqual([written.path, written.size, written.uid, written.mode], ["/data/a.txt", 5, 1000, 0o640]);
    assert.equal(await vol.readFile("/data/a.txt"), "hello");
    assert.equal(await vol.exists("/data/a.txt"), true);
    assert.equal(await vol.exists("/nope"), false);
    await assert.rejects(vol.writeFile("/data/a.txt", "again"));
    await vol.writeFile("/data/a.txt", "again!", { force: true, uid: 1000, gid: 1000 });
    await assert.rejects(vol.makeDir("/x/y"));
    await vol.makeDir("/x/y", { force: true });
    const listed = await vol.list("/", { depth: 2 });
    assert.deepEqual(listed.map((e) => e.path).sort(), ["/data", "/data/a.txt", "/x", "/x/y"]);
    const updated = await vol.updateMetadata("/data/a.txt", { mode: 0o600 });
    assert.equal(updated.mode, 0o600);
    await vol.remove("/x");
    assert.equal(await vol.exists("/x/y"), false);

    const connected = await Volume.connect(vol.volumeId);
    assert.equal(await connected.readFile("/data/a.txt"), "again!");

    await withSandbox({ volumeMounts: { "/mnt/v": vol } }, async (sbx) => {
      const out = await sbx.commands.run("cat /mnt/v/data/a.txt; stat -c %u /mnt/v/data/a.txt");
      assert.equal(out.stdout, "again!1000\n");
      await sbx.commands.run("echo from-sandbox > /mnt/v/out.txt");
      assert.equal(await vol.readFile("/out.txt"), "from-sandbox\n");
      await assert.rejects(vol.writeFile("/late.txt", "x"), /mounted/);
    });
  } finally {
    assert.equal(await Volume.destroy(vol.volumeId), true);
  }
  assert.equal(await Volume.destroy(vol.volumeId), false);
  await assert.rejects(Volume.getInfo(vol.volumeId));
});
