#!/usr/bin/env bash
# Builds librefit.so variants of per-tensor jobs' first phase (refit_quantize_amax, src/kernels/
# quantize.cu) for tensor_amax_probe.py, into .gpu/variants/ (run after gpu/stage.sh, which clears
# .gpu/). Each variant is the committed source with QUANT_AMAX_MIN_BLOCKS, QUANT_AMAX_LOADS and
# QUANT_AMAX_TILES (and the host's AMAX_TILES) set; built from a clone of HEAD, never this tree.
# Usage: benches/probes/tensor_amax_variants.sh [blocks:loads:tiles ...]   (default: the set below)
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
variants=("$@")
[ ${#variants[@]} -gt 0 ] || variants=(6:4:8 6:4:16 6:4:32 8:4:16 4:8:16 6:4:1)
clone=$(mktemp -d)
trap 'rm -rf "$clone"' EXIT
git clone -q "$root" "$clone"
mkdir -p .gpu/variants
for v in "${variants[@]}"; do
  IFS=: read -r blocks loads tiles <<<"$v"
  sed -i "s/^#define QUANT_AMAX_MIN_BLOCKS .*/#define QUANT_AMAX_MIN_BLOCKS ${blocks}u/;
          s/^#define QUANT_AMAX_LOADS .*/#define QUANT_AMAX_LOADS ${loads}u/;
          s/^#define QUANT_AMAX_TILES .*/#define QUANT_AMAX_TILES ${tiles}u/" "$clone/src/kernels/quantize.cu"
  sed -i "s/^pub const AMAX_TILES: u64 = .*/pub const AMAX_TILES: u64 = $tiles;/" "$clone/src/kernels/quantize.rs"
  (cd "$clone" && cargo build -q --release --lib --target-dir "$root/target-variants")
  cp target-variants/release/librefit.so ".gpu/variants/blocks${blocks}_loads${loads}_tiles${tiles}.so"
  strip --strip-debug ".gpu/variants/blocks${blocks}_loads${loads}_tiles${tiles}.so"
done
ls -la .gpu/variants
