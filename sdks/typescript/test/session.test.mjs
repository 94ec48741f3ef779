// WebSocket sessions: a terminal, stdin to cat, an attach, and refusals,
// through the `ws` package and (where Node has one) the global WebSocket,
// both with the token as a subprotocol.
import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import WebSocket from "ws";

import { NotFound, Runbox, Unauthorized } from "../dist/index.js";
import { Daemon } from "./daemon.mjs";

let daemon;
let run;
const text = (bytes) => new TextDecoder().decode(bytes);

before(async () => {
  daemon = await Daemon.start();
  run = await new Runbox({ url: daemon.url, token: daemon.token }).createRun("base");
});

after(() => daemon?.stop());

const implementations = [["the ws package", WebSocket]];
if (globalThis.WebSocket) implementations.push(["the global WebSocket", globalThis.WebSocket]);

for (const [name, impl] of implementations) {
  describe(`sessions through ${name}`, () => {
    const client = () => new Runbox({ url: daemon.url, token: daemon.token, WebSocket: impl });

    test("a terminal session sees its size and typed input", async () => {
      const s = await client().openSession(run.id, "stty size; read line; echo got=$line; exit 5", { pty: { rows: 12, cols: 34 } });
      assert.ok(s.pid > 1);
      s.send("typed\r");
      const result = await s.wait();
      assert.match(result.text, /12 34/);
      assert.match(result.text, /got=typed/);
      assert.equal(result.exitCode, 5);
    });

    test("stdin streams to cat, then closes", async () => {
      const s = await client().openSession(run.id, ["cat"]);
      s.send(new TextEncoder().encode("one "));
      s.send("two");
      s.eof();
      assert.equal((await s.wait()).text, "one two");
    });

    test("^C reaches the terminal's foreground job; resize reaches stty", async () => {
      const s = await client().openSession(run.id, "sh", { pty: { rows: 24, cols: 80 } });
      s.resize(40, 100);
      s.send("stty size\r");
      let seen = "";
      const events = s.events();
      while (!seen.includes("40 100")) seen += text((await events.next()).value.data ?? new Uint8Array());
      s.send("sleep 60\r");
      // ^C flushes what was typed ahead, so the echo goes with each press;
      // pressed until the shell reports sleep's 130.
      const ticker = setInterval(() => s.send("\x03echo back=$?\r"), 200);
      while (!/back=130/.test(seen)) seen += text((await events.next()).value.data ?? new Uint8Array());
      clearInterval(ticker);
      s.send("exit 0\r");
      for await (const event of events) if (event.type === "exit") assert.equal(event.exitCode, 0);
    });

    test("attach to a background process, detach, and it keeps running", async () => {
      const rb = client();
      const tag = `echo-${name.length}`;
      await rb.startProcess(run.id, "echo first; while read l; do echo echo:$l; done", { tag, openStdin: true });
      const s = await rb.attach(run.id, tag);
      s.send("ping\n");
      let seen = "";
      for await (const event of s.events()) {
        if (event.type === "stdout") seen += text(event.data);
        if (seen.includes("echo:ping")) break;
      }
      s.close();
      assert.ok(seen.startsWith("first\n"), seen);
      assert.equal((await rb.process(run.id, tag)).running, true);
      await rb.signalProcess(run.id, tag, "TERM");
    });

    test("a refused session says why", async () => {
      await assert.rejects(client().attach(run.id, "no-such-tag"), (e) => e instanceof NotFound && e.code === "process_not_found");
      await assert.rejects(client().openSession("01JZ3K8Q4M7T2V9XGH5R6NB0CD", ["true"]), (e) => e instanceof NotFound && e.code === "run_not_found");
      const bad = new Runbox({ url: daemon.url, token: "wrong", WebSocket: impl });
      await assert.rejects(bad.openSession(run.id, ["true"]), (e) => e instanceof Unauthorized);
      // A failed start arrives as the session's first frame.
      await assert.rejects(client().openSession(run.id, ["no-such-command"]), (e) => e.code === "command_not_found");
    });
  });
}
