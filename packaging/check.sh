#!/usr/bin/env bash
# CI check of the install paths a user takes (README's first programs), on a scratch prefix:
#  1. packaging/install.sh with --destdir, then used from another directory (relocated): the
#     library's SONAME is librefit.so.<abi> and resolves through the installed symlinks;
#  2. examples/c/first.c built with pkg-config and run (the rpath comes from refit.pc);
#  3. README's C commands exactly as written (the block after its "packaging/check.sh runs" marker)
#     against a ~/.local prefix (HOME is a scratch directory), run with no LD_LIBRARY_PATH;
#  4. examples/cpp built with CMake's find_package(refit) and run (the rpath comes from the package);
#  5. `pip install ./python` into a fresh virtual environment, then examples/python/first.py and the
#     integration shim run from outside the repository with no REFIT_LIBRARY.
# Installs cmake and pkg-config from Debian when missing. Uses the debug library `cargo test` built
# (REFIT_CARGO_PROFILE=debug) so nothing is compiled twice.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

need=()
command -v cmake >/dev/null || need+=(cmake)
command -v pkg-config >/dev/null || need+=(pkg-config)
python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing ${need[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cargo build --package refit --lib --quiet
abi=$(sed -n 's/^#define REFIT_ABI_VERSION \([0-9]*\)$/\1/p' include/refit.h)

echo "--- install (staged under a destdir, then used from where it was moved)"
packaging/install.sh --prefix /opt/refit --destdir "$scratch/stage" --library target/debug/librefit.so
mv "$scratch/stage/opt/refit" "$scratch/refit"
prefix=$scratch/refit
soname=$(readelf -d "$prefix/lib/librefit.so" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[ "$soname" = "librefit.so.$abi" ] || { echo "SONAME is '$soname', expected librefit.so.$abi"; exit 1; }
[ "$(readlink "$prefix/lib/librefit.so")" = "librefit.so.$abi" ] || { echo "librefit.so link wrong"; exit 1; }

echo "--- C with pkg-config"
export PKG_CONFIG_PATH=$prefix/lib/pkgconfig
flags=$(pkg-config --cflags --libs refit)
cc -std=c11 -Wall -Wextra -Werror examples/c/first.c $flags -o "$scratch/first_c"
unset PKG_CONFIG_PATH
readelf -d "$scratch/first_c" | grep -q "NEEDED.*\[librefit.so.$abi\]" || { echo "first_c does not need librefit.so.$abi"; exit 1; }
env -u LD_LIBRARY_PATH "$scratch/first_c"

echo "--- README's C commands as written, against \$HOME/.local, with no LD_LIBRARY_PATH"
# The block after the marker line, without its fences: what a reader pastes.
readme_c=$(awk '/<!-- packaging\/check.sh runs the next block as written -->/ {armed = 1; next}
                armed && /^```/ {if (inside) exit; inside = 1; next}
                inside {print}' README.md)
[ -n "$readme_c" ] || { echo "README.md has no block after the packaging/check.sh marker"; exit 1; }
grep -q 'pkg-config' <<<"$readme_c" || { echo "README's checked block does not build with pkg-config:"; echo "$readme_c"; exit 1; }
home=$scratch/home
mkdir -p "$home" "$scratch/reader/examples/c"
HOME=$home packaging/install.sh --prefix "$home/.local" --library target/debug/librefit.so >/dev/null
cp examples/c/first.c "$scratch/reader/examples/c/"
printf '%s\n' "$readme_c"
(cd "$scratch/reader" && env -u LD_LIBRARY_PATH -u PKG_CONFIG_PATH HOME="$home" bash -euo pipefail -c "$readme_c")

echo "--- C++ with CMake find_package(refit)"
cmake -S examples/cpp -B "$scratch/build_cpp" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$scratch/build_cpp" >/dev/null
"$scratch/build_cpp/first"

echo "--- Python: pip install ./python into a fresh virtual environment"
python3 -m venv "$scratch/venv"
REFIT_CARGO_PROFILE=debug "$scratch/venv/bin/pip" install --quiet --disable-pip-version-check ./python
(
  cd "$scratch"
  unset REFIT_LIBRARY PYTHONPATH
  "$scratch/venv/bin/python" -c 'import refit, pathlib; assert pathlib.Path(refit.lib._name).parent == pathlib.Path(refit.__file__).parent, refit.lib._name'
  "$scratch/venv/bin/python" "$root/examples/python/first.py"
  "$scratch/venv/bin/python" "$root/examples/python/shim.py"
)
echo "packaging check passed"
