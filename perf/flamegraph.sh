#!/usr/bin/env bash
# One-command flamegraph of the node under an imbench scenario.
#
#   perf/flamegraph.sh [SCENARIO] [imbench flags...]
#   perf/flamegraph.sh group --duration 10 --rate 2000
#   MODE=embedded perf/flamegraph.sh person --pairs 1000
#
# Builds release (debug symbols and frame pointers: Cargo.toml, .cargo/config.toml),
# starts the `imrouter` binary on loopback, records it with
# `perf record -F 999 -g -e cpu-clock` (this machine has no hardware counters) while
# imbench drives SCENARIO (default: group), then renders an SVG with inferno.
# MODE=embedded (or no imrouter binary) records imbench --embedded instead: node and
# harness in one process (the node's frames are under the `imrouter-N` threads).
# WHO=harness records the imbench process instead of the node (external mode): where
# the harness's own CPU per RECV goes.
#
# Output: $OUT (default target/flamegraph): perf.data, <scenario>.folded,
# <scenario>-flamegraph.svg, imbench's JSON summary and .hgrm files.
# Needs: perf (Debian: apt-get install linux-perf), inferno (cargo install inferno).
set -euo pipefail
cd "$(dirname "$0")/.."

SCENARIO=${1:-group}
shift || true
OUT=${OUT:-target/flamegraph}
MODE=${MODE:-external}
WHO=${WHO:-node}
TCP_PORT=${TCP_PORT:-15100}
WS_PORT=${WS_PORT:-15200}
API_PORT=${API_PORT:-15001}
FREQ=${FREQ:-999}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}
BIN=$CARGO_TARGET_DIR/release

# Install what is missing (Debian's linux-perf, inferno from crates.io), so one
# command is enough on a fresh machine.
if ! command -v perf >/dev/null; then
  echo "flamegraph.sh: installing linux-perf" >&2
  { apt-get update -qq && apt-get install -y -qq linux-perf >/dev/null; } ||
    { echo "flamegraph.sh: perf not found (apt-get install linux-perf)" >&2; exit 1; }
fi
if ! command -v inferno-collapse-perf >/dev/null; then
  echo "flamegraph.sh: installing inferno" >&2
  cargo install --locked inferno >/dev/null ||
    { echo "flamegraph.sh: inferno not found (cargo install inferno)" >&2; exit 1; }
  export PATH="$HOME/.cargo/bin:$PATH"
fi

cargo build --release -p perf --bin imbench
if [[ $MODE != embedded ]] && ! cargo build --release -p engine --bin imrouter; then
  echo "flamegraph.sh: imrouter does not build; recording imbench --embedded" >&2
  MODE=embedded
fi
mkdir -p "$OUT"

NODE_PID=
PERF_PID=
DATA=
cleanup() {
  [[ -n $PERF_PID ]] && kill -INT "$PERF_PID" 2>/dev/null && wait "$PERF_PID" 2>/dev/null || true
  [[ -n $NODE_PID ]] && kill -TERM "$NODE_PID" 2>/dev/null && wait "$NODE_PID" 2>/dev/null || true
  [[ -n $DATA ]] && rm -rf "$DATA"
}
trap cleanup EXIT

if [[ $MODE == embedded ]]; then
  perf record -F "$FREQ" -g -e cpu-clock -o "$OUT/perf.data" -- \
    "$BIN/imbench" "$SCENARIO" --embedded --out "$OUT" --label "$SCENARIO" "$@"
else
  DATA=$(mktemp -d)
  "$BIN/imrouter" --tcp-addr "127.0.0.1:$TCP_PORT" --ws-addr "127.0.0.1:$WS_PORT" \
    --api-addr "127.0.0.1:$API_PORT" --data-dir "$DATA" >"$OUT/imrouter.log" 2>&1 &
  NODE_PID=$!
  # Wait (bounded) until the API accepts connections.
  for _ in $(seq 1 100); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$API_PORT") 2>/dev/null; then break; fi
    kill -0 "$NODE_PID" 2>/dev/null || { echo "flamegraph.sh: imrouter exited, see $OUT/imrouter.log" >&2; exit 1; }
    sleep 0.1
  done
  IMBENCH=("$BIN/imbench" "$SCENARIO" --tcp "127.0.0.1:$TCP_PORT" --ws "127.0.0.1:$WS_PORT"
    --api "127.0.0.1:$API_PORT" --pid "$NODE_PID" --out "$OUT" --label "$SCENARIO" "$@")
  if [[ $WHO == harness ]]; then
    "${IMBENCH[@]}" &
    BENCH_PID=$!
    perf record -F "$FREQ" -g -e cpu-clock -p "$BENCH_PID" -o "$OUT/perf.data" 2>"$OUT/perf-record.log" &
    PERF_PID=$!
    wait "$BENCH_PID" || true
  else
    perf record -F "$FREQ" -g -e cpu-clock -p "$NODE_PID" -o "$OUT/perf.data" 2>"$OUT/perf-record.log" &
    PERF_PID=$!
    "${IMBENCH[@]}" || true
  fi
  kill -INT "$PERF_PID" 2>/dev/null || true
  wait "$PERF_PID" || true
  PERF_PID=
fi

perf script -i "$OUT/perf.data" 2>/dev/null | inferno-collapse-perf >"$OUT/$SCENARIO.folded"
TITLE="imrouter under imbench $SCENARIO ($MODE)"
[[ $WHO == harness && $MODE != embedded ]] && TITLE="imbench (harness) running $SCENARIO"
inferno-flamegraph --title "$TITLE" \
  <"$OUT/$SCENARIO.folded" >"$OUT/$SCENARIO-flamegraph.svg"
echo "flamegraph: $OUT/$SCENARIO-flamegraph.svg"
