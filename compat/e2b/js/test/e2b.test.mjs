// The E2B JavaScript SDK, unmodified, against runbox: E2B_API_URL and
// E2B_SANDBOX_URL name the runbox listener, E2B_API_KEY is its token.
import assert from "node:assert/strict";
import { test } from "node:test";

import { CommandExitError, Sandbox, TimeoutError } from "e2b";

import { sleep, useDaemon, withSandbox } from "../harness.mjs";

// Loopback upstreams on 127.0.0.7 and .8 stand for the internet in the
// network test; the proxy refuses loopback unless admitted.
// An egress proxy (microsocks) on 127.0.0.9 stands for a customer's SOCKS5
// exit; the operator admits it.
useDaemon({
  name: "e2bjs",
  octet: 236,
  args: ["--egress-internal-allow", "127.0.0.0/8", "--egress-upstream-allow", "127.0.0.9"],
});

test("create, run, kill", async () => {
  const sbx = await Sandbox.create({ timeoutMs: 120_000, envs: { GREETING: "hello" }, metadata: { suite: "js" } });
  try {
    const r = await sbx.commands.run("echo $GREETING; echo oops >&2");
    assert.equal(r.stdout, "hello\n");
    assert.equal(r.stderr, "oops\n");
    assert.equal(r.exitCode, 0);
    await assert.rejects(sbx.commands.run("exit 4"), (e) => e instanceof CommandExitError && e.exitCode === 4);
    const info = await sbx.getInfo();
    assert.equal(info.sandboxId, sbx.sandboxId);
    assert.deepEqual(info.metadata, { suite: "js" });
    assert.equal(await sbx.isRunning(), true);
  } finally {
    assert.equal(await sbx.kill(), true);
  }
  assert.equal(await sbx.isRunning(), false);
});

test("background commands, stdin, streamed output", async () => {
  await withSandbox({}, async (sbx) => {
    const lines = [];
    const h = await sbx.commands.run("for i in 1 2 3; do echo $i; sleep 0.1; done", {
      background: true,
      onStdout: (d) => lines.push(d),
    });
    const done = await h.wait();
    assert.equal(done.stdout, "1\n2\n3\n");
    assert.equal(lines.join(""), "1\n2\n3\n");

    const cat = await sbx.commands.run("cat", { background: true, stdin: true });
    await sbx.commands.sendStdin(cat.pid, "from js\n");
    await sbx.commands.closeStdin(cat.pid);
    assert.equal((await cat.wait()).stdout, "from js\n");

    const sleeper = await sbx.commands.run("sleep 60", { background: true });
    assert.ok((await sbx.commands.list()).some((p) => p.pid === sleeper.pid));
    assert.equal(await sbx.commands.kill(sleeper.pid), true);
    assert.equal(await sbx.commands.kill(sleeper.pid), false);

    await assert.rejects(sbx.commands.run("sleep 30", { timeoutMs: 1000 }), (e) => e instanceof TimeoutError);
  });
});

test("a pty session", async () => {
  await withSandbox({}, async (sbx) => {
    const chunks = [];
    const pty = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => chunks.push(Buffer.from(d)) });
    await sbx.pty.resize(pty.pid, { cols: 132, rows: 50 });
    await sbx.pty.sendInput(pty.pid, new TextEncoder().encode("stty size; echo js-$((20+22))\nexit\n"));
    await pty.wait();
    const text = Buffer.concat(chunks).toString();
    assert.match(text, /50 132/);
    assert.match(text, /js-42/);
  });
});

test("files and watching", async () => {
  await withSandbox({}, async (sbx) => {
    await sbx.files.makeDir("/srv/app");
    const events = [];
    const watcher = await sbx.files.watchDir("/srv/app", (e) => events.push([e.name, e.type]));
    try {
      const info = await sbx.files.write("/srv/app/index.js", "console.log(1)");
      assert.equal(info.path, "/srv/app/index.js");
      assert.equal(await sbx.files.read("/srv/app/index.js"), "console.log(1)");
      const bytes = new Uint8Array(70_000).map((_, i) => i % 251);
      await sbx.files.write("/srv/app/blob", bytes.buffer);
      assert.deepEqual(new Uint8Array(await sbx.files.read("/srv/app/blob", { format: "bytes" })), bytes);
      const names = (await sbx.files.list("/srv/app")).map((e) => e.name).sort();
      assert.deepEqual(names, ["blob", "index.js"]);
      assert.equal(await sbx.files.exists("/srv/app/nope"), false);
      await sbx.files.remove("/srv/app/blob");
      for (let i = 0; i < 100 && !events.some(([n, t]) => n === "blob" && t === "remove"); i++) await sleep(100);
      assert.ok(events.some(([n, t]) => n === "index.js" && t === "create"), JSON.stringify(events));
      assert.ok(events.some(([n, t]) => n === "blob" && t === "remove"), JSON.stringify(events));
    } finally {
      await watcher.stop();
    }
  });
});

test("timeout, list, and what is not supported", async () => {
  await withSandbox({ metadata: { team: "js-list" } }, async (sbx) => {
    const before = (await sbx.getInfo()).endAt;
    await sbx.setTimeout(1_800_000);
    assert.ok((await sbx.getInfo()).endAt > before);
    const page = await Sandbox.list({ query: { metadata: { team: "js-list" } } }).nextItems();
    assert.deepEqual(page.map((s) => s.sandboxId), [sbx.sandboxId]);
    await assert.rejects(Sandbox.create({ apiKey: "e2b_wrong" }), /401|API key/i);
  });
});

test("network allowOut and denyOut, and live updates", async () => {
  const { createServer } = await import("node:http");
  const servers = await Promise.all(
    ["127.0.0.7", "127.0.0.8"].map(
      (ip) =>
        new Promise((resolve) => {
          const server = createServer((_, res) => res.end(`hello from ${ip}`));
          server.listen(0, ip, () => resolve(server));
        }),
    ),
  );
  const [a, b] = servers.map((s) => s.address());
  // busybox wget goes through the proxy named in http_proxy.
  const fetch = (sbx, { address, port }) => sbx.commands.run(`wget -q -O - http://${address}:${port}/`);
  try {
    await withSandbox({ network: { denyOut: ["0.0.0.0/0"], allowOut: [a.address] } }, async (sbx) => {
      assert.equal((await fetch(sbx, a)).stdout, `hello from ${a.address}`);
      await assert.rejects(fetch(sbx, b), CommandExitError);
      await sbx.updateNetwork({ denyOut: ["0.0.0.0/0"], allowOut: [b.address] });
      assert.equal((await fetch(sbx, b)).stdout, `hello from ${b.address}`);
      await assert.rejects(fetch(sbx, a), CommandExitError);
      await sbx.updateNetwork({ allowInternetAccess: false });
      await assert.rejects(fetch(sbx, b), CommandExitError);
      await assert.rejects(sbx.updateNetwork({}), /400/);
    });
    await assert.rejects(Sandbox.create({ network: { denyOut: ["8.8.8.8"] } }), /0\.0\.0\.0\/0/);
  } finally {
    for (const server of servers) server.close();
  }
});

test("network egressProxy tunnels the sandbox through SOCKS5", async () => {
  const { createServer } = await import("node:http");
  const { createServer: tcpServer } = await import("node:net");
  const { spawn } = await import("node:child_process");
  const server = await new Promise((resolve) => {
    const s = createServer((_, res) => res.end("hello from 127.0.0.7"));
    s.listen(0, "127.0.0.7", () => resolve(s));
  });
  const port = await new Promise((resolve) => {
    const probe = tcpServer();
    probe.listen(0, "127.0.0.9", () => {
      const { port } = probe.address();
      probe.close(() => resolve(port));
    });
  });
  let log = "";
  const socks = spawn("microsocks", ["-i", "127.0.0.9", "-p", String(port), "-u", "js-user", "-P", "js-pass-3e"]);
  socks.stdout.on("data", (d) => (log += d));
  socks.stderr.on("data", (d) => (log += d));
  const { connect } = await import("node:net");
  for (let i = 0; i < 100; i++) {
    const up = await new Promise((resolve) => {
      const c = connect(port, "127.0.0.9", () => (c.end(), resolve(true)));
      c.on("error", () => resolve(false));
    });
    if (up) break;
    await new Promise((r) => setTimeout(r, 50));
  }
  const target = server.address();
  const fetch = (sbx) => sbx.commands.run(`wget -q -O - http://${target.address}:${target.port}/`);
  const egressProxy = { address: `127.0.0.9:${port}`, username: "js-user", password: "js-pass-3e" };
  try {
    await withSandbox(
      { network: { denyOut: ["0.0.0.0/0"], allowOut: [target.address], egressProxy } },
      async (sbx) => {
        assert.equal((await fetch(sbx)).stdout, "hello from 127.0.0.7");
        assert.ok(log.includes(`connected to 127.0.0.7:${target.port}`), log);
        await sbx.updateNetwork({
          denyOut: ["0.0.0.0/0"],
          allowOut: [target.address],
          egressProxy: { ...egressProxy, password: "not-it" },
        });
        await assert.rejects(fetch(sbx), CommandExitError);
      },
    );
    await assert.rejects(
      Sandbox.create({ network: { denyOut: ["0.0.0.0/0"], allowOut: ["127.0.0.7"], egressProxy: { address: "10.9.9.9:1080" } } }),
      /400/,
    );
  } finally {
    socks.kill();
    server.close();
  }
});
