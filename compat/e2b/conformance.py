"""E2B's own SDK test suite against runbox.

Starts a runbox daemon of its own (the workspace's debug build) whose
`base` image is the E2B-like template built by scripts/mkimage-e2b, points
the suite at it the way docs/e2b.md says, runs it, and afterwards checks
that the suite left nothing behind: no run, no snapshot image.

    python compat/e2b/conformance.py --repo E2B_CHECKOUT --image e2b-base.tar \
        [--js] [--fleet] [-- extra test-runner args]

With --fleet the suite talks to a node of a two-node fleet (a private
PostgreSQL server started here) that has no room for runs of its own, so
every sandbox is made on the other node and every call reaches it through
the first.

The suite is not part of this repository: scripts/e2b-conformance fetches
nothing, it runs a checkout the caller points at. docs/e2b.md records the
counts and every remaining failure.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sdks" / "python" / "tests"))

from daemon import RUNBOX, Daemon  # noqa: E402


def _get(d: Daemon, path: str) -> dict:
    req = urllib.request.Request(d.url + path, headers={"Authorization": f"Bearer {d.token}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


# Images the suite's template builds start from, by the local name a pull
# of their reference would get: `ubuntu:22.04` is `ubuntu-22.04` (the same
# E2B-like Debian image, as no registry is reachable here); `e2bdev/base`
# is `base`.
PRELOADED = ("ubuntu-22.04",)


def preload(d: Daemon, image: Path) -> None:
    for name in PRELOADED:
        subprocess.run([str(RUNBOX), "image", "import", name, str(image), "--url", d.url, "--token", d.token],
                       check=True, stdout=subprocess.DEVNULL)


def builds_settle(d: Daemon, limit: float = 300) -> None:
    """Waits for builds the suite left running (its background builds are
    never waited for) to end: their build runs go when they do."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if not any(b["status"] == "building" for b in _get(d, "/v1/builds")["builds"]):
            return
        time.sleep(1)


def leftovers(d: Daemon) -> list[str]:
    """What the suite left on the daemon: runs, and images other than base
    and the preloaded ones. Templates the suite built stay, as they do on
    E2B (its tests never delete them): they are counted, not flagged."""
    runs = [f"run {r['id']} {r.get('labels', {})}" for r in _get(d, "/v1/runs")["runs"]]
    listed = _get(d, "/v1/images")["images"]
    built = [i for i in listed if i.get("source", "").startswith("build:")]
    if built:
        print(f"the suite built {len(built)} template images (kept, as E2B keeps them)")
    images = [f"image {i['name']}" for i in listed
              if i["name"] != "base" and i["name"] not in PRELOADED and i not in built]
    return runs + images


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Postgres:
    """A private PostgreSQL server (Debian's) in a temporary directory, on a
    loopback port, with a password login for `runbox`."""

    def __init__(self) -> None:
        bins = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
        if not bins:
            raise RuntimeError("PostgreSQL is missing: scripts/deps --test installs it")
        self.bin = bins[-1].parent
        self.dir = Path(tempfile.mkdtemp(prefix="runbox-pg-", dir="/tmp"))
        pg = pwd.getpwnam("postgres")
        os.chown(self.dir, pg.pw_uid, pg.pw_gid)
        self.password = f"pw-{os.getpid()}"
        (self.dir / "pw").write_text(self.password)
        os.chown(self.dir / "pw", pg.pw_uid, pg.pw_gid)
        self.port = free_port()
        self._as_postgres("initdb", "-D", str(self.dir / "data"), "-U", "runbox", "-A", "scram-sha-256",
                          "--no-sync", "--no-instructions", f"--pwfile={self.dir / 'pw'}")
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._as_postgres("pg_ctl", "-D", str(self.dir / "data"), "-w", "-o", options,
                          "-l", str(self.dir / "log"), "start")
        self.url = f"postgres://runbox@127.0.0.1:{self.port}/postgres"

    def _as_postgres(self, tool: str, *args: str) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", str(self.bin / tool), *args],
                       check=True, stdout=subprocess.DEVNULL)

    def stop(self) -> None:
        self._as_postgres("pg_ctl", "-D", str(self.dir / "data"), "-m", "immediate", "stop")
        subprocess.run(["rm", "-rf", str(self.dir)])


def fleet(image: Path) -> tuple[Postgres, Daemon, Daemon]:
    """A fleet of two nodes: `holder` makes the runs, `front` (no room of
    its own) is the one the suite is pointed at."""
    pg = Postgres()
    env = {"RUNBOX_CLUSTER_KEY": f"conformance-fleet-key-{os.getpid():032d}",
           "RUNBOX_CLUSTER_DB_PASSWORD": pg.password}
    nodes = []
    try:
        for name, octet, extra in (("e2bholder", 238, ()), ("e2bfront", 239, ("--max-runs", "0"))):
            listen = f"127.0.0.1:{free_port()}"
            args = ("--cluster-db", pg.url, "--node-id", name, "--advertise", listen, *extra)
            nodes.append(Daemon(name=name, octet=octet, base=image, args=args, listen=listen, env=env))
    except BaseException:
        for node in nodes:
            node.stop()
        pg.stop()
        raise
    return pg, nodes[0], nodes[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", required=True, type=Path, help="a checkout of e2b-dev/E2B")
    ap.add_argument("--image", required=True, type=Path, help="scripts/mkimage-e2b's archive")
    ap.add_argument("--js", action="store_true", help="the JavaScript SDK's suite instead of Python's")
    ap.add_argument("--python", default=sys.executable, help="the interpreter with the SDK installed")
    ap.add_argument("--fleet", action="store_true", help="through a node of a fleet that holds no sandbox")
    ap.add_argument("rest", nargs="*", help="passed to the test runner")
    args = ap.parse_args()

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    pg = None
    if args.fleet:
        pg, d, front = fleet(args.image.resolve())
    else:
        d = front = Daemon(name="e2bconf", octet=238, base=args.image.resolve())
    preload(d, args.image.resolve())
    env = dict(os.environ)
    env.update(
        E2B_API_KEY=f"e2b_{front.token}",
        E2B_API_URL=front.url,
        E2B_SANDBOX_URL=front.url,
        E2B_DOMAIN="runbox.localhost",
    )
    status = 1
    try:
        if args.js:
            cwd = args.repo / "packages" / "js-sdk"
            rest = args.rest or ["tests/sandbox", "tests/api"]
            # The unit project unless the caller names one (`--project template`).
            project = [] if any(a.startswith("--project") for a in rest) else ["--project", "unit"]
            cmd = ["npx", "vitest", "run", *project, *rest]
        else:
            cwd = args.repo / "packages" / "python-sdk"
            cmd = [args.python, "-m", "pytest", "-rfE", "-p", "no:cacheprovider", *(args.rest or ["tests/sync", "tests/async"])]
        status = subprocess.run(cmd, cwd=cwd, env=env).returncode
        builds_settle(d)
        left = leftovers(d)
        if left:
            print(f"the suite left {len(left)} things behind: " + ", ".join(left[:30]))
            status = status or 1
        else:
            print("the suite left nothing behind")
    finally:
        d.stop()
        if pg is not None:
            front.stop()
            pg.stop()
    return status


if __name__ == "__main__":
    sys.exit(main())
