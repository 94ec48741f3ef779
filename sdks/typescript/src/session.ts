/**
 * Interactive sessions over a WebSocket (docs/api.md, "WebSocket sessions"):
 * binary frames carry stdin in and output out (first byte 1 stdout, 2
 * stderr), text frames JSON control. Built on the standard WebSocket
 * interface, so the browser's, Node's global one (Node 22+) and the `ws`
 * package all serve; the token travels as a subprotocol, since that
 * interface cannot set headers.
 */
import { RunboxError, StreamEnded, errorFrom } from "./errors.js";
import { ExecResult, OutputCollector, type ExecEvent } from "./types.js";

/** The part of the standard WebSocket interface a session uses. */
export interface WebSocketLike {
  binaryType: string;
  readonly readyState: number;
  readonly protocol: string;
  send(data: string | ArrayBufferLike | Uint8Array): void;
  close(code?: number, reason?: string): void;
  onopen: ((event: unknown) => void) | null;
  onmessage: ((event: { data: unknown }) => void) | null;
  onclose: ((event: { code: number; reason: string }) => void) | null;
  onerror: ((event: unknown) => void) | null;
}

/** A WebSocket constructor (`globalThis.WebSocket`, or `ws`'s). */
export type WebSocketConstructor = new (url: string, protocols?: string[]) => WebSocketLike;

const PROTOCOL = "runbox.v1";
const TOKEN_PREFIX = "runbox.bearer.";

/** The constructor to use: the given one, the global one, else `ws`. */
export async function webSocketClass(given?: WebSocketConstructor): Promise<WebSocketConstructor> {
  if (given) return given;
  const global = (globalThis as { WebSocket?: WebSocketConstructor }).WebSocket;
  if (global) return global;
  try {
    const ws = (await import("ws")) as unknown as { default: WebSocketConstructor };
    return ws.default;
  } catch {
    throw new RunboxError(
      0,
      "no_websocket",
      "this runtime has no global WebSocket: install the `ws` package, or pass `WebSocket` to new Runbox()",
    );
  }
}

/** What a session reads: output events, refused-frame errors, the end. */
type Item = ExecEvent | { type: "closed"; reason: string };

/**
 * An interactive command (or an attach) over a WebSocket.
 *
 * Send with {@link send}, {@link eof}, {@link signal}, {@link resize}; read
 * with {@link events} or {@link wait}. Closing the session kills a command
 * it started; an attached process keeps running.
 */
export class Session {
  pid = 0;
  exit: Extract<ExecEvent, { type: "exit" }> | undefined;
  /** A failed start's error, thrown by `openSession`. @internal */
  failure: RunboxError | undefined;
  /** Errors the server sent for refused input frames (the session goes on). */
  readonly refused: RunboxError[] = [];
  private readonly queue: Item[] = [];
  private wake: (() => void) | undefined;
  private readonly encoder = new TextEncoder();
  private ended: (() => void) | undefined;
  /** Resolves when the socket closed or failed. @internal */
  readonly closed = new Promise<void>((resolve) => (this.ended = resolve));

  /**
   * Installed before the socket opens: the server's first frame may
   * arrive in the same read as its 101. @internal
   */
  constructor(private readonly ws: WebSocketLike) {
    ws.onmessage = (event) => this.receive(event.data);
    ws.onclose = (event) => this.push({ type: "closed", reason: `code ${event.code} ${event.reason}`.trim() });
    ws.onerror = () => this.push({ type: "closed", reason: "the connection failed" });
  }

  /** Bytes (or text) for stdin; on a terminal, keystrokes. */
  send(data: string | Uint8Array): void {
    this.ws.send(typeof data === "string" ? this.encoder.encode(data) : data);
  }

  /** Closes stdin (on a terminal: sends ^D). */
  eof(): void {
    this.control({ type: "eof" });
  }

  /** A signal for the process group, by name (`INT`) or number. */
  signal(signal: string | number): void {
    this.control({ type: "signal", signal });
  }

  /** The terminal's new size; the command gets SIGWINCH. */
  resize(rows: number, cols: number): void {
    this.control({ type: "resize", rows, cols });
  }

  /** Output events as they come, ending with the exit. */
  async *events(): AsyncGenerator<ExecEvent> {
    while (this.exit === undefined) {
      const item = await this.next();
      if (item.type === "closed") throw new StreamEnded(`the session closed before the exit: ${item.reason}`);
      if (item.type === "exit") this.exit = item;
      yield item;
    }
  }

  /** Reads to the end: all output and the exit. */
  async wait(): Promise<ExecResult> {
    const collect = new OutputCollector();
    collect.pid = this.pid;
    for await (const event of this.events()) {
      const done = collect.add(event);
      if (done) return done;
    }
    throw new StreamEnded();
  }

  close(): void {
    this.ws.close(1000);
  }

  /** Waits for the `started` frame. @internal */
  async started(): Promise<void> {
    const first = await this.next();
    if (first.type === "started") {
      this.pid = first.pid;
      return;
    }
    this.close();
    if (first.type === "closed") throw new StreamEnded(`the session closed before it started: ${first.reason}`);
    throw new StreamEnded(`the session began with ${first.type}, not started`);
  }

  private control(frame: Record<string, unknown>): void {
    this.ws.send(JSON.stringify(frame));
  }

  private receive(data: unknown): void {
    if (data instanceof ArrayBuffer || ArrayBuffer.isView(data)) {
      const bytes =
        data instanceof ArrayBuffer ? new Uint8Array(data) : new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
      if (bytes.length === 0) return;
      const kind = bytes[0];
      if (kind === 1) this.push({ type: "stdout", data: bytes.slice(1) });
      else if (kind === 2) this.push({ type: "stderr", data: bytes.slice(1) });
      return;
    }
    let frame: { type?: string; [key: string]: unknown };
    try {
      frame = JSON.parse(String(data));
    } catch {
      return;
    }
    switch (frame.type) {
      case "started":
        this.push({ type: "started", pid: Number(frame.pid) });
        break;
      case "lost":
        this.push({ type: "lost", chunks: Number(frame.chunks) });
        break;
      case "exit":
        this.push(frame as Extract<ExecEvent, { type: "exit" }>);
        break;
      case "error": {
        const error = errorFrom(Number(frame.status ?? 400), JSON.stringify({ error: frame }));
        if (this.pid === 0) {
          // A failed start: the session ends with this error.
          this.failure = error;
          this.push({ type: "closed", reason: error.message });
        } else {
          this.refused.push(error);
        }
        break;
      }
    }
  }

  private push(item: Item): void {
    if (item.type === "closed") this.ended?.();
    this.queue.push(item);
    this.wake?.();
  }

  private async next(): Promise<Item> {
    while (this.queue.length === 0) {
      await new Promise<void>((resolve) => (this.wake = resolve));
      this.wake = undefined;
    }
    const item = this.queue[0]!;
    // The end stays queued: every later read sees it too.
    if (item.type !== "closed") this.queue.shift();
    return item;
  }
}

/**
 * Opens a session on `url`. `explain` is asked for the reason when the
 * handshake fails, since the WebSocket interface hides the HTTP answer.
 */
export async function openSession(
  Ws: WebSocketConstructor,
  url: string,
  token: string | undefined,
  start: Record<string, unknown> | undefined,
  explain: () => Promise<RunboxError>,
): Promise<Session> {
  const protocols = token ? [PROTOCOL, TOKEN_PREFIX + token] : [PROTOCOL];
  const ws = new Ws(url, protocols);
  ws.binaryType = "arraybuffer";
  const session = new Session(ws);
  const opened = await new Promise<boolean>((resolve) => {
    ws.onopen = () => resolve(true);
    void session.closed.then(() => resolve(false));
  });
  if (!opened) throw await explain();
  if (start) ws.send(JSON.stringify({ type: "start", ...start }));
  try {
    await session.started();
  } catch (e) {
    throw session.failure ?? e;
  }
  return session;
}
