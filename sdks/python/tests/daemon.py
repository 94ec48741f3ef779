"""A real runbox daemon for tests: the workspace's own debug build, with a
state directory, run store, nftables table and address pool of its own,
the busybox image imported as `base`; `stop()` tears it down (every run
destroyed), whatever the tests did. Shared by the SDK's tests and the E2B
compatibility tests (compat/e2b/python)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
RUNBOX = Path(os.environ.get("RUNBOX_BIN", TARGET / "debug" / "runbox"))
AGENT = Path(os.environ.get("RUNBOX_AGENT_BIN", TARGET / "x86_64-unknown-linux-gnu" / "debug" / "runbox-agent"))


class Daemon:
    def __init__(
        self,
        name: str = "py",
        octet: int = 233,
        base: Path | None = None,
        args: tuple[str, ...] = (),
        listen: str = "127.0.0.1:0",
        env: dict[str, str] | None = None,
    ) -> None:
        """`name` tells its nftables table and state directory apart from
        other test daemons'; `octet` its address pool (10.<octet>.x.0/24);
        `base` an image archive to import as `base` instead of busybox;
        `args` more `runbox serve` arguments; `listen` its address; `env`
        more environment variables (a fleet node's key and password)."""
        for binary, how in ((RUNBOX, "cargo build -p runbox-cli"), (AGENT, "scripts/build-agent")):
            if not binary.exists():
                raise RuntimeError(f"{binary} is missing: run `{how}` first (scripts/test does)")
        self.state = Path(tempfile.mkdtemp(prefix=f"runbox-{name}-"))
        pid = os.getpid()
        log = open(self.state / "daemon.log", "wb")
        self.proc = subprocess.Popen(
            [
                str(RUNBOX), "serve",
                "--listen", listen,
                "--state-dir", str(self.state),
                "--agent", str(AGENT),
                "--storage-gb", "8",
                "--preview-listen", "127.0.0.1:0",
                "--nft-table", f"rbx{name}{pid}",
                "--open-pool", f"10.{octet}.{pid % 256}.0/24",
                *args,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            env={**os.environ, **(env or {})},
        )
        addr_file = self.state / "serve.addr"
        deadline = time.monotonic() + 60
        while not addr_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"runbox serve did not start:\n{self.log()}")
            time.sleep(0.02)
        self.url = f"http://{addr_file.read_text().strip()}"
        self.token = (self.state / "token").read_text().strip()
        rootfs = base
        if rootfs is None:
            rootfs = self.state / "rootfs"
            subprocess.run([str(ROOT / "scripts" / "mkimage-busybox"), str(rootfs)], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(
            [str(RUNBOX), "image", "import", "base", str(rootfs), "--url", self.url, "--token", self.token],
            check=True,
            stdout=subprocess.DEVNULL,
        )

    def log(self) -> str:
        return (self.state / "daemon.log").read_text(errors="replace")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        subprocess.run(
            [str(RUNBOX), "serve", "--teardown", "--state-dir", str(self.state)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        subprocess.run(["umount", "-l", str(self.state / "runs")], stderr=subprocess.DEVNULL)
        shutil.rmtree(self.state, ignore_errors=True)
