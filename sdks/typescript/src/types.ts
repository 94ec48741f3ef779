/**
 * The API's wire types, named. They come from `schema.ts`, which is
 * generated from docs/openapi.json (`npm run gen`), so they cannot drift
 * from the daemon's own.
 */
import type { components } from "./schema.js";

type Schemas = components["schemas"];

export type Run = Schemas["Run"];
export type RunStatus = Schemas["RunStatus"];
export type Limits = Schemas["Limits"];
export type Lease = Schemas["Lease"];
export type ExitEvent = Schemas["ExitEvent"];
export type ExitReason = Schemas["ExitReason"];
export type Process = Schemas["Process"];
export type FileInfo = Schemas["FileInfo"];
export type FileList = Schemas["FileList"];
export type WatchEvent = Schemas["WatchEvent"];
export type Image = Schemas["Image"];
export type Snapshot = Schemas["Snapshot"];
export type Checkpoint = Schemas["Checkpoint"];
export type Tenant = Schemas["Tenant"];
export type TenantToken = Schemas["TenantToken"];
export type CreateTenantRequest = Schemas["CreateTenantRequest"];
export type UpdateTenantRequest = Schemas["UpdateTenantRequest"];
export type UpdateEgressRequest = Schemas["UpdateEgressRequest"];
export type BroughtSecret = Schemas["BroughtSecret"];
export type UsageReport = Schemas["UsageReport"];
export type Volume = Schemas["Volume"];
export type VolumeMountRequest = Schemas["VolumeMountRequest"];
export type Preview = Schemas["Preview"];
export type Info = Schemas["Info"];
export type Health = Schemas["Health"];
export type PullEvent = Schemas["PullEvent"];
export type Build = Schemas["Build"];
export type BuildStep = Schemas["BuildStep"];
export type BuildLog = Schemas["BuildLog"];
export type BuildRequest = Schemas["BuildRequest"];
export type BuildStepSpec = Schemas["BuildStepSpec"];
export type BuildContext = Schemas["BuildContext"];
/** One event of a build's stream; `done` is the last. */
export type BuildEvent =
  | { type: "step"; step: BuildStep }
  | { type: "log"; log: BuildLog }
  | { type: "done"; build: Build };
export type HistorySettings = Schemas["HistorySettings"];
export type HistoryList = Schemas["HistoryList"];
export type HistoryPoint = Schemas["HistoryPoint"];
export type PointCause = Schemas["PointCause"];
export type PointKind = Schemas["PointKind"];
export type ChangeSummary = Schemas["ChangeSummary"];
export type HistoryDiff = Schemas["HistoryDiff"];
export type PathChange = Schemas["PathChange"];
export type PathChangeKind = Schemas["PathChangeKind"];
export type PathState = Schemas["PathState"];
export type CreateRunRequest = Schemas["CreateRunRequest"];
export type NetworkTier = Schemas["NetworkTier"];
export type SizeTier = Schemas["SizeTier"];

/** A writable lease's credential: who holds it, and its generation. */
export interface LeaseCredential {
  owner: string;
  generation: number;
}

/** One event of an exec stream, a process's output, or a session. */
export type ExecEvent =
  | { type: "started"; pid: number }
  | { type: "stdout"; data: Uint8Array }
  | { type: "stderr"; data: Uint8Array }
  /** A reader that fell behind skipped `chunks` chunks of output. */
  | { type: "lost"; chunks: number }
  | ({ type: "exit" } & ExitEvent);

/** What `run()` and `Session.wait()` return: all output and the exit. */
export class ExecResult {
  constructor(
    readonly pid: number | undefined,
    readonly stdout: Uint8Array,
    readonly stderr: Uint8Array,
    readonly exit: ExitEvent,
  ) {}

  get exitCode(): number {
    return this.exit.exitCode;
  }

  /** The history point the command's changes were kept as (runs with a
   * history; undefined when it changed no file). */
  get point(): string | undefined {
    return this.exit.point ?? undefined;
  }

  /** stdout as UTF-8 text. */
  get text(): string {
    return new TextDecoder().decode(this.stdout);
  }

  /** stderr as UTF-8 text. */
  get stderrText(): string {
    return new TextDecoder().decode(this.stderr);
  }
}

/** Collects output events into one {@link ExecResult}. */
export class OutputCollector {
  pid: number | undefined;
  private out: Uint8Array[] = [];
  private err: Uint8Array[] = [];

  add(event: ExecEvent): ExecResult | undefined {
    switch (event.type) {
      case "started":
        this.pid = event.pid;
        return undefined;
      case "stdout":
        this.out.push(event.data);
        return undefined;
      case "stderr":
        this.err.push(event.data);
        return undefined;
      case "lost":
        return undefined;
      case "exit": {
        const { type: _, ...exit } = event;
        return new ExecResult(this.pid, concat(this.out), concat(this.err), exit);
      }
    }
  }
}

export function concat(parts: Uint8Array[]): Uint8Array {
  const total = parts.reduce((n, p) => n + p.length, 0);
  const all = new Uint8Array(total);
  let at = 0;
  for (const p of parts) {
    all.set(p, at);
    at += p.length;
  }
  return all;
}
