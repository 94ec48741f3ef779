"""The API fuzzer against a daemon of its own: schemathesis, driven by
docs/openapi.json, with every check on. Run by scripts/test-api-fuzz inside
a network namespace that has only loopback, so nothing a fuzzed request
asks for (an image pull from a registry, say) leaves the machine.

    python scripts/api-fuzz.py ST_BINARY [schemathesis args]
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "sdks" / "python" / "tests"))

from daemon import Daemon  # noqa: E402


def main() -> int:
    st, *rest = sys.argv[1:]
    d = Daemon(name="fuzz", octet=240)
    try:
        cmd = [
            st, "run", str(ROOT / "docs" / "openapi.json"),
            "--url", d.url,
            "-H", f"Authorization: Bearer {d.token}",
            *rest,
        ]
        return subprocess.run(cmd).returncode
    finally:
        d.stop()


if __name__ == "__main__":
    sys.exit(main())
