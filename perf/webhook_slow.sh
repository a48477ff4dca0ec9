#!/usr/bin/env bash
# msg.offline with a slow receiver (issue 28; CHANGELOG 2026-12-06): one node on
# core 0, imbench on core 1, `imbench group --groups 1 --members 10000 --online 0.001
# --rate 2000 --duration 20` without webhooks (A) and with msg.offline and
# user.onlinestatus sent to a receiver on 127.0.0.1 that answers every request in
# 2 s (B), interleaved, ROUNDS (default "1 2 3"). Release binaries:
#
#   cargo build --release -p engine -p perf --bins && perf/webhook_slow.sh OUT_DIR
#
# Prints per run: SENDACK and RECV p50/p99, the node's CPU per SEND, and the webhook
# counters. Ports: node TCP 17100, API 17001, receiver 18080 (127.0.0.1).
set -euo pipefail
out=${1:?output directory}
bin=${IMROUTER_BIN_DIR:-target/release}
mkdir -p "$out"
python3 - <<'PY' &
import http.server, socketserver, time
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        time.sleep(2)
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a): pass
class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
S(("127.0.0.1", 18080), H).serve_forever()
PY
receiver=$!
trap 'kill $receiver' EXIT
config() { # label, with webhooks (0/1)
  local data="$out/data-$1"; rm -rf "$data"; mkdir -p "$data"
  printf '[node]\nnode_id = 1\ndata_dir = "%s"\n[listen]\ntcp_addr = "127.0.0.1:17100"\nws_addr = ""\napi_addr = "127.0.0.1:17001"\n[auth]\ntoken_auth = false\n[runtime]\nshard_count = 1\npin_cores = []\n' "$data" > "$out/$1.toml"
  if [ "$2" = 1 ]; then
    printf '[webhook]\nurl = "http://127.0.0.1:18080/wukongim"\nevents = ["msg.offline", "user.onlinestatus"]\n' >> "$out/$1.toml"
  fi
}
for round in ${ROUNDS:-1 2 3}; do
  for variant in A B; do
    label=$variant$round
    config "$label" "$([ $variant = B ] && echo 1 || echo 0)"
    taskset -c 0 "$bin/imrouter" --config "$out/$label.toml" > "$out/$label.node.log" 2>&1 &
    node=$!
    for _ in $(seq 100); do curl -sf 127.0.0.1:17001/readyz > /dev/null && break; sleep 0.1; done
    taskset -c 1 "$bin/imbench" group --tcp 127.0.0.1:17100 --api 127.0.0.1:17001 --no-tokens \
      --groups 1 --members 10000 --online 0.001 --rate 2000 --duration 20 --pid "$node" \
      --out "$out" --label "$label" > "$out/$label.txt" 2>&1
    curl -s 127.0.0.1:17001/metrics | grep -E '^imrouter_webhook_(sent|dropped)_total' | grep -v ' 0$' > "$out/$label.webhook" || true
    kill "$node"; wait "$node" 2> /dev/null || true
    printf '%s ' "$label"
    grep -E '^group (SENDACK|RECV)' "$out/$label.txt" | awk '{printf "%s %s p50 %s p99 %s | ", $1, $2, $4, $6}'
    grep -E 'node CPU per SEND' "$out/$label.txt" | sed 's/.*per SEND \([0-9.]*\) µs.*/CPU per SEND \1 us/' | tr '\n' ' '
    tr '\n' ' ' < "$out/$label.webhook"; echo
  done
done
