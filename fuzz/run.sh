#!/usr/bin/env bash
# Fuzzes unpack_layer for SECONDS (default 60) with the host protected.
#
# The target runs as root and writes files, so a bug that escaped the
# destination could overwrite anything. The fuzzer therefore runs in a
# private mount namespace where / is remounted read-only and only the
# scratch directory (a tmpfs, its TMPDIR), the corpus and the artifacts
# stay writable: an escape fails with EROFS and shows up as a crash or an
# error instead of damaging the machine.
#
# Needs root, nightly (or RUSTC_BOOTSTRAP=1 on stable) and cargo-fuzz.
set -euo pipefail

seconds="${1:-60}"
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here"

toolchain=()
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    toolchain=(+nightly)
else
    export RUSTC_BOOTSTRAP=1
fi

corpus="$here/corpus/unpack_layer"
artifacts="$here/artifacts/unpack_layer"
mkdir -p "$corpus" "$artifacts"
[ -n "$(ls -A "$corpus")" ] || python3 "$here/make_seeds.py" "$corpus"

cargo "${toolchain[@]}" fuzz build unpack_layer
binary="$here/target/x86_64-unknown-linux-gnu/release/unpack_layer"

scratch="$(mktemp -d /tmp/runbox-fuzz.XXXXXX)"
trap 'rm -rf "$scratch"' EXIT

unshare --mount --propagation private -- bash -euo pipefail -c '
    scratch="$1" corpus="$2" artifacts="$3" binary="$4" seconds="$5"
    # tmpfs: faster than disk for thousands of tiny trees a second, and it
    # has the trusted.* xattrs and device nodes whiteouts need.
    mount -t tmpfs -o size=1g,mode=0755 runbox-fuzz "$scratch"
    for dir in "$corpus" "$artifacts"; do
        mount --bind "$dir" "$dir"
    done
    mount -o remount,bind,ro /
    TMPDIR="$scratch" "$binary" "$corpus" \
        -artifact_prefix="$artifacts/" \
        -max_total_time="$seconds" -max_len=65536 -timeout=10 -rss_limit_mb=2048 \
        -print_final_stats=1
' _ "$scratch" "$corpus" "$artifacts" "$binary" "$seconds"
