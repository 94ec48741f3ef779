/**
 * When a call is sent again, and after how long: pure logic, the client
 * does the waiting. See {@link RetryPolicy}.
 */
import { RunboxError } from "./errors.js";

/** A call is sent at most this many more times (4 attempts in all). */
export const DEFAULT_MAX_RETRIES = 3;
/** The longest wait before one retry, in milliseconds, whatever `Retry-After` says. */
export const DEFAULT_MAX_RETRY_WAIT_MS = 30_000;
/** The first wait after a connection failure, doubled each time (200, 400, 800 ms). */
export const RETRY_BACKOFF_MS = 200;

/** What the policy needs to know of a request. */
export interface RetryRequest {
  method: string;
  path: string;
  headers?: Record<string, string>;
  /** The body as it is sent (a string for JSON). */
  body?: unknown;
}

/**
 * How a request failed without an answer: `connect`, the connection could
 * not be made (the request never left); `lost`, it broke after the request
 * went (or may have), before the whole answer came; `undefined`, anything
 * else (a timeout, an abort, a failure the runtime does not explain).
 */
export type Failure = "connect" | "lost" | undefined;

// Node's fetch (undici) names the cause of a "fetch failed" by code.
const CONNECT_CODES = new Set([
  "ECONNREFUSED",
  "EHOSTUNREACH",
  "ENETUNREACH",
  "EADDRNOTAVAIL",
  "ENOTFOUND",
  "EAI_AGAIN",
  "UND_ERR_CONNECT_TIMEOUT",
]);
const LOST_CODES = new Set(["ECONNRESET", "EPIPE", "UND_ERR_SOCKET"]);

/** How `error`, thrown by `fetch` or by reading its body, failed. */
export function failureKind(error: unknown): Failure {
  const codes: unknown[] = [];
  const seen = new Set<unknown>();
  const visit = (e: unknown) => {
    if (typeof e !== "object" || e === null || seen.has(e) || seen.size > 8) return;
    seen.add(e);
    const { code, cause, errors } = e as { code?: unknown; cause?: unknown; errors?: unknown };
    codes.push(code);
    visit(cause);
    if (Array.isArray(errors)) errors.forEach(visit);
  };
  visit(error);
  if (codes.some((c) => CONNECT_CODES.has(c as string))) return "connect";
  if (codes.some((c) => LOST_CODES.has(c as string))) return "lost";
  return undefined;
}

/**
 * A `Retry-After` header's wait in milliseconds: delta-seconds (what
 * runbox sends) or an HTTP date; undefined when absent or unreadable.
 */
export function retryAfterMs(value: string | null | undefined, now = Date.now()): number | undefined {
  if (value === null || value === undefined) return undefined;
  const text = value.trim();
  if (/^[0-9]{1,10}$/.test(text)) return Number(text) * 1000;
  // Only an HTTP date (`Wed, 21 Oct 2015 07:28:00 GMT`), not whatever Date.parse takes.
  if (!/^[A-Za-z]{3}, \d{2} [A-Za-z]{3} \d{4} \d{2}:\d{2}:\d{2} GMT$/.test(text)) return undefined;
  const at = Date.parse(text);
  return Number.isNaN(at) ? undefined : Math.max(0, at - now);
}

function header(headers: Record<string, string> | undefined, name: string): string | undefined {
  for (const [k, v] of Object.entries(headers ?? {})) if (k.toLowerCase() === name) return v;
  return undefined;
}

/**
 * A create (`POST /v1/runs`) with an `Idempotency-Key`: the server answers
 * its repeat with the run the first attempt made.
 */
export function isKeyedCreate(request: RetryRequest): boolean {
  return request.method.toUpperCase() === "POST" && request.path.replace(/\/+$/, "") === "/v1/runs" && !!header(request.headers, "idempotency-key");
}

/**
 * Whether a request may be sent again after the server answered it (`429`
 * or `503` with `Retry-After`): GET, HEAD, DELETE, and keyed creates. Any
 * other POST, PUT or PATCH may have done something.
 */
export function repeatable(request: RetryRequest): boolean {
  return ["GET", "HEAD", "DELETE"].includes(request.method.toUpperCase()) || isKeyedCreate(request);
}

/**
 * Whether a body can be sent again: none, a string, bytes, a Blob, form
 * data; never a stream, which the first attempt consumed.
 */
export function replayable(body: unknown): boolean {
  if (body === undefined || body === null || typeof body === "string") return true;
  if (body instanceof ArrayBuffer || ArrayBuffer.isView(body)) return true;
  if (typeof Blob !== "undefined" && body instanceof Blob) return true;
  if (body instanceof URLSearchParams) return true;
  if (typeof FormData !== "undefined" && body instanceof FormData) return true;
  return false;
}

/**
 * When a call is sent again, and after how long.
 *
 * At most `maxRetries` more attempts (0: none), whatever made them:
 * - a connection that could not be made (refused, no route): any request,
 *   since it never reached the server; after 200 ms, doubled each time
 *   (200, 400, 800 ms);
 * - an answer lost on the way (the connection broke after the request
 *   went): GET, HEAD and keyed creates only, with the same backoff;
 * - a `429` or `503` carrying `Retry-After` (`capacity`, `tenant_quota`,
 *   `draining`; the server changed nothing): GET, HEAD, DELETE and keyed
 *   creates, after `Retry-After`, each wait capped at `maxWaitMs`.
 *
 * A body that cannot be replayed (a stream) is never sent again.
 */
export class RetryPolicy {
  readonly maxRetries: number;
  readonly maxWaitMs: number;
  readonly backoffMs: number;

  constructor(maxRetries = DEFAULT_MAX_RETRIES, maxWaitMs = DEFAULT_MAX_RETRY_WAIT_MS, backoffMs = RETRY_BACKOFF_MS) {
    if (!Number.isInteger(maxRetries) || maxRetries < 0) {
      throw new RunboxError(0, "bad_request", `maxRetries must be a whole number, 0 or more, not ${maxRetries}`);
    }
    if (!(maxWaitMs >= 0)) throw new RunboxError(0, "bad_request", `maxRetryWaitMs must be 0 or more, not ${maxWaitMs}`);
    this.maxRetries = maxRetries;
    this.maxWaitMs = maxWaitMs;
    this.backoffMs = backoffMs;
  }

  /**
   * The wait (ms) before sending `request` again when the server answered
   * it with `status` (its error `code`, and this `Retry-After`), after
   * `retries` retries so far; undefined: do not. A `503 run_moved` is sent
   * again whatever the method.
   */
  afterAnswer(
    request: RetryRequest,
    status: number,
    retryAfter: string | null | undefined,
    retries: number,
    code?: string,
  ): number | undefined {
    if (retries >= this.maxRetries || (status !== 429 && status !== 503)) return undefined;
    // The run moved to another node of the fleet before the call did anything.
    const moved = status === 503 && code === "run_moved";
    if (!(moved || repeatable(request)) || !replayable(request.body)) return undefined;
    const wait = retryAfterMs(retryAfter);
    return wait === undefined ? undefined : Math.min(wait, this.maxWaitMs);
  }

  /**
   * The wait (ms) before sending `request` again when it failed with no
   * answer (`failure`, see {@link failureKind}), after `retries` retries so
   * far; undefined: do not.
   */
  afterFailure(request: RetryRequest, failure: Failure, retries: number): number | undefined {
    if (retries >= this.maxRetries || !replayable(request.body)) return undefined;
    const lostButSafe = failure === "lost" && (["GET", "HEAD"].includes(request.method.toUpperCase()) || isKeyedCreate(request));
    if (failure !== "connect" && !lostButSafe) return undefined;
    return Math.min(this.backoffMs * 2 ** retries, this.maxWaitMs);
  }
}

/** A fresh `Idempotency-Key` for one create (sent again, unchanged, on each of its retries). */
export async function newIdempotencyKey(): Promise<string> {
  const web = (globalThis as { crypto?: { randomUUID?: () => string; getRandomValues?: (a: Uint8Array) => Uint8Array } }).crypto;
  if (typeof web?.randomUUID === "function") return web.randomUUID();
  // randomUUID is missing in a browser's insecure context; Node 18 has no global crypto.
  if (typeof web?.getRandomValues === "function") {
    return Array.from(web.getRandomValues(new Uint8Array(16)), (b) => b.toString(16).padStart(2, "0")).join("");
  }
  const { randomUUID } = await import("node:crypto");
  return randomUUID();
}

/** Resolves after `ms`, or at once (with false) when `signal` fires. */
export function sleep(ms: number, signal?: AbortSignal): Promise<boolean> {
  return new Promise((resolve) => {
    if (signal?.aborted) return resolve(false);
    const done = (slept: boolean) => {
      clearTimeout(timer);
      signal?.removeEventListener("abort", onAbort);
      resolve(slept);
    };
    const onAbort = () => done(false);
    const timer = setTimeout(() => done(true), ms);
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}
