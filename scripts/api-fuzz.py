"""The API fuzzer against a daemon of its own: schemathesis, driven by
docs/openapi.json, with every check on. Run by scripts/test-api-fuzz inside
a network namespace that has only loopback, so nothing a fuzzed request
asks for (an image pull from a registry, say) leaves the machine;
scripts/api-fuzz.toml says which rules the schema cannot state.

    python scripts/api-fuzz.py ST_BINARY [schemathesis args]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "sdks" / "python" / "tests"))

from daemon import Daemon  # noqa: E402


def create_run(d: Daemon) -> str:
    """A run for the run-scoped routes to act on (a fuzzed delete may end
    it; the routes then answer 404, which is what they should)."""
    req = urllib.request.Request(
        d.url + "/v1/runs",
        data=json.dumps({"image": "base", "ttlSec": 3600}).encode(),
        headers={"Authorization": f"Bearer {d.token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)["id"]


def main() -> int:
    st, *rest = sys.argv[1:]
    d = Daemon(name="fuzz", octet=240)
    try:
        # The settings, with the run's id as the value of every `id`.
        config = (ROOT / "scripts" / "api-fuzz.toml").read_text()
        config += f'\n[parameters]\n"path.id" = "{create_run(d)}"\n'
        file = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
        file.write(config)
        file.close()
        cmd = [
            st, "--config-file", file.name,
            "run", str(ROOT / "docs" / "openapi.json"),
            "--url", d.url,
            "-H", f"Authorization: Bearer {d.token}",
            *rest,
        ]
        # schemathesis keeps its cache (.schemathesis/) in its working
        # directory: under target/, not in the tree.
        cwd = ROOT / "target" / "fuzz"
        cwd.mkdir(parents=True, exist_ok=True)
        code = subprocess.run(cmd, cwd=cwd).returncode
        if code != 0:
            # What the daemon said of the failures (its state directory,
            # log included, goes with it).
            errors = [line for line in d.log().splitlines() if "ERROR" in line or "WARN" in line]
            print("daemon errors and warnings:", *errors[-40:], sep="\n", file=sys.stderr)
        return code
    finally:
        d.stop()


if __name__ == "__main__":
    sys.exit(main())
