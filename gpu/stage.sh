#!/usr/bin/env bash
# Builds everything the GPU machine runs and copies it into .gpu/ (git-ignored; name it in `carry`).
# The GPU machine has no Rust toolchain: it runs what this script staged with gpu/run.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu && mkdir -p .gpu/tests .gpu/benches .gpu/lib
cargo build --release
cp target/release/librefit.so .gpu/lib/
# Test and bench executables: cargo names them with a hash, so ask it for the paths.
cargo test --release --no-run --message-format=json 2>/dev/null |
  python3 -c '
import json, sys, shutil, os
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        kind = m["target"]["kind"][0]
        name = m["target"]["name"]
        if kind == "test" and name.startswith("gpu_"):
            shutil.copy(m["executable"], ".gpu/tests/" + name)
'
cargo bench --no-run --message-format=json 2>/dev/null |
  python3 -c '
import json, sys, shutil
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "bench" in m["target"]["kind"]:
        shutil.copy(m["executable"], ".gpu/benches/" + m["target"]["name"])
'
cargo build --release --examples
mkdir -p .gpu/examples && cp target/release/examples/demo .gpu/examples/
# Only 64 MiB travel to the GPU machine: drop debug info.
strip --strip-debug .gpu/lib/* .gpu/tests/* .gpu/benches/* .gpu/examples/*
ls -la .gpu/tests .gpu/benches .gpu/examples
du -sh .gpu
