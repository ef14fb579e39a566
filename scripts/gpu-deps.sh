#!/usr/bin/env bash
# Prepares the build dependencies for a GPU machine that has no package
# registry and no network (see scripts/gpu-check.sh, which runs there).
#
# Run HERE, on Debian 12 as root (apt-get works): it downloads the Debian
# packages the CMake configure needs with `apt-get download` into
# .gpu-deps/debs/ and unpacks them with `dpkg -x` into the prefix
# .gpu-deps/root/ (usr/include, usr/lib/x86_64-linux-gnu, usr/share/cmake,
# pkg-config files). Nothing is installed on this machine.
#
# The prefix is made relocatable, so it works wherever the working tree lands:
#  - CMake config files (nlohmann_json, CLI11, GTest) already compute their
#    prefix from their own location; CMAKE_PREFIX_PATH=<root>/usr finds them.
#  - pkg-config .pc files hold absolute /usr paths; they are rewritten to
#    ${pcfiledir}/..., a variable pkg-config and pkgconf both define.
#  - a -dev package's libfoo.so is a relative symlink to libfoo.so.N from the
#    runtime package, so both are downloaded; the script checks every link.
#  - pkgconf itself is bundled too (with a wrapper .gpu-deps/bin/pkg-config),
#    for a GPU machine that has no pkg-config.
#
# The GPU machine gets the prefix by naming it in the device tool's `carry`
# (.gpu-deps/ is git-ignored): carry ".gpu-deps/root" and ".gpu-deps/bin"
# (the .debs are not needed there).
set -uo pipefail

ROOT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEPS=$ROOT_DIR/.gpu-deps
DEBS=$DEPS/debs
PREFIX=$DEPS/root
MULTIARCH=x86_64-linux-gnu
MAX_MIB=40

# What the configure with -DKVB_CUDA=ON -DKVB_UCX=OFF -DKVB_BENCH=OFF
# -DKVB_PYTHON=OFF needs (find_package / pkg_check_modules in CMakeLists.txt,
# src/net, src/store; KVB_TESTS stays ON for gpu_test), -dev and runtime:
PACKAGES=(
  nlohmann-json3-dev          # find_package(nlohmann_json 3.10), header-only
  libxxhash-dev libxxhash0    # pkg_check_modules(XXHASH libxxhash)
  libcli11-dev                # find_package(CLI11), header-only
  libgtest-dev                # find_package(GTest); GMockTargets.cmake is OPTIONAL, so no libgmock-dev
  libssl-dev libssl3          # find_package(OpenSSL) -> OpenSSL::Crypto (src/net, src/store)
  libhiredis-dev libhiredis0.14  # pkg_check_modules(HIREDIS hiredis) (src/store)
  pkgconf-bin libpkgconf3     # find_package(PkgConfig REQUIRED), used only if the GPU machine has none
)

die() { echo "gpu-deps: $*" >&2; exit 1; }

# --- 1. preconditions -------------------------------------------------------
[[ $(id -u) -eq 0 ]] || die "run as root (apt-get download needs the apt lists; dpkg -x needs nothing else)"
if ! command -v apt-get >/dev/null || ! command -v dpkg >/dev/null; then
  die "needs apt-get and dpkg (Debian 12)"
fi
[[ $(dpkg --print-architecture) == amd64 ]] || die "the GPU machine is x86-64: run this on an amd64 Debian"

# --- 2. download the .debs ----------------------------------------------------
# apt-get download fetches the candidate version of each package (the one
# `apt-get install` would pick) without installing it; if the package lists
# are missing or stale it fails, and we run apt-get update once and retry.
mkdir -p "$DEBS"
rm -f "$DEBS"/*.deb
chmod 0777 "$DEBS" 2>/dev/null || true   # lets apt's sandbox user _apt write here (avoids a warning)
(cd "$DEBS" && apt-get download -q "${PACKAGES[@]}") || {
  echo "gpu-deps: apt-get download failed; running apt-get update and retrying" >&2
  apt-get update -q || die "apt-get update failed"
  (cd "$DEBS" && apt-get download -q "${PACKAGES[@]}") || die "apt-get download failed"
}
n_debs=$(find "$DEBS" -maxdepth 1 -name '*.deb' | wc -l)
[[ $n_debs -eq ${#PACKAGES[@]} ]] || die "expected ${#PACKAGES[@]} .debs in $DEBS, found $n_debs"

# --- 3. unpack into the prefix ------------------------------------------------
# dpkg -x extracts the data part only (no maintainer scripts, no dpkg database).
rm -rf "$PREFIX"
mkdir -p "$PREFIX"
for deb in "$DEBS"/*.deb; do
  dpkg -x "$deb" "$PREFIX" || die "dpkg -x $deb failed"
done

# --- 4. prune what a build never reads -------------------------------------
# Docs, man pages, the OpenSSL command-line docs and static libraries that the
# configure does not pick (it links the shared libssl/libcrypto, xxhash and
# hiredis; GoogleTest is static-only on Debian, so libgtest*.a stay).
rm -rf "$PREFIX"/usr/share/doc "$PREFIX"/usr/share/man "$PREFIX"/usr/share/lintian \
       "$PREFIX"/usr/src
rm -f "$PREFIX"/usr/lib/$MULTIARCH/{libcrypto,libssl,libxxhash,libhiredis}.a

# --- 5. headers in the multiarch include directory ----------------------------
# libssl-dev puts openssl/configuration.h and openssl/opensslconf.h in
# /usr/include/x86_64-linux-gnu/, which GCC searches by default only under
# /usr; FindOpenSSL names just <root>/usr/include. The prefix holds a single
# architecture, so move them next to the other OpenSSL headers.
if [[ -d "$PREFIX"/usr/include/$MULTIARCH/openssl ]]; then
  mv -n "$PREFIX"/usr/include/$MULTIARCH/openssl/* "$PREFIX"/usr/include/openssl/ || die "moving openssl headers failed"
  rmdir "$PREFIX"/usr/include/$MULTIARCH/openssl
fi
rmdir "$PREFIX"/usr/include/$MULTIARCH 2>/dev/null || true
[[ ! -e "$PREFIX"/usr/include/$MULTIARCH ]] || die "unexpected headers left in usr/include/$MULTIARCH: $(ls "$PREFIX"/usr/include/$MULTIARCH)"

# --- 6. make the pkg-config files relocatable --------------------------------
# Every "name=/usr..." variable becomes "name=${pcfiledir}/<up to usr>...".
# hiredis.pc also says libdir=/usr/lib although Debian's library lives in
# /usr/lib/x86_64-linux-gnu; point it there so -L names the real directory,
# and its Cflags name only <include>/hiredis while the code includes
# <hiredis/hiredis.h>: add <include> (on Debian /usr/include is implicit).
while IFS= read -r pc; do
  dir=$(dirname "$pc")
  rel=${dir#"$PREFIX"/usr/}                 # lib/x86_64-linux-gnu/pkgconfig or share/pkgconfig
  up=$(echo "$rel" | sed -E 's#[^/]+#..#g') # ../../.. or ../..
  if [[ $(basename "$pc") == hiredis.pc ]]; then
    sed -i -E -e "s#^libdir=/usr/lib\$#libdir=\${prefix}/lib/$MULTIARCH#" \
              -e 's#^(Cflags: -I\$\{includedir\})#\1 -I${prefix}/include#' "$pc"
  fi
  sed -i -E "s#^([A-Za-z_][A-Za-z0-9_.]*=)/usr(/|\$)#\1\${pcfiledir}/$up\2#" "$pc"
  if grep -nE '^[A-Za-z_][A-Za-z0-9_.]*=/usr' "$pc"; then
    die "$pc still holds an absolute /usr path"
  fi
done < <(find "$PREFIX" -name '*.pc')

# --- 7. a pkg-config for machines without one --------------------------------
# Debian's pkgconf (compiled-in search path /usr/...), run with its own
# libpkgconf.so.3 from the prefix; LD_LIBRARY_PATH is set for pkgconf alone,
# so cmake and the compiler never see the prefix's libraries.
mkdir -p "$DEPS"/bin
cat >"$DEPS"/bin/pkg-config <<'EOF'
#!/bin/sh
# pkg-config for the GPU machine: Debian 12's pkgconf from .gpu-deps/root.
here=$(cd "$(dirname "$0")/.." && pwd)
LD_LIBRARY_PATH="$here/root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  exec "$here/root/usr/bin/pkgconf" "$@"
EOF
chmod +x "$DEPS"/bin/pkg-config

# --- 8. checks ----------------------------------------------------------------
# Every symlink must resolve inside the prefix (libfoo.so -> libfoo.so.N).
bad=0
while IFS= read -r link; do
  target=$(readlink -f "$link")
  if [[ ! -e "$target" || "$target" != "$PREFIX"/* ]]; then
    echo "gpu-deps: dangling or escaping symlink: $link -> $(readlink "$link")" >&2
    bad=1
  fi
done < <(find "$PREFIX" -type l)
[[ $bad -eq 0 ]] || die "fix the symlinks above (a runtime package is missing?)"

# The files the configure looks for.
for f in usr/include/nlohmann/json.hpp usr/include/xxhash.h usr/include/CLI/CLI.hpp \
         usr/include/gtest/gtest.h usr/include/openssl/evp.h usr/include/hiredis/hiredis.h \
         usr/include/openssl/configuration.h \
         usr/share/cmake/nlohmann_json/nlohmann_jsonConfig.cmake usr/share/cmake/CLI11/CLI11Config.cmake \
         usr/lib/$MULTIARCH/cmake/GTest/GTestConfig.cmake \
         usr/lib/$MULTIARCH/libgtest.a usr/lib/$MULTIARCH/libgtest_main.a \
         usr/lib/$MULTIARCH/libcrypto.so usr/lib/$MULTIARCH/libssl.so \
         usr/lib/$MULTIARCH/libxxhash.so usr/lib/$MULTIARCH/libhiredis.so \
         usr/lib/$MULTIARCH/pkgconfig/libxxhash.pc usr/lib/$MULTIARCH/pkgconfig/hiredis.pc \
         usr/bin/pkgconf; do
  [[ -e "$PREFIX/$f" ]] || die "missing from the prefix: $f"
done

# The rewritten .pc files resolve into the prefix (with the bundled pkgconf,
# and only the prefix's .pc files on the search path).
for mod in libxxhash hiredis libcrypto; do
  flags=$(PKG_CONFIG_LIBDIR="$PREFIX/usr/lib/$MULTIARCH/pkgconfig:$PREFIX/usr/share/pkgconfig" \
          "$DEPS"/bin/pkg-config --cflags --libs "$mod") || die "pkg-config $mod failed"
  echo "gpu-deps: pkg-config $mod: $flags"
  [[ "$flags" == *"$PREFIX"* ]] || die "pkg-config $mod does not point into the prefix"
done

# --- 9. size ------------------------------------------------------------------
echo "gpu-deps: packages:"
for deb in "$DEBS"/*.deb; do
  echo "  $(dpkg-deb -W --showformat='${Package} ${Version}' "$deb")  ($(du -k "$deb" | cut -f1) KiB)"
done
for d in "$DEBS" "$PREFIX" "$DEPS"; do du -sh "$d"; done
mib=$(du -sm "$DEPS" | cut -f1)
[[ $mib -le $MAX_MIB ]] || die ".gpu-deps is $mib MiB, over $MAX_MIB MiB"
echo "gpu-deps: ok: prefix $PREFIX (carry .gpu-deps/root and .gpu-deps/bin to the GPU machine)"
