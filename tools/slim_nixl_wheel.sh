#!/bin/sh
# Unpacks a nixl-cu13 / nixl-cu12 wheel into DIR keeping only what NIXL's
# UCX back end needs on one host (the Python API, libnixl, the UCX plugin,
# UCX with its shared-memory, CMA, TCP and CUDA transports, and the shared
# libraries they load), so that it fits a small upload. KEEP_IB=1 keeps
# UCX's InfiniBand/RoCE transports (RDMA between hosts). Then use it with
#   PYTHONPATH=DIR python ...      (numpy needed; torch only for GPU tensors)
#
# usage: tools/slim_nixl_wheel.sh nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl DIR
# needs: unzip, readelf (binutils)
set -eu
wheel=$1
out=$2
[ -e "$out" ] && { echo "$out exists; refusing to overwrite it" >&2; exit 1; }
mkdir -p "$out"
unzip -q "$wheel" -d "$out"
cd "$out"
pkg=$(ls -d nixl_cu1? | head -1)
rm -rf nixl_ep_cu1? ./*.dist-info ./*.data "$pkg".scripts
# Plugins and telemetry exporters other than UCX (both plugin folders).
find . -path '*plugin*' -name 'lib*.so' ! -name 'libplugin_UCX.so' -delete
find "$pkg".libs/nixl -name 'lib*.so' ! -name 'libplugin_UCX.so' -delete
# UCX perftest modules; InfiniBand transports unless KEEP_IB=1.
rm -f "$pkg".libs/ucx/libucx_perftest* "$pkg".libs/ucx/*.la
[ "${KEEP_IB:-0}" = 1 ] || rm -f "$pkg".libs/ucx/libuct_ib*
# The NEEDED closure of what is left, from the Python extensions, the UCX
# plugins, libnixl and UCX's transport modules; drop every other bundled library.
keep=$(mktemp)
todo=$(find "$pkg" ".$pkg.mesonpy.libs/plugins" "$pkg.libs/nixl" "$pkg.libs/ucx" -name '*.so*' -type f)
for f in $todo; do basename "$f"; done > "$keep"
while [ -n "$todo" ]; do
  next=""
  for f in $todo; do
    for n in $(readelf -d "$f" 2>/dev/null | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
      grep -qxF "$n" "$keep" && continue
      echo "$n" >> "$keep"
      for p in "$pkg.libs/$n" ".$pkg.mesonpy.libs/$n"; do
        [ -f "$p" ] && next="$next $p"
      done
    done
  done
  todo=$next
done
for f in "$pkg".libs/*.so* ".$pkg".mesonpy.libs/*.so*; do
  [ -f "$f" ] || continue
  grep -qxF "$(basename "$f")" "$keep" || rm -f "$f"
done
rm -f "$keep"
du -sh .
