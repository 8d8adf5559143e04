#!/usr/bin/env bash
# Peak RSS and wall time of compress, decompress, verify and recv on one
# safetensors cache (issue 12: these commands stream, so memory stays at a
# few pages per thread whatever the cache size).
#
#   cargo run --release --example make_synthetic_cache -- /tmp/llama8k.safetensors 8192
#   tools/stream_measure.sh target/release/kvpack /tmp/llama8k.safetensors [CODEC]
set -u
BIN=${1:?kvpack binary}
IN=${2:?safetensors cache}
CODEC=${3:-bdr128}
OUT=$(mktemp -d "${TMPDIR:-/tmp}/stream-measure.XXXXXX")
trap 'rm -rf "$OUT"' EXIT
PORT=${PORT:-17411}

measure() { # label, command...
  local label=$1; shift
  local err=$OUT/err.log
  /usr/bin/time -v "$@" >/dev/null 2>"$err"
  local rss wall rc
  rss=$(grep -m1 'Maximum resident' "$err" | awk '{print $6}')
  wall=$(grep -m1 'Elapsed (wall' "$err" | awk '{print $8}')
  rc=$(grep -m1 'Exit status' "$err" | awk '{print $3}')
  printf '| %s | %s MB | %s | %s |\n' "$label" "$(( ${rss:-0} / 1024 ))" "${wall:-?}" "${rc:-?}"
}

echo "| $(basename "$IN") ($(( $(stat -c %s "$IN") / 1000000 )) MB), $CODEC | peak RSS | wall | exit |"
echo "|---|---|---|---|"
measure "compress" "$BIN" compress "$IN" -c "$CODEC" -o "$OUT/c.kvpack" -q
measure "decompress" "$BIN" decompress "$OUT/c.kvpack" -o "$OUT/d.safetensors" -q
measure "verify" "$BIN" verify "$OUT/c.kvpack"
measure "verify --against" "$BIN" verify "$OUT/c.kvpack" --against "$IN"
( sleep 0.3; "$BIN" send "$IN" -c "$CODEC" --to 127.0.0.1:$PORT -q ) &
measure "recv -o .safetensors" "$BIN" recv --listen 127.0.0.1:$PORT -o "$OUT/r.safetensors" -q
wait
( sleep 0.3; "$BIN" send "$IN" -c "$CODEC" --to 127.0.0.1:$((PORT + 1)) -q ) &
measure "recv -o .kvpack" "$BIN" recv --listen 127.0.0.1:$((PORT + 1)) -o "$OUT/r.kvpack" -q
wait
# recv reserves header room for token ids (they come last): compare the
# tensor bytes after each file's header.
data() { # file: its bytes after the safetensors header
  local n; n=$(od -An -t u8 -N 8 "$1" | tr -d ' ')
  tail -c +$((n + 9)) "$1"
}
if cmp -s <(data "$OUT/d.safetensors") <(data "$OUT/r.safetensors"); then
  echo "(decompress and recv wrote the same tensor bytes)"
else
  echo "(decompress and recv outputs differ)"
fi
