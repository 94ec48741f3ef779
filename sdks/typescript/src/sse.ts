/**
 * Server-sent events (the exec, output, watch and pull streams), from byte
 * chunks split anywhere. Written here rather than taken from a package: the
 * decoder is forty lines, and the streams come from `fetch` bodies, which
 * the EventSource API (GET only, no headers) cannot read.
 */
import type { ExecEvent } from "./types.js";

interface RawEvent {
  name: string;
  data: string;
}

export class SseDecoder {
  private buffer = "";
  private name = "";
  private data: string[] = [];
  private readonly text = new TextDecoder();

  /** The events completed by `chunk`. */
  feed(chunk: Uint8Array): RawEvent[] {
    this.buffer += this.text.decode(chunk, { stream: true });
    const out: RawEvent[] = [];
    for (;;) {
      const at = this.buffer.indexOf("\n");
      if (at < 0) break;
      let line = this.buffer.slice(0, at);
      this.buffer = this.buffer.slice(at + 1);
      if (line.endsWith("\r")) line = line.slice(0, -1);
      if (line === "") {
        if (this.name || this.data.length) out.push({ name: this.name, data: this.data.join("\n") });
        this.name = "";
        this.data = [];
      } else if (!line.startsWith(":")) {
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        let value = colon < 0 ? "" : line.slice(colon + 1);
        if (value.startsWith(" ")) value = value.slice(1);
        if (field === "event") this.name = value;
        else if (field === "data") this.data.push(value);
      }
    }
    return out;
  }
}

export function base64Bytes(text: string): Uint8Array {
  const binary = atob(text.replace(/\s/g, ""));
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  return bytes;
}

/** An exec stream's event; undefined for names a newer daemon may add. */
export function execEvent(raw: RawEvent): ExecEvent | undefined {
  switch (raw.name) {
    case "started":
      return { type: "started", pid: (JSON.parse(raw.data) as { pid: number }).pid };
    case "stdout":
      return { type: "stdout", data: base64Bytes(raw.data) };
    case "stderr":
      return { type: "stderr", data: base64Bytes(raw.data) };
    case "lost":
      return { type: "lost", chunks: (JSON.parse(raw.data) as { chunks: number }).chunks };
    case "exit":
      return { type: "exit", ...JSON.parse(raw.data) };
    default:
      return undefined;
  }
}
