/** The client: one object per daemon, every call a method. */
import { BuildFailed, NotFound, RunboxError, StreamEnded, errorFrom } from "./errors.js";
import {
  DEFAULT_MAX_RETRIES,
  DEFAULT_MAX_RETRY_WAIT_MS,
  RetryPolicy,
  failureKind,
  newIdempotencyKey,
  sleep,
  type RetryRequest,
} from "./retry.js";
import { openSession, webSocketClass, type Session, type WebSocketConstructor } from "./session.js";
import { SseDecoder, execEvent } from "./sse.js";
import {
  OutputCollector,
  type Build,
  type BuildEvent,
  type BuildLog,
  type BuildStep,
  type BuildStepSpec,
  type CreateRunRequest,
  type ExecEvent,
  type ExecResult,
  type FileInfo,
  type FileList,
  type Health,
  type HistoryDiff,
  type HistoryList,
  type Image,
  type Info,
  type Lease,
  type LeaseCredential,
  type Preview,
  type Process,
  type PullEvent,
  type Run,
  type Snapshot,
  type Checkpoint,
  type CreateTenantRequest,
  type Tenant,
  type TenantToken,
  type UpdateEgressRequest,
  type UpdateTenantRequest,
  type UsageReport,
  type Volume,
  type VolumeMountRequest,
  type WatchEvent,
} from "./types.js";

export const DEFAULT_URL = "http://127.0.0.1:7439";
const USER_AGENT = "runbox-typescript/0.1";

export interface RunboxOptions {
  /** The daemon's address; default `RUNBOX_URL`, else `http://127.0.0.1:7439`. */
  url?: string;
  /**
   * The API token; default `RUNBOX_TOKEN`, else (on Node) the daemon's
   * token file in `RUNBOX_STATE_DIR` (default `/var/lib/runbox`).
   */
  token?: string;
  /**
   * How long a plain call may take, in milliseconds (default 60000), its
   * retries and their waits included. Streams are not bounded.
   */
  timeoutMs?: number;
  /**
   * How many more times a call that is safe to repeat is sent (default 3;
   * 0 turns retries off): any call whose connection could not be made
   * (after 200, 400, 800 ms); a GET or a create whose answer was lost; a
   * GET, DELETE or create answered `429` or `503` with `Retry-After`
   * (capacity, a tenant's quota, a draining node), after that long.
   */
  maxRetries?: number;
  /** The longest wait before one retry, in milliseconds (default 30000), whatever `Retry-After` says. */
  maxRetryWaitMs?: number;
  /** The fetch to use (default: the global one). */
  fetch?: typeof fetch;
  /** The WebSocket constructor for sessions (default: the global one, else the `ws` package). */
  WebSocket?: WebSocketConstructor;
}

/** A command: a string runs through `sh -c`, an array as it is. */
export type Command = string | string[];

export interface ExecOptions {
  /** Working directory: absolute, or relative to /work (the default). */
  cwd?: string;
  env?: Record<string, string>;
  /** Seconds; the process group is killed when they pass. */
  timeoutSec?: number;
  user?: string;
  /** Text for stdin (otherwise stdin is /dev/null, or open in a session). */
  stdin?: string;
  /** Run on a terminal of this size. */
  pty?: { rows: number; cols: number; term?: string };
  lease?: LeaseCredential;
  /** Stops the command (and its stream) when it fires. */
  signal?: AbortSignal;
}

export interface ProcessOptions extends Omit<ExecOptions, "signal"> {
  /** A name to find the process by, instead of its pid. */
  tag?: string;
  /** Keep stdin open for `sendStdin` or an attach. */
  openStdin?: boolean;
}

export interface CreateRunOptions {
  env?: Record<string, string>;
  /** Seconds until the run is reaped. */
  ttlSec?: number;
  network?: CreateRunRequest["network"];
  size?: CreateRunRequest["size"];
  limits?: { cpus?: number; memoryMb?: number; pids?: number; diskMb?: number };
  labels?: Record<string, string>;
  /** Allowlist entries (`"pypi.org"`) and rules (`{ host, ports?, methods?, secret?, intercept? }`). */
  egressAllow?: NonNullable<CreateRunRequest["egressAllow"]>;
  /** Declared secret names, and secrets you bring as `{ name, value, hosts,
   * header, scheme?, methods, pathPrefixes }`: the run sees a placeholder,
   * the proxy sends the value only to those hosts, methods and paths. */
  secrets?: NonNullable<CreateRunRequest["secrets"]>;
  /** A SOCKS5 door at 127.0.0.1:1080, named by `ALL_PROXY`, beside the HTTP proxy. */
  egressSocks5?: boolean;
  /** An upstream proxy the run's egress leaves through, one the server admits:
   * `http://` or `socks5://` `[user:password@]host:port`. */
  egressUpstream?: string;
  /** Whether a call that reaches the run while it sleeps wakes it (default true). */
  autoResume?: boolean;
  /** What happens at the TTL: `delete` (default), `pause` or `hibernate`. */
  onExpire?: CreateRunRequest["onExpire"];
  /** What becomes of the run when its node of a fleet is declared gone. */
  onNodeLoss?: CreateRunRequest["onNodeLoss"];
  /** Pause and hibernate the run after this many idle seconds (0: off). */
  idle?: { pauseAfterSec?: number; hibernateAfterSec?: number };
  /** Let setuid programs such as sudo work in the run (only on servers
   * whose runs have a user namespace of their own). */
  allowPrivilegeEscalation?: boolean;
  /** Volumes to mount (at most 8): `{ name, path?, mode? }`, mode `rw` or `ro`. */
  volumes?: VolumeMountRequest[];
  /** Keep a history point (at most `keep`) after every command and file
   * call that changed a file, to diff and roll back to: see {@link Runbox.history}. */
  history?: { keep: number };
  /**
   * Makes a repeated create return the first run instead of a second one.
   * Default: a fresh key for each call, reused by its retries.
   */
  idempotencyKey?: string;
  /** Start from this checkpoint (its disk, and its run's settings for what
   * these options leave out) instead of an image. */
  checkpoint?: string;
}

type Query = Record<string, string | number | boolean | string[] | undefined>;

/** A list's label selector: `{ team: "a", job: null }` (null: the label is
 * set, to anything) or `["team=a", "job"]`; every term must hold. */
export type LabelSelector = Record<string, string | null> | string[];

function selectorTerms(labels?: LabelSelector): string[] | undefined {
  if (!labels) return undefined;
  if (Array.isArray(labels)) return labels.length ? labels : undefined;
  const terms = Object.entries(labels).map(([k, v]) => (v === null ? k : `${k}=${v}`));
  return terms.length ? terms : undefined;
}

interface Call {
  method: string;
  path: string;
  query?: Query;
  json?: unknown;
  body?: BodyInit;
  headers?: Record<string, string>;
  timeoutMs?: number;
}

/** One path segment, percent-encoded; `.` and `..` would become another route. */
function segment(what: string, value: string | number): string {
  const text = String(value);
  if (text === "" || text === "." || text === "..") throw new RunboxError(0, "bad_request", `invalid ${what} ${JSON.stringify(text)}`);
  return encodeURIComponent(text);
}

/** A path below /work as URL segments. */
function filePath(path: string): string {
  const relative = path.startsWith("/work/") ? path.slice("/work/".length) : path.replace(/^\/+/, "");
  return relative
    .split("/")
    .map((p) => segment("file path", p))
    .join("/");
}

function runPath(runId: string): string {
  return `/v1/runs/${segment("run id", runId)}`;
}

function volumePath(name: string): string {
  return `/v1/volumes/${segment("volume name", name)}`;
}

function processPath(runId: string, process: string | number): string {
  return `${runPath(runId)}/processes/${segment("process", process)}`;
}

function leaseFields(lease?: LeaseCredential): Record<string, unknown> {
  return lease ? { owner: lease.owner, generation: lease.generation } : {};
}

/** A JSON body without the fields left undefined. */
function compact<T extends Record<string, unknown>>(fields: T): Partial<T> {
  return Object.fromEntries(Object.entries(fields).filter(([, v]) => v !== undefined)) as Partial<T>;
}

function execBody(cmd: Command, options: ProcessOptions = {}): Record<string, unknown> {
  return compact({
    cmd: typeof cmd === "string" ? ["sh", "-c", cmd] : [...cmd],
    cwd: options.cwd,
    env: options.env,
    timeoutSec: options.timeoutSec,
    user: options.user,
    stdin: options.stdin,
    pty: options.pty ? compact({ ...options.pty }) : undefined,
    tag: options.tag,
    openStdin: options.openStdin ? true : undefined,
    ...leaseFields(options.lease),
  });
}

/** Bytes as a request body (the DOM types want an ArrayBuffer-backed view). */
function bytes(data: string | Uint8Array | Blob): BodyInit {
  if (typeof data === "string") return new TextEncoder().encode(data);
  return data as BodyInit;
}

function env(name: string): string | undefined {
  const p = (globalThis as { process?: { env?: Record<string, string | undefined> } }).process;
  return p?.env?.[name];
}

/** The daemon's token file, on Node; undefined elsewhere or when unreadable. */
async function tokenFromFile(): Promise<string | undefined> {
  if (!(globalThis as { process?: { versions?: { node?: string } } }).process?.versions?.node) return undefined;
  try {
    const { readFile } = await import("node:fs/promises");
    const { join } = await import("node:path");
    const text = await readFile(join(env("RUNBOX_STATE_DIR") ?? "/var/lib/runbox", "token"), "utf8");
    return text.trim() || undefined;
  } catch {
    return undefined;
  }
}

/**
 * A connection to one runbox daemon.
 *
 * ```ts
 * const rb = new Runbox();
 * const run = await rb.createRun("base");
 * const result = await rb.run(run.id, "echo hi");
 * console.log(result.text);
 * await rb.deleteRun(run.id);
 * ```
 */
export class Runbox {
  readonly url: string;
  private readonly tokenReady: Promise<string | undefined>;
  private readonly timeoutMs: number;
  private readonly fetchImpl: typeof fetch;
  private readonly webSocket: WebSocketConstructor | undefined;
  private readonly retry: RetryPolicy;

  constructor(options: RunboxOptions = {}) {
    const url = (options.url ?? env("RUNBOX_URL") ?? DEFAULT_URL).replace(/\/+$/, "");
    if (!/^https?:\/\//.test(url)) throw new RunboxError(0, "bad_request", `the runbox URL must be http:// or https://, not ${JSON.stringify(url)}`);
    this.url = url;
    const token = options.token ?? env("RUNBOX_TOKEN");
    this.tokenReady = token !== undefined ? Promise.resolve(token) : tokenFromFile();
    this.timeoutMs = options.timeoutMs ?? 60_000;
    this.fetchImpl = options.fetch ?? globalThis.fetch.bind(globalThis);
    this.webSocket = options.WebSocket;
    this.retry = new RetryPolicy(options.maxRetries ?? DEFAULT_MAX_RETRIES, options.maxRetryWaitMs ?? DEFAULT_MAX_RETRY_WAIT_MS);
  }

  // -- plumbing ---------------------------------------------------------

  /**
   * Sends `call`, again as long as the retry policy allows, and returns
   * its successful answer as `read` reads it (the answer itself by
   * default: a stream). Throws the error an unsuccessful answer carries
   * (the last one, when the retries ran out or `signal` fired meanwhile).
   */
  private async send<T = Response>(
    call: Call,
    signal?: AbortSignal,
    read: (response: Response) => Promise<T> = async (response) => response as T,
  ): Promise<T> {
    const token = await this.tokenReady;
    const headers: Record<string, string> = { "User-Agent": USER_AGENT, ...call.headers };
    if (token) headers["Authorization"] = `Bearer ${token}`;
    let body = call.body;
    if (call.json !== undefined) {
      body = JSON.stringify(call.json);
      headers["Content-Type"] = "application/json";
    }
    const url = new URL(this.url + call.path);
    for (const [k, v] of Object.entries(call.query ?? {})) {
      if (Array.isArray(v)) for (const item of v) url.searchParams.append(k, item);
      else if (v !== undefined) url.searchParams.set(k, String(v));
    }
    const request: RetryRequest = { method: call.method, path: call.path, headers, body };
    const timedOut = () => signal?.aborted && (signal.reason as Error)?.name === "TimeoutError";
    for (let retries = 0; ; retries++) {
      let error: RunboxError;
      let wait: number | undefined;
      try {
        const response = await this.fetchImpl(url, { method: call.method, headers, body, signal, redirect: "manual" });
        // Read here, so that an answer lost halfway is a failure to retry.
        if (response.status < 300) return await read(response);
        error = errorFrom(response.status, await response.text(), response.statusText);
        wait = this.retry.afterAnswer(request, response.status, response.headers.get("Retry-After"), retries, error.code);
      } catch (e) {
        if (timedOut()) throw new RunboxError(0, "timeout", `${call.method} ${call.path} took longer than ${call.timeoutMs ?? this.timeoutMs} ms`);
        if (signal?.aborted) throw signal.reason;
        error = new RunboxError(0, "unreachable", `cannot reach runbox at ${this.url}: ${(e as Error).cause ?? e}`);
        wait = this.retry.afterFailure(request, failureKind(e), retries);
      }
      if (wait === undefined) throw error;
      if (!(await sleep(wait, signal))) {
        // Out of time while waiting to try again: the last answer says why.
        if (timedOut()) throw error;
        throw signal!.reason;
      }
    }
  }

  private async call<T>(call: Call): Promise<T> {
    const text = await this.send(call, AbortSignal.timeout(call.timeoutMs ?? this.timeoutMs), (response) => response.text());
    return (text ? JSON.parse(text) : undefined) as T;
  }

  /** A server-sent event stream, decoded by `decode`; `ends` says which event is the last. */
  private async *stream<E>(
    build: () => Call,
    decode: (raw: { name: string; data: string }) => E | undefined,
    ends: ((event: E) => boolean) | undefined,
    signal?: AbortSignal,
  ): AsyncGenerator<E> {
    const abort = new AbortController();
    const onAbort = () => abort.abort(signal?.reason);
    signal?.addEventListener("abort", onAbort, { once: true });
    try {
      // Built inside the generator, so a bad argument rejects the first
      // next() like every other call's promise.
      const response = await this.send(build(), abort.signal);
      const reader = response.body!.getReader();
      const decoder = new SseDecoder();
      for (;;) {
        let chunk: ReadableStreamReadResult<Uint8Array>;
        try {
          chunk = await reader.read();
        } catch (e) {
          if (signal?.aborted) throw signal.reason;
          throw new StreamEnded(`the stream broke: ${(e as Error).message}`);
        }
        if (chunk.done) break;
        for (const raw of decoder.feed(chunk.value)) {
          const event = decode(raw);
          if (event === undefined) continue;
          yield event;
          if (ends?.(event)) return;
        }
      }
      if (ends) throw new StreamEnded();
    } finally {
      signal?.removeEventListener("abort", onAbort);
      // Leaving early (break, return, an error) closes the connection:
      // for an exec that kills the command.
      abort.abort();
    }
  }

  private async session(path: string, start: Record<string, unknown> | undefined, explain: () => Promise<unknown>): Promise<Session> {
    const Ws = await webSocketClass(this.webSocket);
    const token = await this.tokenReady;
    const url = "ws" + this.url.slice("http".length) + path;
    return openSession(Ws, url, token, start, async () => {
      // The WebSocket interface hides the refusal's answer: ask the plain
      // route what is wrong.
      try {
        await explain();
      } catch (e) {
        if (e instanceof RunboxError) return e;
      }
      return new RunboxError(0, "unreachable", `the WebSocket to ${this.url}${path.split("?")[0]} did not open`);
    });
  }

  // -- runs ---------------------------------------------------------------

  async health(): Promise<Health> {
    return this.call({ method: "GET", path: "/health" });
  }

  async info(): Promise<Info> {
    return this.call({ method: "GET", path: "/v1/info" });
  }

  /** Creates a run and waits until it is usable. `image` is a stored image or a reference (`alpine:3.20`). */
  /** Creates a run of `image` (default `base`), or, with
   * `options.checkpoint`, from a checkpoint. */
  async createRun(image?: string, options: CreateRunOptions = {}): Promise<Run> {
    const limits = options.limits ? compact(options.limits) : undefined;
    return this.call({
      method: "POST",
      path: "/v1/runs",
      json: compact({
        image: image ?? (options.checkpoint === undefined ? "base" : undefined),
        checkpoint: options.checkpoint,
        env: options.env,
        ttlSec: options.ttlSec,
        network: options.network,
        size: options.size,
        limits: limits && Object.keys(limits).length ? limits : undefined,
        labels: options.labels,
        egressAllow: options.egressAllow,
        secrets: options.secrets,
        egressSocks5: options.egressSocks5,
        egressUpstream: options.egressUpstream,
        autoResume: options.autoResume,
        onExpire: options.onExpire,
        onNodeLoss: options.onNodeLoss,
        idle: options.idle ? compact(options.idle) : undefined,
        allowPrivilegeEscalation: options.allowPrivilegeEscalation,
        volumes: options.volumes,
        history: options.history,
      }),
      // Always keyed, so that it may be sent again (with this key) when its
      // answer was lost or the node was at capacity: the server answers a
      // repeat with the run the first attempt made.
      headers: { "Idempotency-Key": options.idempotencyKey || (await newIdempotencyKey()) },
      // A create may pull its image first.
      timeoutMs: Math.max(this.timeoutMs, 600_000),
    });
  }

  /** The runs this token may see; with `labels`, only those whose labels
   * match every term of the selector. */
  async listRuns(options: { labels?: LabelSelector } = {}): Promise<Run[]> {
    const query = { label: selectorTerms(options.labels) };
    return (await this.call<{ runs: Run[] }>({ method: "GET", path: "/v1/runs", query })).runs;
  }

  async getRun(runId: string): Promise<Run> {
    return this.call({ method: "GET", path: runPath(runId) });
  }

  async deleteRun(runId: string): Promise<void> {
    await this.call({ method: "DELETE", path: runPath(runId) });
  }

  /** Sets the run's time to live to `ttlSec` from now. */
  async renewRun(runId: string, ttlSec: number): Promise<Run> {
    return this.call({ method: "POST", path: `${runPath(runId)}/renew`, json: { ttlSec } });
  }

  /** Replaces a live run's egress: `network` (`none` or `allowlist`),
   * `egressAllow`, `secrets`, `egressSocks5` and `egressUpstream` (as at create); a field left out keeps what
   * the run has, `[]` clears it. New connections follow the new policy;
   * open ones are not cut. */
  async updateEgress(runId: string, change: UpdateEgressRequest): Promise<Run> {
    return this.call({ method: "PATCH", path: `${runPath(runId)}/egress`, json: compact({ ...change }) });
  }

  /** Freezes the run's processes where they are, memory kept; the next call that reaches the run resumes it. */
  async pauseRun(runId: string): Promise<Run> {
    return this.call({ method: "POST", path: `${runPath(runId)}/pause` });
  }

  /** Lets a paused run's processes go on (wakes a hibernated one). */
  async resumeRun(runId: string): Promise<Run> {
    return this.call({ method: "POST", path: `${runPath(runId)}/resume` });
  }

  /** Stops the run down to its disk: processes and memory are lost, files kept; the next call that reaches it boots it again. */
  async hibernateRun(runId: string): Promise<Run> {
    return this.call({ method: "POST", path: `${runPath(runId)}/hibernate` });
  }

  /** Sends the run's disk to the server's checkpoint store and drops it on
   * the node; the next call that reaches it restores it. */
  async archiveRun(runId: string): Promise<Run> {
    return this.call({ method: "POST", path: `${runPath(runId)}/archive`, timeoutMs: Math.max(this.timeoutMs, 600_000) });
  }

  /** Moves the run to another node of the fleet (`node`, or the best one
   * that can take it), under the same id, token, settings and lease; the
   * run as its new node answers. Root only. */
  async moveRun(runId: string, node?: string): Promise<Run> {
    return this.call({ method: "POST", path: `${runPath(runId)}/move`, json: compact({ node }), timeoutMs: Math.max(this.timeoutMs, 600_000) });
  }

  /** Boots a hibernated or failed run again on its disk. */
  async wakeRun(runId: string): Promise<Run> {
    return this.call({ method: "POST", path: `${runPath(runId)}/wake` });
  }

  // -- leases -------------------------------------------------------------

  async acquireLease(runId: string, owner: string, ttlSec?: number): Promise<Lease> {
    return (await this.call<{ lease: Lease }>({ method: "POST", path: `${runPath(runId)}/lease`, json: compact({ owner, ttlSec }) })).lease;
  }

  async renewLease(runId: string, lease: LeaseCredential, ttlSec?: number): Promise<Lease> {
    const json = compact({ ...leaseFields(lease), ttlSec });
    return (await this.call<{ lease: Lease }>({ method: "POST", path: `${runPath(runId)}/lease/renew`, json })).lease;
  }

  async releaseLease(runId: string, lease: LeaseCredential): Promise<void> {
    await this.call({ method: "POST", path: `${runPath(runId)}/lease/release`, json: leaseFields(lease) });
  }

  // -- exec ---------------------------------------------------------------

  /**
   * Runs a command and yields its events as they come: `started`, `stdout`,
   * `stderr`, then one `exit`. Leaving the loop early kills the command.
   */
  exec(runId: string, cmd: Command, options: ExecOptions = {}): AsyncGenerator<ExecEvent> {
    const call = () => ({ method: "POST", path: `${runPath(runId)}/exec`, json: execBody(cmd, options) });
    return this.stream(call, execEvent, (e) => e.type === "exit", options.signal);
  }

  /** Runs a command to its end; returns its output and exit. */
  async run(runId: string, cmd: Command, options: ExecOptions = {}): Promise<ExecResult> {
    const collect = new OutputCollector();
    for await (const event of this.exec(runId, cmd, options)) {
      const done = collect.add(event);
      if (done) return done;
    }
    throw new StreamEnded();
  }

  /**
   * An interactive command over a WebSocket: stdin open, on a terminal when
   * `pty` is given. Closing the session kills the command.
   */
  async openSession(runId: string, cmd: Command, options: Omit<ExecOptions, "signal" | "stdin"> = {}): Promise<Session> {
    return this.session(`${runPath(runId)}/exec/ws`, execBody(cmd, options), () => this.getRun(runId));
  }

  // -- processes ------------------------------------------------------------

  /** Starts a background process; it outlives this client. */
  async startProcess(runId: string, cmd: Command, options: ProcessOptions = {}): Promise<Process> {
    return this.call({ method: "POST", path: `${runPath(runId)}/processes`, json: execBody(cmd, options) });
  }

  async processes(runId: string): Promise<Process[]> {
    return (await this.call<{ processes: Process[] }>({ method: "GET", path: `${runPath(runId)}/processes` })).processes;
  }

  /** A process by pid or tag. */
  async process(runId: string, process: string | number): Promise<Process> {
    return this.call({ method: "GET", path: processPath(runId, process) });
  }

  /** Waits up to `timeoutSec` for a process to end; `running` on the answer says whether it did. */
  async waitProcess(runId: string, process: string | number, timeoutSec = 60): Promise<Process> {
    return this.call({
      method: "GET",
      path: `${processPath(runId, process)}/wait`,
      query: { timeoutSec },
      timeoutMs: Math.max(this.timeoutMs, timeoutSec * 1000 + 10_000),
    });
  }

  async signalProcess(runId: string, process: string | number, signal: string | number = "TERM", lease?: LeaseCredential): Promise<Process> {
    return this.call({ method: "POST", path: `${processPath(runId, process)}/signal`, json: { signal, ...leaseFields(lease) } });
  }

  /** Sends bytes to a process's stdin (started with `openStdin`); `close` closes it after. */
  async sendStdin(runId: string, process: string | number, data: string | Uint8Array, close = false, lease?: LeaseCredential): Promise<Process> {
    return this.call({
      method: "POST",
      path: `${processPath(runId, process)}/stdin`,
      query: { close, ...leaseFields(lease) } as Query,
      body: bytes(data),
      headers: { "Content-Type": "application/octet-stream" },
    });
  }

  /** A process's output (what it kept first, when `replay`), ending with its exit. Leaving early leaves it running. */
  processOutput(runId: string, process: string | number, options: { replay?: boolean; signal?: AbortSignal } = {}): AsyncGenerator<ExecEvent> {
    const call = () => ({ method: "GET", path: `${processPath(runId, process)}/output`, query: { replay: options.replay ?? true } });
    return this.stream(call, execEvent, (e) => e.type === "exit", options.signal);
  }

  /** Attaches to a process over a WebSocket; closing the session detaches. */
  async attach(runId: string, process: string | number, options: { replay?: boolean; lease?: LeaseCredential } = {}): Promise<Session> {
    const query = new URLSearchParams({ replay: String(options.replay ?? true) });
    if (options.lease) {
      query.set("owner", options.lease.owner);
      query.set("generation", String(options.lease.generation));
    }
    return this.session(`${processPath(runId, process)}/ws?${query}`, undefined, () => this.process(runId, process));
  }

  // -- files ----------------------------------------------------------------

  /** Writes `data` to `path` below /work, replacing it whole. */
  async writeFile(runId: string, path: string, data: string | Uint8Array | Blob, lease?: LeaseCredential): Promise<void> {
    await this.call({
      method: "PUT",
      path: `${runPath(runId)}/files/${filePath(path)}`,
      query: leaseFields(lease) as Query,
      body: bytes(data),
      headers: { "Content-Type": "application/octet-stream" },
    });
  }

  /** Reads a file below /work. */
  async readFile(runId: string, path: string): Promise<Uint8Array> {
    const call = { method: "GET", path: `${runPath(runId)}/files/${filePath(path)}` };
    return new Uint8Array(await this.send(call, AbortSignal.timeout(this.timeoutMs), (response) => response.arrayBuffer()));
  }

  /** Reads a file below /work as UTF-8 text. */
  async readText(runId: string, path: string): Promise<string> {
    return new TextDecoder().decode(await this.readFile(runId, path));
  }

  async stat(runId: string, path = ""): Promise<FileInfo> {
    return this.call({ method: "GET", path: `${runPath(runId)}/fs/stat`, query: { path } });
  }

  async listDir(runId: string, path = "", depth = 1): Promise<FileInfo[]> {
    return (await this.call<FileList>({ method: "GET", path: `${runPath(runId)}/fs/list`, query: { path, depth } })).entries;
  }

  async makeDir(runId: string, path: string, options: { mode?: number; lease?: LeaseCredential } = {}): Promise<FileInfo> {
    return this.call({ method: "POST", path: `${runPath(runId)}/fs/mkdir`, json: compact({ path, mode: options.mode, ...leaseFields(options.lease) }) });
  }

  async move(runId: string, from: string, to: string, options: { overwrite?: boolean; lease?: LeaseCredential } = {}): Promise<FileInfo> {
    const json = compact({ from, to, overwrite: options.overwrite || undefined, ...leaseFields(options.lease) });
    return this.call({ method: "POST", path: `${runPath(runId)}/fs/move`, json });
  }

  /** Removes a path; returns how many entries went. */
  async remove(runId: string, path: string, options: { recursive?: boolean; lease?: LeaseCredential } = {}): Promise<number> {
    const json = compact({ path, recursive: options.recursive || undefined, ...leaseFields(options.lease) });
    return (await this.call<{ removed: number }>({ method: "POST", path: `${runPath(runId)}/fs/remove`, json })).removed;
  }

  /** Changes below a directory of /work; the first event is `ready`. Runs until the loop is left or `signal` fires. */
  watch(runId: string, path = "", options: { recursive?: boolean; signal?: AbortSignal } = {}): AsyncGenerator<WatchEvent> {
    const call = () => ({ method: "GET", path: `${runPath(runId)}/fs/watch`, query: { path, recursive: options.recursive ?? false } });
    return this.stream(call, (raw) => (raw.data ? (JSON.parse(raw.data) as WatchEvent) : undefined), undefined, options.signal);
  }

  // -- images, snapshots, forks, previews -------------------------------------

  async listImages(): Promise<Image[]> {
    return (await this.call<{ images: Image[] }>({ method: "GET", path: "/v1/images" })).images;
  }

  async getImage(name: string): Promise<Image> {
    return this.call({ method: "GET", path: `/v1/images/${segment("image name", name)}` });
  }

  /** Imports a tar archive (OCI layout, `docker save`, or a root filesystem) as `name`. */
  async importImage(name: string, tar: Uint8Array | Blob): Promise<Image> {
    return this.call({
      method: "POST",
      path: `/v1/images/${segment("image name", name)}`,
      body: bytes(tar),
      headers: { "Content-Type": "application/x-tar" },
      timeoutMs: Math.max(this.timeoutMs, 600_000),
    });
  }

  /**
   * Pulls an image reference (`alpine:3.20`) from its registry and stores
   * it; `onProgress` sees each layer's progress. Resolves to the image.
   */
  async pullImage(
    reference: string,
    options: { name?: string; username?: string; password?: string; onProgress?: (event: PullEvent) => void; signal?: AbortSignal } = {},
  ): Promise<Image> {
    const json = compact({ reference, name: options.name, username: options.username, password: options.password });
    const call = () => ({ method: "POST", path: "/v1/images/pull", json });
    const last = (raw: { name: string }) => raw.name === "done" || raw.name === "error";
    for await (const raw of this.stream(call, (raw) => raw, last, options.signal)) {
      const data = raw.data ? JSON.parse(raw.data) : {};
      if (raw.name === "progress") options.onProgress?.(data as PullEvent);
      else if (raw.name === "done") return data as Image;
      else if (raw.name === "error") throw new RunboxError(0, String(data.code), String(data.message));
    }
    throw new StreamEnded("the pull stream ended without its result");
  }

  async deleteImage(name: string): Promise<void> {
    await this.call({ method: "DELETE", path: `/v1/images/${segment("image name", name)}` });
  }

  /** Uploads a build context (a tar, plain or gzip) under its digest; resolves to the digest. */
  async putBuildContext(tar: Uint8Array | Blob): Promise<string> {
    // Copied into an ArrayBuffer of its own: what digest() and fetch take.
    const body = new Uint8Array(tar instanceof Blob ? await tar.arrayBuffer() : tar);
    const hash = new Uint8Array(await crypto.subtle.digest("SHA-256", body.buffer));
    const digest = `sha256:${Array.from(hash, (b) => b.toString(16).padStart(2, "0")).join("")}`;
    await this.call({
      method: "PUT",
      path: `/v1/build-contexts/${segment("context digest", digest)}`,
      body: body.buffer,
      headers: { "Content-Type": "application/x-tar" },
      timeoutMs: Math.max(this.timeoutMs, 600_000),
    });
    return digest;
  }

  /**
   * Builds image `name` from a Dockerfile's text (or `steps` on
   * `fromImage`) and waits for it; resolves to the ended build. `context`
   * (a tar) is uploaded first: what COPY reads. `onLog` sees each log line.
   * Rejects with `BuildFailed` when the build ends without its image.
   */
  async buildImage(
    name: string,
    options: {
      dockerfile?: string;
      steps?: BuildStepSpec[];
      fromImage?: string;
      context?: Uint8Array | Blob;
      buildArgs?: Record<string, string>;
      target?: string;
      noCache?: boolean;
      timeoutSec?: number;
      labels?: Record<string, string>;
      onLog?: (line: BuildLog) => void;
      signal?: AbortSignal;
    } = {},
  ): Promise<Build> {
    const context = options.context === undefined ? undefined : await this.putBuildContext(options.context);
    const json = compact({
      name,
      dockerfile: options.dockerfile,
      steps: options.steps,
      from: options.fromImage,
      context,
      buildArgs: options.buildArgs,
      target: options.target,
      noCache: options.noCache || undefined,
      timeoutSec: options.timeoutSec,
      labels: options.labels,
    });
    const started = await this.call<Build>({ method: "POST", path: "/v1/builds", json });
    for await (const event of this.buildEvents(started.id, { signal: options.signal })) {
      if (event.type === "log") options.onLog?.(event.log);
      else if (event.type === "done") {
        if (event.build.status !== "ready") throw new BuildFailed(event.build);
        return event.build;
      }
    }
    throw new StreamEnded("the build's event stream ended before the build did");
  }

  /** A build's steps and log as they happen (the log from line `offset`), then `done`. */
  buildEvents(buildId: string, options: { offset?: number; signal?: AbortSignal } = {}): AsyncGenerator<BuildEvent> {
    const call = () => ({ method: "GET", path: `/v1/builds/${segment("build id", buildId)}/events`, query: { offset: options.offset ?? 0 } });
    const decode = (raw: { name: string; data: string }): BuildEvent | undefined => {
      switch (raw.name) {
        case "step":
          return { type: "step", step: JSON.parse(raw.data) as BuildStep };
        case "log":
          return { type: "log", log: JSON.parse(raw.data) as BuildLog };
        case "done":
          return { type: "done", build: JSON.parse(raw.data) as Build };
        default:
          return undefined;
      }
    };
    return this.stream(call, decode, (event) => event.type === "done", options.signal);
  }

  async getBuild(buildId: string): Promise<Build> {
    return this.call({ method: "GET", path: `/v1/builds/${segment("build id", buildId)}` });
  }

  /** The caller's builds, newest first. */
  async listBuilds(): Promise<Build[]> {
    return (await this.call<{ builds: Build[] }>({ method: "GET", path: "/v1/builds" })).builds;
  }

  /** Cancels a build; resolves once it has ended. */
  async cancelBuild(buildId: string): Promise<Build> {
    return this.call({ method: "POST", path: `/v1/builds/${segment("build id", buildId)}/cancel` });
  }

  /** Saves the run's files (with `point`: as they were at that history
   * point) as an image that new runs can start from. */
  async snapshot(runId: string, name?: string, point?: string): Promise<Snapshot> {
    return this.call({ method: "POST", path: `${runPath(runId)}/snapshot`, json: compact({ name, point }), timeoutMs: Math.max(this.timeoutMs, 600_000) });
  }

  /** Sends the run's disk and settings to the server's checkpoint store;
   * the run keeps running. `createRun(undefined, { checkpoint: id })`
   * starts runs from it. */
  async checkpoint(runId: string, labels?: Record<string, string>): Promise<Checkpoint> {
    return this.call({ method: "POST", path: `${runPath(runId)}/checkpoint`, json: compact({ labels }), timeoutMs: Math.max(this.timeoutMs, 600_000) });
  }

  /** Adds a tenant (root token only); the answer's `token` is shown this once. */
  async createTenant(req: CreateTenantRequest): Promise<TenantToken> {
    return this.call({ method: "POST", path: "/v1/tenants", json: req });
  }

  async listTenants(): Promise<Tenant[]> {
    return (await this.call<{ tenants: Tenant[] }>({ method: "GET", path: "/v1/tenants" })).tenants;
  }

  async getTenant(name: string): Promise<Tenant> {
    return this.call({ method: "GET", path: `/v1/tenants/${segment("tenant name", name)}` });
  }

  /** Replaces the settings given. */
  async updateTenant(name: string, req: UpdateTenantRequest): Promise<Tenant> {
    return this.call({ method: "PATCH", path: `/v1/tenants/${segment("tenant name", name)}`, json: req });
  }

  /** A new token for the tenant; the old one stops working at once. */
  async rotateTenant(name: string): Promise<TenantToken> {
    return this.call({ method: "POST", path: `/v1/tenants/${segment("tenant name", name)}/rotate` });
  }

  async deleteTenant(name: string): Promise<void> {
    await this.call({ method: "DELETE", path: `/v1/tenants/${segment("tenant name", name)}` });
  }

  /** Makes a named volume; mount it with `createRun(image, { volumes: [{ name }] })`. */
  async createVolume(
    name: string,
    options: { sizeMb?: number; labels?: Record<string, string> } = {},
  ): Promise<Volume> {
    return this.call({
      method: "POST",
      path: "/v1/volumes",
      json: compact({ name, sizeMb: options.sizeMb, labels: options.labels }),
    });
  }

  /** The volumes this token may see, filtered by `labels` as
   * {@link listRuns} is. */
  async listVolumes(options: { labels?: LabelSelector } = {}): Promise<Volume[]> {
    const query = { label: selectorTerms(options.labels) };
    return (await this.call<{ volumes: Volume[] }>({ method: "GET", path: "/v1/volumes", query })).volumes;
  }

  async getVolume(name: string): Promise<Volume> {
    return this.call({ method: "GET", path: `/v1/volumes/${segment("volume name", name)}` });
  }

  /** A new volume holding what `name` holds now (constant time). */
  async cloneVolume(name: string, newName: string, options: { sizeMb?: number } = {}): Promise<Volume> {
    return this.call({
      method: "POST",
      path: `/v1/volumes/${segment("volume name", name)}/clone`,
      json: compact({ name: newName, sizeMb: options.sizeMb }),
    });
  }

  /** Moves the volume (no run may mount it) to another node of the fleet (`node`, or the best one): the volume on its new node. */
  async moveVolume(name: string, node?: string): Promise<Volume> {
    return this.call({
      method: "POST",
      path: `/v1/volumes/${segment("volume name", name)}/move`,
      json: compact({ node }),
      timeoutMs: Math.max(this.timeoutMs, 600_000),
    });
  }

  /** Deletes the volume and all it holds; refused while a run mounts it. */
  async deleteVolume(name: string): Promise<void> {
    await this.call({ method: "DELETE", path: `/v1/volumes/${segment("volume name", name)}` });
  }

  /**
   * Writes a file (path from the volume's top) of a volume no run mounts;
   * `owner` is `[uid, gid]` as runs see them; `overwrite: false` refuses an existing file.
   */
  async writeVolumeFile(
    name: string,
    path: string,
    data: string | Uint8Array | Blob,
    options: { mode?: number; owner?: [number, number]; overwrite?: boolean } = {},
  ): Promise<FileInfo> {
    const [uid, gid] = options.owner ?? [undefined, undefined];
    return this.call({
      method: "PUT",
      path: `${volumePath(name)}/files/${filePath(path.replace(/^\/+/, ""))}`,
      query: compact({ mode: options.mode, uid, gid, overwrite: options.overwrite }) as Query,
      body: bytes(data),
      headers: { "Content-Type": "application/octet-stream" },
    });
  }

  /** Reads a file of a volume (runs may hold it meanwhile). */
  async readVolumeFile(name: string, path: string): Promise<Uint8Array> {
    const url = `${volumePath(name)}/files/${filePath(path.replace(/^\/+/, ""))}`;
    return new Uint8Array(await this.send({ method: "GET", path: url }, AbortSignal.timeout(this.timeoutMs), (response) => response.arrayBuffer()));
  }

  async volumeStat(name: string, path = ""): Promise<FileInfo> {
    return this.call({ method: "GET", path: `${volumePath(name)}/fs/stat`, query: { path } });
  }

  async volumeList(name: string, path = "", depth = 1): Promise<FileInfo[]> {
    return (await this.call<FileList>({ method: "GET", path: `${volumePath(name)}/fs/list`, query: { path, depth } })).entries;
  }

  async volumeMakeDir(name: string, path: string, options: { mode?: number; owner?: [number, number] } = {}): Promise<FileInfo> {
    const [uid, gid] = options.owner ?? [undefined, undefined];
    return this.call({ method: "POST", path: `${volumePath(name)}/fs/mkdir`, json: compact({ path, mode: options.mode, uid, gid }) });
  }

  async volumeMove(name: string, from: string, to: string, options: { overwrite?: boolean } = {}): Promise<FileInfo> {
    return this.call({ method: "POST", path: `${volumePath(name)}/fs/move`, json: compact({ from, to, overwrite: options.overwrite || undefined }) });
  }

  /** Removes a path of a volume no run mounts; returns how many entries went. */
  async volumeRemove(name: string, path: string, options: { recursive?: boolean } = {}): Promise<number> {
    const json = compact({ path, recursive: options.recursive || undefined });
    return (await this.call<{ removed: number }>({ method: "POST", path: `${volumePath(name)}/fs/remove`, json })).removed;
  }

  /** What each tenant used since `since` (RFC 3339, or a span such as `24h`). */
  async usage(options: { since?: string; tenant?: string } = {}): Promise<UsageReport> {
    return this.call({ method: "GET", path: "/v1/usage", query: { since: options.since, tenant: options.tenant } });
  }

  /** The checkpoints this token may see, filtered by `labels` as
   * {@link listRuns} is. */
  async listCheckpoints(options: { labels?: LabelSelector } = {}): Promise<Checkpoint[]> {
    const query = { label: selectorTerms(options.labels) };
    return (await this.call<{ checkpoints: Checkpoint[] }>({ method: "GET", path: "/v1/checkpoints", query }))
      .checkpoints;
  }

  async getCheckpoint(id: string): Promise<Checkpoint> {
    return this.call({ method: "GET", path: `/v1/checkpoints/${segment("checkpoint id", id)}` });
  }

  async deleteCheckpoint(id: string): Promise<void> {
    await this.call({ method: "DELETE", path: `/v1/checkpoints/${segment("checkpoint id", id)}` });
  }

  /** Makes `count` copies of a run, each running: of its files as they
   * are, or with `point` as they were at that history point. */
  async fork(runId: string, count = 1, ttlSec?: number, point?: string): Promise<Run[]> {
    const json = compact({ count, ttlSec, point });
    return (await this.call<{ runs: Run[] }>({ method: "POST", path: `${runPath(runId)}/fork`, json, timeoutMs: Math.max(this.timeoutMs, 600_000) })).runs;
  }

  // -- history (runs created with `history: { keep }`) ---------------------

  /** The run's history points, newest first: one after every command and
   * file call that changed a file, and a `create` point (the files before
   * the first change). `point_not_found` for a run without a history. */
  async history(runId: string): Promise<HistoryList> {
    return this.call({ method: "GET", path: `${runPath(runId)}/history` });
  }

  /**
   * The paths a history point (default: the newest) changed against its
   * parent, or against the point `against`; `patch` adds unified diffs of
   * changed text files; `limit` is the most paths (1-10000, default 1000).
   */
  async diff(runId: string, point?: string, options: { against?: string; patch?: boolean; limit?: number } = {}): Promise<HistoryDiff> {
    if (point === undefined) {
      const newest = (await this.history(runId)).points[0];
      if (!newest) throw new NotFound(404, "point_not_found", `run ${runId} has no history points yet`);
      point = newest.id;
    }
    const query = { against: options.against, patch: options.patch ? true : undefined, limit: options.limit };
    return this.call({ method: "GET", path: `${runPath(runId)}/history/${segment("history point", point)}/diff`, query });
  }

  /** Returns the run's files to a history point; a running run's processes
   * end (it boots again on those files). Later points stay, so a rollback
   * can be undone by rolling forward, until the run's next change. */
  async rollback(runId: string, point: string, lease?: LeaseCredential): Promise<Run> {
    return this.call({
      method: "POST",
      path: `${runPath(runId)}/rollback`,
      json: { point, ...leaseFields(lease) },
      timeoutMs: Math.max(this.timeoutMs, 600_000),
    });
  }

  /** A URL that reaches `port` inside the run through the preview listener. */
  async mintPreview(runId: string, port: number, ttlSec?: number): Promise<Preview> {
    return this.call({ method: "POST", path: `${runPath(runId)}/preview`, json: compact({ port, ttlSec }) });
  }
}
