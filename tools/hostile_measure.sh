#!/usr/bin/env bash
# Measures the kvpack CLI on the hostile files of tests/hostile.rs:
# peak RSS, wall time, exit status and the first line of stderr, under an
# 8 GiB address-space cap and a 60 s timeout (so a regression cannot take
# the machine down).
#
#   KVPACK_HOSTILE_OUT=/tmp/hostile cargo test --release --test hostile -- \
#       --ignored write_hostile_files
#   tools/hostile_measure.sh target/release/kvpack /tmp/hostile
set -u
BIN=${1:?kvpack binary}
DIR=${2:?directory of hostile files}
CAP_KB=${CAP_KB:-8388608}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

measure() { # label, command...
  local label=$1; shift
  local log=$OUT/time.log err=$OUT/err.log
  ( ulimit -v "$CAP_KB"; timeout 60 /usr/bin/time -v "$@" >/dev/null 2>"$err" ) 2>/dev/null
  local rc=$?
  local rss wall msg
  rss=$(grep -m1 'Maximum resident' "$err" | awk '{print $6}')
  wall=$(grep -m1 'Elapsed (wall' "$err" | awk '{print $8}')
  rc=$(grep -m1 'Exit status' "$err" | awk '{print $3}')
  sig=$(grep -m1 'Command terminated by signal' "$err" | awk '{print $5}')
  msg=$(grep -v -E '^\s|Command (being timed|terminated|exited)' "$err" | head -1 | cut -c1-150)
  printf '| %s | %s MB | %s | %s%s | %s |\n' "$label" "$(( ${rss:-0} / 1024 ))" "${wall:-?}" "${rc:-?}" "${sig:+ (signal $sig)}" "$msg"
}

port=17311
echo "| case | peak RSS | wall | exit | message |"
echo "|---|---|---|---|---|"
for f in "$DIR"/*.kvpack; do
  n=$(basename "$f" .kvpack)
  measure "$n: verify" "$BIN" verify "$f"
  measure "$n: decompress" "$BIN" decompress "$f" -o "$OUT/$n.safetensors" -f
  measure "$n: inspect" "$BIN" inspect "$f"
  port=$((port + 1))
  # kvpack >= the network handshake (SPEC 13) expects a hello first:
  # HANDSHAKE=1 prefixes a minimal one (version 1.0, no model, no codecs).
  if [ "${HANDSHAKE:-0}" = 1 ]; then
    printf 'KVPH\x1e\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00\x00' > "$OUT/sent"
    head -c 16 /dev/zero >> "$OUT/sent"
    printf '\x00\x00\x00\x00\x00\x00' >> "$OUT/sent"
    cat "$f" >> "$OUT/sent"
  else
    cp "$f" "$OUT/sent"
  fi
  ( sleep 0.5; cat "$OUT/sent" > /dev/tcp/127.0.0.1/$port ) 2>/dev/null &
  measure "$n: recv" "$BIN" recv --listen 127.0.0.1:$port -o "$OUT/$n.out.safetensors" -f -q
  wait
done
measure "inspect /dev/zero" "$BIN" inspect /dev/zero
measure "inspect - (2 GB stdin)" bash -c "head -c 2000000000 /dev/zero | $BIN inspect -"
