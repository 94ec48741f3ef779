/**
 * The runbox client for TypeScript and JavaScript (ESM): `fetch` for calls
 * and streams, the WebSocket interface for interactive sessions.
 */
export { Runbox, DEFAULT_URL } from "./client.js";
export type { RunboxOptions, ExecOptions, ProcessOptions, CreateRunOptions, Command, LabelSelector } from "./client.js";
export { Session } from "./session.js";
export type { WebSocketConstructor, WebSocketLike } from "./session.js";
export {
  RunboxError,
  BadRequest,
  Unauthorized,
  Forbidden,
  NotFound,
  Conflict,
  TooLarge,
  Unavailable,
  StreamEnded,
  BuildFailed,
} from "./errors.js";
export { ExecResult } from "./types.js";
export type * from "./types.js";
export type { components, paths } from "./schema.js";
