// A real runbox daemon for the SDK's tests: the workspace's own debug
// build, with a state directory, nftables table and address pool of its
// own, the busybox image imported as `base`; torn down (every run
// destroyed) when the tests end, whatever they did.
import { execFileSync, spawn } from "node:child_process";
import { existsSync, mkdtempSync, openSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "../../..");
const TARGET = process.env.CARGO_TARGET_DIR ?? join(ROOT, "target");
const RUNBOX = process.env.RUNBOX_BIN ?? join(TARGET, "debug", "runbox");
const AGENT = process.env.RUNBOX_AGENT_BIN ?? join(TARGET, "x86_64-unknown-linux-gnu", "debug", "runbox-agent");

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

export class Daemon {
  // `name` tells its nftables table and state directory apart from other
  // test daemons'; `octet` its address pool (10.<octet>.x.0/24); `args`
  // more `runbox serve` arguments.
  static async start({ name = "ts", octet = 234, args = [] } = {}) {
    for (const [binary, how] of [[RUNBOX, "cargo build -p runbox-cli"], [AGENT, "scripts/build-agent"]]) {
      if (!existsSync(binary)) throw new Error(`${binary} is missing: run \`${how}\` first (scripts/test does)`);
    }
    const d = new Daemon();
    d.state = mkdtempSync(join(tmpdir(), `runbox-${name}-`));
    const log = openSync(join(d.state, "daemon.log"), "w");
    const n = process.pid;
    d.proc = spawn(
      RUNBOX,
      [
        "serve",
        "--listen", "127.0.0.1:0",
        "--state-dir", d.state,
        "--agent", AGENT,
        "--storage-gb", "8",
        "--preview-listen", "127.0.0.1:0",
        "--nft-table", `rbx${name}${n}`,
        "--open-pool", `10.${octet}.${n % 256}.0/24`,
        ...args,
      ],
      { stdio: ["ignore", "ignore", log] },
    );
    // A killed test process still tears its daemon and runs down.
    d.onSignal = () => {
      d.stop();
      process.exit(130);
    };
    process.once("SIGTERM", d.onSignal);
    process.once("SIGINT", d.onSignal);
    const addr = join(d.state, "serve.addr");
    const deadline = Date.now() + 60_000;
    while (!existsSync(addr)) {
      if (d.proc.exitCode !== null || Date.now() > deadline) throw new Error(`runbox serve did not start:\n${d.log()}`);
      await sleep(20);
    }
    d.url = `http://${readFileSync(addr, "utf8").trim()}`;
    d.token = readFileSync(join(d.state, "token"), "utf8").trim();
    const rootfs = join(d.state, "rootfs");
    execFileSync(join(ROOT, "scripts", "mkimage-busybox"), [rootfs], { stdio: "ignore" });
    execFileSync(RUNBOX, ["image", "import", "base", rootfs, "--url", d.url, "--token", d.token], { stdio: "ignore" });
    return d;
  }

  log() {
    return readFileSync(join(this.state, "daemon.log"), "utf8");
  }

  stop() {
    if (!this.proc) return;
    process.removeListener("SIGTERM", this.onSignal);
    process.removeListener("SIGINT", this.onSignal);
    this.proc.kill("SIGKILL");
    this.proc = undefined;
    // Synchronous on purpose: this runs from signal handlers too.
    // The teardown needs the state directory's lock, which the killed
    // daemon holds until it is gone: retry for a while.
    for (let i = 0; i < 100; i++) {
      try {
        execFileSync(RUNBOX, ["serve", "--teardown", "--state-dir", this.state], { stdio: "ignore" });
        break;
      } catch {
        Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 100);
      }
    }
    try {
      execFileSync("umount", ["-l", join(this.state, "runs")], { stdio: "ignore" });
    } catch {}
    rmSync(this.state, { recursive: true, force: true });
  }
}
