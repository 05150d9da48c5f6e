#!/bin/sh
# A consumer of the *installed* library, through pkg-config only.
#
#   test_pkgconfig.sh BUILDDIR SRCDIR shared|static VERSION
#
# Installs BUILDDIR into a temporary DESTDIR (meson install --no-rebuild
# --destdir), points pkg-config at the attn.pc found there
# (PKG_CONFIG_PATH + PKG_CONFIG_SYSROOT_DIR), then compiles
# examples/attn_example.c with nothing but
#   $CC example.c $(pkg-config --cflags --libs attn) -lm          (shared)
#   $CC example.c $(pkg-config --cflags --static --libs attn) -lm (static,
#       with -lattn replaced by the installed libattn.a)
# and runs it. (-lm is the example's own need: it calls sqrtf/exp/log.)
#
# Environment: MESON (the meson command), CC (the C compiler command).
# Exit 0 pass, 1 fail, 77 skip. Cleans up after itself.
set -eu

if [ $# -ne 4 ]; then
  echo "usage: $0 BUILDDIR SRCDIR shared|static VERSION" >&2
  exit 2
fi
builddir=$1
srcdir=$2
mode=$3
version=$4
MESON=${MESON:-meson}
CC=${CC:-cc}

for tool in pkg-config "$MESON"; do
  if ! command -v "$tool" >/dev/null 2>&1 && [ ! -x "$tool" ]; then
    echo "SKIP: $tool not found"
    exit 77
  fi
done

tmp=$(mktemp -d "${TMPDIR:-/tmp}/attn-pkgconfig.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
trap 'exit 130' INT TERM HUP

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

dest=$tmp/dest
echo "== meson install -C $builddir --no-rebuild --destdir $dest"
if ! $MESON install -C "$builddir" --no-rebuild --destdir "$dest" >"$tmp/install.log" 2>&1; then
  cat "$tmp/install.log" >&2
  fail "meson install failed"
fi

pc=$(find "$dest" -type f -name attn.pc -path '*/pkgconfig/*' | head -n 1)
[ -n "$pc" ] || fail "no pkgconfig/attn.pc under the install tree"
pcdir=$(dirname "$pc")
echo "== found ${pc#"$dest"}"

PKG_CONFIG_PATH=$pcdir
PKG_CONFIG_SYSROOT_DIR=$dest
# Keep -I/-L even when the prefix is a system one (/usr): they point into
# the DESTDIR here.
PKG_CONFIG_ALLOW_SYSTEM_CFLAGS=1
PKG_CONFIG_ALLOW_SYSTEM_LIBS=1
export PKG_CONFIG_PATH PKG_CONFIG_SYSROOT_DIR PKG_CONFIG_ALLOW_SYSTEM_CFLAGS PKG_CONFIG_ALLOW_SYSTEM_LIBS

got_version=$(pkg-config --modversion attn) || fail "pkg-config cannot read attn.pc"
[ "$got_version" = "$version" ] || fail "pkg-config --modversion attn is '$got_version', expected '$version'"

cflags=$(pkg-config --cflags attn)
libs=$(pkg-config --libs attn)
echo "== cflags: $cflags"
echo "== libs:   $libs"

# The flags must point into the install tree, and the header must be there.
incdir=
libdir=
for w in $cflags; do
  case $w in -I*) incdir=${w#-I} ;; esac
done
for w in $libs; do
  case $w in -L*) libdir=${w#-L} ;; esac
done
[ -n "$incdir" ] || fail "--cflags has no -I (header not found from a non-system prefix)"
[ -n "$libdir" ] || fail "--libs has no -L"
case $incdir in "$dest"/*) ;; *) fail "-I$incdir is outside the install tree $dest" ;; esac
case $libdir in "$dest"/*) ;; *) fail "-L$libdir is outside the install tree $dest" ;; esac
[ -f "$incdir/attn/attn.h" ] || fail "$incdir/attn/attn.h not installed"

example=$srcdir/examples/attn_example.c
[ -f "$example" ] || fail "$example not found"

case $mode in
shared)
  [ -e "$libdir/libattn.so" ] || fail "libattn.so not installed in $libdir"
  # shellcheck disable=SC2086 # word splitting of the flags is intended
  $CC -o "$tmp/example" "$example" $cflags $libs -lm >"$tmp/cc.log" 2>&1 ||
    { cat "$tmp/cc.log" >&2; fail "compiling against the installed library failed"; }
  if command -v ldd >/dev/null 2>&1; then
    LD_LIBRARY_PATH=$libdir ldd "$tmp/example" | grep libattn || true
    LD_LIBRARY_PATH=$libdir ldd "$tmp/example" | grep libattn | grep -q "$dest" ||
      fail "the example does not resolve libattn from the install tree"
  fi
  echo "== running the example (LD_LIBRARY_PATH=$libdir)"
  LD_LIBRARY_PATH=$libdir "$tmp/example" || fail "the example failed (exit $?)"
  ;;
static)
  archive=$libdir/libattn.a
  [ -f "$archive" ] || fail "libattn.a not installed in $libdir"
  slibs=$(pkg-config --static --libs attn)
  echo "== static libs: $slibs"
  # -lattn would pick libattn.so; name the archive instead.
  linkflags=
  for w in $slibs; do
    if [ "$w" = "-lattn" ]; then linkflags="$linkflags $archive"; else linkflags="$linkflags $w"; fi
  done
  # shellcheck disable=SC2086
  if ! $CC -o "$tmp/example_static" "$example" $cflags $linkflags -lm >"$tmp/cc.log" 2>&1; then
    head -n 20 "$tmp/cc.log" >&2
    if grep -q -e "undefined reference to .operator" -e "__cxa_" -e "__gxx_personality" -e "std::" "$tmp/cc.log"; then
      echo "KNOWN PACKAGING BUG: attn.pc's Libs.private lacks the C++ runtime (e.g. -lstdc++)," >&2
      echo "so a C program cannot link libattn.a with 'pkg-config --static --libs attn'." >&2
    fi
    fail "static link with pkg-config --static failed"
  fi
  if command -v readelf >/dev/null 2>&1; then
    if readelf -d "$tmp/example_static" | grep NEEDED | grep -q libattn; then
      fail "the static example still needs libattn.so"
    fi
  fi
  echo "== running the statically linked example"
  env -u LD_LIBRARY_PATH "$tmp/example_static" || fail "the static example failed (exit $?)"
  ;;
*)
  echo "unknown mode '$mode'" >&2
  exit 2
  ;;
esac
echo "OK ($mode)"
