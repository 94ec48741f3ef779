/** Errors: every failure the SDK reports is a {@link RunboxError}. */

/**
 * The daemon answered with an error, or could not be talked to.
 *
 * `code` is the API's stable error code (`run_not_found`,
 * `command_not_found`, ...; see docs/api.md), `status` the HTTP status (0
 * when no answer came), `message` what to fix.
 */
export class RunboxError extends Error {
  readonly status: number;
  readonly code: string;

  constructor(status: number, code: string, message: string) {
    super(`${message} (${code})`);
    this.name = new.target.name;
    this.status = status;
    this.code = code;
  }
}

/** A 400: the request breaks a rule; the message says which. */
export class BadRequest extends RunboxError {}
/** A 401: no token, or the wrong one. */
export class Unauthorized extends RunboxError {}
/** A 403: a path escapes /work, the run refuses, a preview token is bad. */
export class Forbidden extends RunboxError {}
/** A 404: no such run, image, file, process or route. */
export class NotFound extends RunboxError {}
/** A 409: the state refuses it (a lease, a tag in use, a run not running). */
export class Conflict extends RunboxError {}
/** A 413: the body is larger than the server takes. */
export class TooLarge extends RunboxError {}
/** A 429, 502, 503 or 507: capacity, the run's agent, draining, storage. */
export class Unavailable extends RunboxError {}

/**
 * An image build ended without its image: a step failed (`build.error` has
 * the step, its exit code and last lines of output), it timed out, or it
 * was cancelled.
 */
export class BuildFailed extends RunboxError {
  readonly build: import("./types.js").Build;
  constructor(build: import("./types.js").Build) {
    super(0, build.error?.code ?? "build_failed", build.error?.message ?? "the build failed");
    this.build = build;
  }
}

/**
 * An exec or session stream ended without its exit: the connection broke,
 * and the command's fate is unknown.
 */
export class StreamEnded extends RunboxError {
  constructor(message = "the stream ended without an exit event") {
    super(0, "stream_ended", message);
  }
}

const BY_STATUS: Record<number, typeof RunboxError> = {
  400: BadRequest,
  401: Unauthorized,
  403: Forbidden,
  404: NotFound,
  409: Conflict,
  413: TooLarge,
  429: Unavailable,
  502: Unavailable,
  503: Unavailable,
  507: Unavailable,
};

/**
 * The error for a non-2xx answer. A body that is not runbox's error shape
 * becomes code `http_<status>` with (a bounded prefix of) its text.
 */
export function errorFrom(status: number, body: string, reason = ""): RunboxError {
  let code = `http_${status}`;
  let message = reason.trim() || `HTTP ${status}`;
  try {
    const detail = (JSON.parse(body) as { error?: { code?: unknown; message?: unknown } }).error;
    if (detail && typeof detail.code === "string" && typeof detail.message === "string") {
      code = detail.code;
      message = detail.message;
    } else {
      throw new Error("not an error body");
    }
  } catch {
    const text = body.slice(0, 512).trim();
    if (text) message = text;
  }
  const Class = BY_STATUS[status] ?? RunboxError;
  return new Class(status, code, message);
}
