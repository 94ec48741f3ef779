#!/usr/bin/env python3
"""Writes a small seed corpus for the unpack_layer fuzz target.

Each seed is a tar stream (stdlib tarfile, no other dependency) exercising
one family of layer features: plain entries, long names, whiteouts, device
nodes, replacements, and the hostile shapes the unpacker must refuse.
Usage: python3 make_seeds.py [DIR]   (default: corpus/unpack_layer)
"""
import io
import os
import sys
import tarfile


def entry(name, kind=tarfile.REGTYPE, data=b"", link="", mode=None, dev=(0, 0)):
    if mode is None:
        mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
    return (name, kind, data, link, mode, dev)


def build(entries, fmt):
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for name, kind, data, link, mode, dev in entries:
            info = tarfile.TarInfo(name)
            info.type = kind
            info.size = len(data)
            info.linkname = link
            info.mode = mode
            info.uid, info.gid = 1000, 1000
            info.mtime = 1_700_000_000
            info.devmajor, info.devminor = dev
            tar.addfile(info, io.BytesIO(data) if data else None)
    raw = out.getvalue().rstrip(b"\0")
    # Keep one zero block as the end marker; the rest is record padding.
    end = -(-len(raw) // 512) * 512
    return raw + b"\0" * (end - len(raw) + 512)


D, F, S, L = tarfile.DIRTYPE, tarfile.REGTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE
LONG = "./" + "long-component/" * 9 + "file"

SEEDS = {
    "plain": (tarfile.USTAR_FORMAT, [
        entry("./", D, mode=0o755), entry("./etc/", D, mode=0o755),
        entry("./etc/hosts", data=b"127.0.0.1 localhost\n"),
        entry("./bin/su", data=b"su", mode=0o4755),
        entry("./bin/sh", S, link="/bin/busybox"),
        entry("./bin/su2", L, link="./bin/su"),
    ]),
    "gnu-long": (tarfile.GNU_FORMAT, [
        entry(LONG, data=b"gnu"), entry(LONG + "-link", S, link=LONG),
        entry(LONG + "-hard", L, link=LONG),
    ]),
    "pax-long": (tarfile.PAX_FORMAT, [
        entry(LONG, data=b"pax"), entry(LONG + "-link", S, link="x" * 150),
    ]),
    "whiteouts": (tarfile.USTAR_FORMAT, [
        entry("./.wh.gone"), entry("./dir/", D), entry("./dir/.wh..wh..opq"),
        entry("./dir/keep", data=b"k"), entry("./sub/.wh.x"),
        entry("./file", data=b"f"), entry("./.wh.file"), entry("./.wh.d2"),
        entry("./d2/", D), entry("./.wh..wh.plnk"),
    ]),
    "devices": (tarfile.USTAR_FORMAT, [
        entry("./dev/null", tarfile.CHRTYPE, dev=(1, 3)),
        entry("./dev/sda", tarfile.BLKTYPE, dev=(8, 0)),
        entry("./run/fifo", tarfile.FIFOTYPE),
    ]),
    "replace": (tarfile.USTAR_FORMAT, [
        entry("a", data=b"1"), entry("a", S, link="t"), entry("b", S, link="/etc"),
        entry("b", data=b"2"), entry("c/", D), entry("c/x"), entry("c", data=b"3"),
        entry("d"), entry("d/", D), entry("e", data=b"e"), entry("f", L, link="e"),
    ]),
    "hostile": (tarfile.USTAR_FORMAT, [
        entry("link", S, link="/etc"), entry("link/passwd", data=b"x"),
    ]),
    "hostile-up": (tarfile.USTAR_FORMAT, [
        entry("up", S, link=".."), entry("up/x", data=b"x"),
    ]),
    "hostile-hardlink": (tarfile.USTAR_FORMAT, [
        entry("x", L, link="../victim"),
    ]),
    "hostile-abs": (tarfile.USTAR_FORMAT, [entry("/abs", data=b"x")]),
    "hostile-dotdot": (tarfile.USTAR_FORMAT, [entry("a/../../x", data=b"x")]),
}


def main():
    target = sys.argv[1] if len(sys.argv) > 1 else "corpus/unpack_layer"
    os.makedirs(target, exist_ok=True)
    for name, (fmt, entries) in SEEDS.items():
        with open(os.path.join(target, f"seed-{name}.tar"), "wb") as out:
            out.write(build(entries, fmt))
    print(f"wrote {len(SEEDS)} seeds to {target}")


if __name__ == "__main__":
    main()
