"""E2B's own SDK test suite against runbox.

Starts a runbox daemon of its own (the workspace's debug build) whose
`base` image is the E2B-like template built by scripts/mkimage-e2b, points
the suite at it the way docs/e2b.md says, runs it, and afterwards checks
that the suite left nothing behind: no run, no snapshot image.

    python compat/e2b/conformance.py --repo E2B_CHECKOUT --image e2b-base.tar \
        [--js] [-- extra test-runner args]

The suite is not part of this repository: scripts/e2b-conformance fetches
nothing, it runs a checkout the caller points at. docs/e2b.md records the
counts and every remaining failure.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sdks" / "python" / "tests"))

from daemon import Daemon  # noqa: E402


def _get(d: Daemon, path: str) -> dict:
    req = urllib.request.Request(d.url + path, headers={"Authorization": f"Bearer {d.token}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


def leftovers(d: Daemon) -> list[str]:
    """What the suite left on the daemon: runs, and images other than base."""
    runs = [f"run {r['id']} {r.get('labels', {})}" for r in _get(d, "/v1/runs")["runs"]]
    images = [f"image {i['name']}" for i in _get(d, "/v1/images")["images"] if i["name"] != "base"]
    return runs + images


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", required=True, type=Path, help="a checkout of e2b-dev/E2B")
    ap.add_argument("--image", required=True, type=Path, help="scripts/mkimage-e2b's archive")
    ap.add_argument("--js", action="store_true", help="the JavaScript SDK's suite instead of Python's")
    ap.add_argument("--python", default=sys.executable, help="the interpreter with the SDK installed")
    ap.add_argument("rest", nargs="*", help="passed to the test runner")
    args = ap.parse_args()

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    d = Daemon(name="e2bconf", octet=238, base=args.image.resolve())
    env = dict(os.environ)
    env.update(
        E2B_API_KEY=f"e2b_{d.token}",
        E2B_API_URL=d.url,
        E2B_SANDBOX_URL=d.url,
        E2B_DOMAIN="runbox.localhost",
    )
    status = 1
    try:
        if args.js:
            cwd = args.repo / "packages" / "js-sdk"
            cmd = ["npx", "vitest", "run", "--project", "unit", *(args.rest or ["tests/sandbox", "tests/api"])]
        else:
            cwd = args.repo / "packages" / "python-sdk"
            cmd = [args.python, "-m", "pytest", "-rfE", "-p", "no:cacheprovider", *(args.rest or ["tests/sync", "tests/async"])]
        status = subprocess.run(cmd, cwd=cwd, env=env).returncode
        left = leftovers(d)
        if left:
            print(f"the suite left {len(left)} things behind: " + ", ".join(left[:30]))
            status = status or 1
        else:
            print("the suite left nothing behind")
    finally:
        d.stop()
    return status


if __name__ == "__main__":
    sys.exit(main())
