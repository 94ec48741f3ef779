"""The API fuzzer against a daemon of its own: schemathesis, driven by
docs/openapi.json, with every check on. Run by scripts/test-api-fuzz inside
a network namespace that has only loopback, so nothing a fuzzed request
asks for (an image pull from a registry, say) leaves the machine;
scripts/api-fuzz.toml says which rules the schema cannot state.

    python scripts/api-fuzz.py ST_BINARY [schemathesis args]
"""

from __future__ import annotations

import http.client
import json
import random
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "sdks" / "python" / "tests"))

from daemon import Daemon  # noqa: E402


def post(d: Daemon, path: str, body: dict, token: str | None = None) -> dict:
    req = urllib.request.Request(
        d.url + path,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token or d.token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def create_run(d: Daemon, token: str | None = None) -> dict:
    """A run for the run-scoped routes to act on (a fuzzed delete may end
    it; the routes then answer 404, which is what they should)."""
    return post(d, "/v1/runs", {"image": "base", "ttlSec": 3600}, token)


def spelled(rng: random.Random, ident: str) -> str:
    """`ident` as a client might write it: any of its characters
    percent-encoded in either hex case, any letter in either case."""
    out = []
    for c in ident:
        if c.isalpha() and rng.random() < 0.3:
            c = c.lower()
        if rng.random() < 0.4:
            hex_ = f"%{ord(c):02X}"
            c = hex_.lower() if rng.random() < 0.5 else hex_
        out.append(c)
    return "".join(out)


def encoded_ids(d: Daemon, victim: str, examples: int) -> list[str]:
    """The positive check the schema cannot state: every operation on a
    run, with the run's id spelled every way a client may spell it, by a
    caller who may not touch the run (another tenant, another run's
    token), is never a 2xx. Answers the failures."""
    intruder = post(d, "/v1/tenants", {"name": "intruder"})["token"]
    own_token = create_run(d, intruder)["token"]
    spec = json.loads((ROOT / "docs" / "openapi.json").read_text())
    host = d.url.removeprefix("http://")
    rng = random.Random(38)
    failures = []
    fills = {
        "{path}": "f.txt",
        "{process}": "1",
        "{port}": "8080",
        "{point}": "01JF0000000000000000000000",
    }
    for route, ops in spec["paths"].items():
        if not route.startswith("/v1/runs/{id}"):
            continue
        for method in ops:
            if method not in ("get", "post", "put", "patch", "delete"):
                continue
            for _ in range(examples):
                path = route.replace("{id}", spelled(rng, victim))
                for key, value in fills.items():
                    path = path.replace(key, value)
                for token in (intruder, own_token):
                    conn = http.client.HTTPConnection(host, timeout=60)
                    conn.request(
                        method.upper(), path, body=b"{}",
                        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
                    )
                    answer = conn.getresponse()
                    text = answer.read().decode("utf-8", "replace")
                    conn.close()
                    # A route only root may take (its summary says
                    # "(root)") refuses everyone else before it looks at
                    # the id, so its 403 tells nothing of the run.
                    root_only = "(root)" in ops[method].get("summary", "")
                    refused = answer.status == 404 or (
                        root_only and answer.status == 403 and '"forbidden"' in text
                    )
                    if not refused:
                        failures.append(f"{method.upper()} {path}: {answer.status} {text[:160]}")
    return failures


def main() -> int:
    st, *rest = sys.argv[1:]
    d = Daemon(name="fuzz", octet=240)
    try:
        # First, while the run is whole: encoded ids of a run the caller
        # may not touch.
        victim = create_run(d)["id"]
        failures = encoded_ids(d, victim, examples=5)
        for failure in failures:
            print("encoded id reached a run it may not:", failure, file=sys.stderr)
        print(f"encoded ids: {len(failures)} operations reached the run", file=sys.stderr)
        if failures:
            return 1
        # The settings, with the run's id as the value of every `id`.
        config = (ROOT / "scripts" / "api-fuzz.toml").read_text()
        config += f'\n[parameters]\n"path.id" = "{victim}"\n'
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
