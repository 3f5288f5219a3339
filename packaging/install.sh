#!/bin/sh
# Installs librefit for C and C++ programs, the way their build systems expect to find it:
#
#   PREFIX/lib/librefit.so.VERSION           the library (VERSION: the release, e.g. 0.1.0)
#   PREFIX/lib/librefit.so.ABI -> ...        its SONAME (ABI: REFIT_ABI_VERSION), what programs load
#   PREFIX/lib/librefit.so -> librefit.so.ABI    what `-lrefit` links at build time
#   PREFIX/include/refit.h, refit.hpp        the C header and the C++17 wrapper
#   PREFIX/lib/pkgconfig/refit.pc            `pkg-config --cflags --libs refit`
#   PREFIX/lib/cmake/refit/                  `find_package(refit)` -> imported target refit::refit
#
# Usage: packaging/install.sh [--prefix DIR] [--libdir DIR] [--destdir DIR] [--library FILE]
#   --prefix   where to install (default /usr/local)
#   --libdir   library directory (default PREFIX/lib; e.g. PREFIX/lib/x86_64-linux-gnu)
#   --destdir  staging root prepended to every path, for packagers (the files still name PREFIX)
#   --library  install this already-built librefit.so instead of running `cargo build --release`
#
# The pkg-config and CMake files locate the installation relative to themselves, so a staged or
# moved tree keeps working.
set -eu

root=$(cd "$(dirname "$0")/.." && pwd)
prefix=/usr/local
libdir=
destdir=
library=
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) prefix=$2; shift 2 ;;
    --libdir) libdir=$2; shift 2 ;;
    --destdir) destdir=$2; shift 2 ;;
    --library) library=$2; shift 2 ;;
    -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$prefix" in /*) ;; *) prefix=$(pwd)/$prefix ;; esac
[ -n "$libdir" ] || libdir=$prefix/lib
case "$libdir" in /*) ;; *) libdir=$prefix/$libdir ;; esac
case "$libdir" in
  "$prefix"/*) ;;
  *) echo "install.sh: --libdir must be inside --prefix ($prefix)" >&2; exit 2 ;;
esac
includedir=$prefix/include

# The release and ABI versions, from the header every caller compiles against.
header=$root/include/refit.h
define() { sed -n "s/^#define $1 \"\{0,1\}\([0-9.]*\)\"\{0,1\}$/\1/p" "$header"; }
version=$(define REFIT_VERSION_STRING)
abi=$(define REFIT_ABI_VERSION)
if [ -z "$version" ] || [ -z "$abi" ]; then
  echo "install.sh: $header lacks REFIT_VERSION_STRING or REFIT_ABI_VERSION" >&2
  exit 1
fi

if [ -z "$library" ]; then
  (cd "$root" && cargo build --package refit --release --lib)
  library=${CARGO_TARGET_DIR:-$root/target}/release/librefit.so
fi
if [ ! -f "$library" ]; then
  echo "install.sh: no library at $library" >&2
  exit 1
fi

# Paths from each generated file back to the prefix, so the files can be relocated.
relative_to_prefix() { # DIR -> "../.." (as many levels as DIR is below the prefix)
  rest=${1#"$prefix"}
  up=
  while [ -n "$rest" ] && [ "$rest" != / ]; do
    up=${up:+$up/}..
    rest=$(dirname "$rest")
  done
  echo "${up:-.}"
}
pcdir=$libdir/pkgconfig
cmakedir=$libdir/cmake/refit

install -d "$destdir$libdir" "$destdir$includedir" "$destdir$pcdir" "$destdir$cmakedir"
install -m 0755 "$library" "$destdir$libdir/librefit.so.$version"
ln -sf "librefit.so.$version" "$destdir$libdir/librefit.so.$abi"
ln -sf "librefit.so.$abi" "$destdir$libdir/librefit.so"
install -m 0644 "$root/include/refit.h" "$root/include/refit.hpp" "$destdir$includedir/"

fill() { # TEMPLATE OUTPUT: substitutes @VARIABLES@
  sed -e "s|@VERSION@|$version|g" -e "s|@ABI@|$abi|g" \
      -e "s|@PC_TO_PREFIX@|$(relative_to_prefix "$pcdir")|g" \
      -e "s|@CMAKE_TO_PREFIX@|$(relative_to_prefix "$cmakedir")|g" \
      -e "s|@LIBDIR@|${libdir#"$prefix"/}|g" \
      "$1" > "$2"
}
fill "$root/packaging/refit.pc.in" "$destdir$pcdir/refit.pc"
fill "$root/packaging/refitConfig.cmake.in" "$destdir$cmakedir/refitConfig.cmake"
fill "$root/packaging/refitConfigVersion.cmake.in" "$destdir$cmakedir/refitConfigVersion.cmake"
echo "installed refit $version (ABI $abi) into $destdir$prefix"
