// Retries of what is safe to repeat: the decision itself (pure logic,
// dist/retry.js), then for real against a daemon at its capacity
// (--max-runs 1) and a port nothing listens on.
import assert from "node:assert/strict";
import net from "node:net";
import { after, before, describe, test } from "node:test";

import { Runbox, RunboxError, Unavailable } from "../dist/index.js";
import { RetryPolicy, failureKind, newIdempotencyKey, retryAfterMs } from "../dist/retry.js";
import { Daemon } from "./daemon.mjs";

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
// Node's timers may fire a millisecond early as Date.now() sees it.
const atLeast = (started, ms) => assert.ok(Date.now() - started >= ms - 5, `took ${Date.now() - started} ms, not ${ms}`);

// -- the decision -------------------------------------------------------------

const ID = "01JZ3K8Q4M7T2V9XGH5R6NB0CD";
const GET = { method: "GET", path: `/v1/runs/${ID}` };
const HEAD = { method: "HEAD", path: "/health" };
const DELETE = { method: "DELETE", path: `/v1/runs/${ID}` };
const KEYED_CREATE = { method: "POST", path: "/v1/runs", headers: { "Idempotency-Key": "k1" }, body: '{"image":"base"}' };
const UNKEYED_CREATE = { method: "POST", path: "/v1/runs", headers: {}, body: '{"image":"base"}' };
const FORK = { method: "POST", path: `/v1/runs/${ID}/fork`, body: "{}" };
const WAKE = { method: "POST", path: `/v1/runs/${ID}/wake` };
const EXEC = { method: "POST", path: `/v1/runs/${ID}/exec`, body: '{"cmd":["true"]}' };
const PUT = { method: "PUT", path: `/v1/runs/${ID}/files/a`, body: new Uint8Array([1, 2]) };
const PUT_BLOB = { method: "PUT", path: `/v1/runs/${ID}/files/a`, body: new Blob(["x"]) };
const PATCH = { method: "PATCH", path: "/v1/tenants/acme", body: "{}" };
const STREAMED = { method: "PUT", path: `/v1/runs/${ID}/files/a`, body: new ReadableStream() };

test("which answers are sent again, and after how long", () => {
  const policy = new RetryPolicy();
  const cases = [
    // Safe to repeat, and the server said when: after that long.
    [GET, 429, "1", 1000],
    [GET, 503, "30", 30_000],
    [HEAD, 429, "2", 2000],
    [DELETE, 429, "1", 1000],
    [DELETE, 503, "0", 0],
    [KEYED_CREATE, 429, "1", 1000],
    [{ ...KEYED_CREATE, headers: { "idempotency-key": "k" } }, 503, " 30 ", 30_000],
    // Each wait is capped.
    [GET, 503, "3600", 30_000],
    // A POST other than a keyed create, a PUT, a PATCH may have done
    // something: never repeated once answered.
    [UNKEYED_CREATE, 429, "1", undefined],
    [{ ...KEYED_CREATE, headers: { "Idempotency-Key": "" } }, 429, "1", undefined],
    [FORK, 429, "1", undefined],
    [WAKE, 429, "1", undefined],
    [EXEC, 503, "1", undefined],
    [PUT, 503, "1", undefined],
    [PATCH, 503, "1", undefined],
    [{ ...STREAMED, method: "GET" }, 503, "1", undefined],
    // Only 429 and 503, and only with a Retry-After that can be read.
    [GET, 429, null, undefined],
    [KEYED_CREATE, 503, undefined, undefined],
    [GET, 429, "soon", undefined],
    [GET, 429, "-1", undefined],
    [GET, 429, "1.5", undefined],
    [GET, 500, "1", undefined],
    [GET, 502, "1", undefined],
    [GET, 404, "1", undefined],
    [KEYED_CREATE, 409, "1", undefined],
  ];
  for (const [request, status, retryAfter, wait] of cases) {
    assert.equal(policy.afterAnswer(request, status, retryAfter, 0), wait, `${request.method} ${request.path} ${status} ${retryAfter}`);
  }
});

test("Retry-After may be a date", () => {
  const now = Date.parse("2030-01-01T12:00:00Z");
  assert.equal(retryAfterMs(new Date(now + 7000).toUTCString(), now), 7000);
  assert.equal(retryAfterMs(new Date(now - 7000).toUTCString(), now), 0);
  assert.equal(retryAfterMs("17"), 17_000);
  assert.equal(retryAfterMs(""), undefined);
  assert.equal(retryAfterMs("2030-01-01"), undefined);
});

/** An error shaped as Node's fetch throws it. */
const fetchFailed = (code) => new TypeError("fetch failed", { cause: Object.assign(new Error(code), { code }) });

test("which failures are sent again", () => {
  const policy = new RetryPolicy();
  const refused = failureKind(fetchFailed("ECONNREFUSED"));
  const lost = failureKind(fetchFailed("UND_ERR_SOCKET"));
  assert.equal(refused, "connect");
  assert.equal(lost, "lost");
  assert.equal(failureKind(fetchFailed("ECONNRESET")), "lost");
  assert.equal(failureKind(fetchFailed("UND_ERR_CONNECT_TIMEOUT")), "connect");
  // Several addresses tried: an AggregateError of them.
  assert.equal(failureKind(new TypeError("fetch failed", { cause: new AggregateError([fetchFailed("ECONNREFUSED").cause]) })), "connect");
  assert.equal(failureKind(new TypeError("fetch failed")), undefined);
  assert.equal(failureKind(new DOMException("aborted", "AbortError")), undefined);
  const cases = [
    // Never reached the server: any method, after the first backoff.
    [GET, refused, 200],
    [EXEC, refused, 200],
    [FORK, refused, 200],
    [PUT, refused, 200],
    [PUT_BLOB, refused, 200],
    [PATCH, refused, 200],
    [UNKEYED_CREATE, refused, 200],
    // The answer lost on the way: only what reads, and keyed creates.
    [GET, lost, 200],
    [HEAD, lost, 200],
    [KEYED_CREATE, lost, 200],
    [UNKEYED_CREATE, lost, undefined],
    [DELETE, lost, undefined],
    [EXEC, lost, undefined],
    [PUT, lost, undefined],
    // What the runtime does not explain (a timeout, an abort).
    [GET, undefined, undefined],
    // A stream the first attempt consumed is never sent again.
    [STREAMED, refused, undefined],
  ];
  for (const [request, failure, wait] of cases) {
    assert.equal(policy.afterFailure(request, failure, 0), wait, `${request.method} ${request.path} ${failure}`);
  }
});

test("a call that met a moving run is sent again whatever its method", () => {
  const policy = new RetryPolicy();
  assert.equal(policy.afterAnswer(EXEC, 503, "1", 0, "run_moved"), 1000);
  assert.equal(policy.afterAnswer(EXEC, 503, "1", 0, "draining"), undefined);
  assert.equal(policy.afterAnswer(STREAMED, 503, "1", 0, "run_moved"), undefined);
  assert.equal(policy.afterAnswer(EXEC, 409, "1", 0, "run_moved"), undefined);
});

test("backoff doubles and retries are bounded", () => {
  const policy = new RetryPolicy();
  assert.deepEqual([0, 1, 2, 3].map((n) => policy.afterFailure(EXEC, "connect", n)), [200, 400, 800, undefined]);
  assert.deepEqual([0, 1, 2, 3].map((n) => policy.afterAnswer(GET, 429, "1", n)), [1000, 1000, 1000, undefined]);
  const off = new RetryPolicy(0);
  assert.equal(off.afterFailure(GET, "connect", 0), undefined);
  assert.equal(off.afterAnswer(KEYED_CREATE, 429, "1", 0), undefined);
  const short = new RetryPolicy(5, 500);
  assert.deepEqual([0, 1, 2, 3, 4, 5].map((n) => short.afterFailure(GET, "connect", n)), [200, 400, 500, 500, 500, undefined]);
  assert.equal(short.afterAnswer(GET, 503, "30", 0), 500);
  assert.throws(() => new Runbox({ url: "http://127.0.0.1:1", token: "t", maxRetries: -1 }), (e) => e instanceof RunboxError && e.code === "bad_request");
  assert.throws(() => new Runbox({ url: "http://127.0.0.1:1", token: "t", maxRetries: 1.5 }), RunboxError);
});

test("every create has a key of its own", async () => {
  const keys = new Set(await Promise.all([1, 2, 3].map(() => newIdempotencyKey())));
  assert.equal(keys.size, 3);
  for (const key of keys) assert.ok(/^[\x21-\x7e]{1,128}$/.test(key));
});

test("failureKind reads the errors Node's fetch really throws", async () => {
  // A connection refused, and one closed without an answer.
  const port = await freePort();
  const refused = await fetch(`http://127.0.0.1:${port}/`).catch((e) => e);
  assert.equal(failureKind(refused), "connect");
  const rude = net.createServer((socket) => socket.once("data", () => socket.destroy()));
  await new Promise((r) => rude.listen(0, "127.0.0.1", r));
  try {
    const lost = await fetch(`http://127.0.0.1:${rude.address().port}/`).catch((e) => e);
    assert.equal(failureKind(lost), "lost");
  } finally {
    rude.close();
  }
});

// -- a daemon at its capacity ---------------------------------------------------

/** A fetch that notes what it sent and was answered. */
function observing(seen) {
  return async (url, init) => {
    const response = await fetch(url, init);
    seen.push({ method: init.method, path: new URL(url).pathname, key: init.headers?.["Idempotency-Key"], status: response.status });
    return response;
  };
}

const creates = (seen) => seen.filter((a) => a.method === "POST" && a.path === "/v1/runs");

describe("a daemon at its capacity", () => {
  let daemon;
  let rb;

  before(async () => {
    // One run at most: a second create answers 429 capacity, Retry-After: 1.
    daemon = await Daemon.start({ name: "tscap", octet: 242, args: ["--max-runs", "1"] });
    rb = new Runbox({ url: daemon.url, token: daemon.token });
  });

  after(() => daemon?.stop());

  test("a create at capacity is sent again until there is room", async () => {
    const seen = [];
    const waiting = new Runbox({ url: daemon.url, token: daemon.token, fetch: observing(seen) });
    const first = await rb.createRun("base");
    const started = Date.now();
    let settled = false;
    const second = waiting.createRun("base");
    second.then(
      () => (settled = true),
      () => (settled = true),
    );
    // Refused while the first run lives; it ends ~0.3 s later.
    while (!seen.some((a) => a.status === 429)) {
      assert.ok(Date.now() - started < 30_000, "the second create was never refused");
      await sleep(20);
    }
    await sleep(Math.max(0, 300 - (Date.now() - started)));
    assert.equal(settled, false);
    await rb.deleteRun(first.id);
    const run = await second;
    try {
      assert.equal(run.status, "running");
      // It waited out Retry-After: 1 before trying again.
      atLeast(started, 1000);
      const sent = creates(seen);
      assert.equal(sent[0].status, 429);
      assert.equal(sent.at(-1).status, 201);
      assert.ok(sent.slice(0, -1).every((c) => c.status === 429), JSON.stringify(sent));
      // Every attempt was the same create: one key.
      assert.ok(sent[0].key);
      assert.equal(new Set(sent.map((c) => c.key)).size, 1);
      // No second run from a repeated create.
      assert.deepEqual((await rb.listRuns()).map((r) => r.id), [run.id]);
    } finally {
      await rb.deleteRun(run.id);
    }
  });

  test("without retries a create at capacity fails at once", async () => {
    const seen = [];
    const impatient = new Runbox({ url: daemon.url, token: daemon.token, fetch: observing(seen), maxRetries: 0 });
    const first = await rb.createRun("base");
    try {
      const started = Date.now();
      await assert.rejects(impatient.createRun("base"), (e) => {
        assert.ok(e instanceof Unavailable, `${e} is not Unavailable`);
        assert.equal(e.status, 429);
        assert.equal(e.code, "capacity");
        return true;
      });
      // Not after Retry-After: 1.
      assert.ok(Date.now() - started < 1000);
      assert.deepEqual(creates(seen).map((c) => c.status), [429]);
      assert.deepEqual((await rb.listRuns()).map((r) => r.id), [first.id]);
    } finally {
      await rb.deleteRun(first.id);
    }
    // Each create has a key of its own.
    const again = await impatient.createRun("base");
    await rb.deleteRun(again.id);
    const keys = creates(seen).map((c) => c.key);
    assert.equal(keys.length, 2);
    assert.notEqual(keys[0], keys[1]);
  });
});

// -- nothing listening ------------------------------------------------------------

/** A port nothing listens on (it did a moment ago). */
async function freePort() {
  const server = net.createServer();
  await new Promise((r) => server.listen(0, "127.0.0.1", r));
  const { port } = server.address();
  await new Promise((r) => server.close(r));
  return port;
}

test("a daemon that is not there is tried again, then given up", async () => {
  const url = `http://127.0.0.1:${await freePort()}`;
  const attempts = [];
  const counting = (target, init) => {
    attempts.push(init.method);
    return fetch(target, init);
  };
  let started = Date.now();
  const rb = new Runbox({ url, token: "t", fetch: counting, maxRetries: 2 });
  // Any method: the request never reached a server. 200 ms, then 400 ms.
  await assert.rejects(rb.renewRun(ID, 60), (e) => e instanceof RunboxError && e.status === 0 && e.code === "unreachable");
  atLeast(started, 600);
  assert.deepEqual(attempts, ["POST", "POST", "POST"]);
  // A stream's request too.
  attempts.length = 0;
  started = Date.now();
  await assert.rejects(rb.run(ID, "true"), (e) => e instanceof RunboxError && e.code === "unreachable");
  atLeast(started, 600);
  assert.equal(attempts.length, 3);
  // The default: three retries, 200 + 400 + 800 ms.
  started = Date.now();
  await assert.rejects(new Runbox({ url, token: "t" }).createRun("base"), (e) => e instanceof RunboxError && e.code === "unreachable");
  atLeast(started, 1400);
  // Turned off: one attempt.
  attempts.length = 0;
  await assert.rejects(new Runbox({ url, token: "t", fetch: counting, maxRetries: 0 }).health(), (e) => e.code === "unreachable");
  assert.deepEqual(attempts, ["GET"]);
});
