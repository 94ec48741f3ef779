"""create -> `echo hi` -> kill, through the unmodified E2B Python SDK, the
runbox Python SDK and raw HTTP, cold and from a warm pool, against a daemon
of its own (scripts/bench-e2b runs it on the release build).

    scripts/bench-e2b [ITERATIONS]
    E2B_BENCH_PARTS=1 scripts/bench-e2b [ITERATIONS]   (also each call's p50 in the E2B lane)

Prints one line per lane: p50 and p95 in milliseconds. Between warm
iterations it waits until the pool is full again, so every warm create
finds a ready member (what a pool is sized for); cold creates have no pool.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sdks" / "python" / "tests"))

from daemon import Daemon  # noqa: E402

WARM = 4
# The E2B lane's (create, commands.run, kill) times, for E2B_BENCH_PARTS=1.
PARTS: List[tuple] = []


def quantile(samples: List[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def e2b_lane(size: str) -> Callable[[], None]:
    from e2b import Sandbox

    del size  # E2B creates take the smallest pooled tier by themselves

    def once() -> None:
        start = time.perf_counter()
        sbx = Sandbox.create(timeout=120)
        created = time.perf_counter()
        result = sbx.commands.run("echo hi")
        ran = time.perf_counter()
        assert result.stdout == "hi\n", result
        sbx.kill()
        PARTS.append((created - start, ran - created, time.perf_counter() - ran))

    return once


def runbox_lane(d: Daemon, size: str) -> Callable[[], None]:
    from runbox import Runbox

    client = Runbox(url=d.url, token=d.token)

    def once() -> None:
        run = client.create_run("base", size=size or None, ttl=120)
        result = client.run(run.id, ["sh", "-c", "echo hi"])
        assert result.stdout == b"hi\n", result
        client.delete_run(run.id)

    return once


def http_lane(d: Daemon, size: str) -> Callable[[], None]:
    http = httpx.Client(base_url=d.url, headers={"Authorization": f"Bearer {d.token}"})

    def once() -> None:
        body: Dict[str, object] = {"image": "base", "ttlSec": 120}
        if size:
            body["size"] = size
        run = http.post("/v1/runs", json=body)
        run.raise_for_status()
        rid = run.json()["id"]
        out = http.post(f"/v1/runs/{rid}/exec", json={"cmd": ["sh", "-c", "echo hi"]})
        assert b"aGk" in out.content or b"hi" in out.content, out.text
        http.delete(f"/v1/runs/{rid}").raise_for_status()

    return once


def set_pools(d: Daemon, pools: list) -> None:
    r = httpx.put(f"{d.url}/v1/pools", json={"pools": pools}, headers={"Authorization": f"Bearer {d.token}"})
    r.raise_for_status()


def wait_full(d: Daemon) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pools = httpx.get(f"{d.url}/v1/pools", headers={"Authorization": f"Bearer {d.token}"}).json()["pools"]
        if all(p["ready"] >= p["warm"] and not p["refilling"] for p in pools):
            return
        time.sleep(0.05)
    raise TimeoutError("the pool did not refill within 60 s")


def measure(name: str, once: Callable[[], None], n: int, between: Callable[[], None]) -> None:
    once()  # the first call pays for imports and connection set-up
    samples = []
    for _ in range(n):
        between()
        start = time.perf_counter()
        once()
        samples.append((time.perf_counter() - start) * 1000)
    print(
        f"{name:<24} n={n:<4} p50 {statistics.median(samples):7.1f} ms   p95 {quantile(samples, 0.95):7.1f} ms",
        flush=True,
    )


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    d = Daemon(name="e2bbench", octet=236)
    os.environ.update(E2B_API_KEY=d.token, E2B_API_URL=d.url, E2B_SANDBOX_URL=d.url)
    try:
        idle = lambda: time.sleep(0.2)  # noqa: E731  let the last delete settle
        for label, size, between in (("cold", "", idle), ("warm pool", "small", lambda: wait_full(d))):
            set_pools(d, [{"image": "base", "size": "small", "warm": WARM}] if size else [])
            if size:
                wait_full(d)
            PARTS.clear()
            measure(f"e2b SDK, {label}", e2b_lane(size), n, between)
            if os.environ.get("E2B_BENCH_PARTS") == "1":
                parts = PARTS[1:]  # not the warm-up call
                create, run, kill = (statistics.median(p[i] for p in parts) * 1000 for i in range(3))
                print(f"  of which p50: create {create:.1f} ms, commands.run {run:.1f} ms, kill {kill:.1f} ms", flush=True)
            measure(f"runbox SDK, {label}", runbox_lane(d, size), n, between)
            measure(f"raw HTTP, {label}", http_lane(d, size), n, between)
        set_pools(d, [])
    finally:
        d.stop()


if __name__ == "__main__":
    main()
