#!/usr/bin/env bash
# A three-node imrouter cluster on 127.0.0.1 for imbench (release build):
#
#   perf/cluster.sh start DIR     # starts nodes 1..3, waits for /readyz, prints imbench flags
#   perf/cluster.sh stop DIR      # stops them (SIGTERM)
#
# Node i listens on TCP 51i0, WebSocket 52i0, API 50i1 (i = 1..3; e.g. node 2: 5210,
# 5220, 5021) and RPC 1100i; data and logs under DIR/node$i. Token authentication is
# off (imbench --no-tokens), so the run needs no token writes. Clients are spread
# over the three nodes by imbench (one address per node in --tcp). SHARDS=n sets each
# node's shard count (default: one per core; three nodes on a small machine share it).
# REPLICAS=n sets `[cluster] replicas` (default 1: no replicated group runs); with
# more, start also waits until every slot id's home leads its group. FSYNC=always
# sets `[log] fsync = "always"` (default: the interval policy).
#
#   eval "$(perf/cluster.sh start /tmp/c3)"          # sets $C3 to the imbench flags
#   target/release/imbench person $C3
#   target/release/imbench group $C3
set -euo pipefail
cmd=${1:?start|stop}
dir=${2:?directory}
bin=${IMROUTER_BIN:-target/release/imrouter}
secret=${IMROUTER_CLUSTER_SECRET:-imbench-cluster-secret-0123}
# A node with peers serves its API only behind a bearer token.
token=${IMROUTER_API_BEARER_TOKEN:-imbench-cluster-api-token}

node_config() {
    local id=$1
    cat <<EOF
[node]
node_id = $id
data_dir = "$dir/node$id/data"
[listen]
tcp_addr = "127.0.0.1:51${id}0"
ws_addr = "127.0.0.1:52${id}0"
api_addr = "127.0.0.1:50${id}1"
rpc_addr = "127.0.0.1:1100$id"
[auth]
token_auth = false
api_bearer_token = "$token"
[cluster]
secret = "$secret"
slot_ids = 64
replicas = ${REPLICAS:-1}
EOF
    if [ "${FSYNC:-}" = always ]; then
        printf '[log]\nfsync = "always"\n'
    fi
    for n in 1 2 3; do
        printf '[[cluster.nodes]]\nid = %s\nrpc_addr = "127.0.0.1:1100%s"\napi_addr = "127.0.0.1:50%s1"\n' "$n" "$n" "$n"
    done
}

case $cmd in
start)
    mkdir -p "$dir"
    for id in 1 2 3; do
        mkdir -p "$dir/node$id"
        node_config "$id" >"$dir/node$id/imrouter.toml"
        "$bin" --config "$dir/node$id/imrouter.toml" ${SHARDS:+--shards "$SHARDS"} >"$dir/node$id/log" 2>&1 &
        echo $! >"$dir/node$id/pid"
    done
    for id in 1 2 3; do
        for _ in $(seq 1 300); do
            if curl -fs "http://127.0.0.1:50${id}1/readyz" >/dev/null 2>&1; then
                break
            fi
            sleep 0.1
        done
        curl -fs "http://127.0.0.1:50${id}1/readyz" >/dev/null ||
            { echo "node $id not ready: $(tail -3 "$dir/node$id/log")" >&2; exit 1; }
    done
    # Replicated: SENDs are answered 10 until each slot id's home leads its group
    # (a leader elsewhere hands over to it): wait until node 1 sees every one.
    if [ "${REPLICAS:-1}" -gt 1 ]; then
        for _ in $(seq 1 300); do
            if curl -fs -H "Authorization: Bearer $token" "http://127.0.0.1:5011/cluster/slots" |
                python3 -c 'import json,sys; g=json.load(sys.stdin)["replica_groups"]; sys.exit(not all(x["leader_node_id"]==x["replicas"][0] for x in g))'; then
                break
            fi
            sleep 0.1
        done
    fi
    echo "C3='--tcp 127.0.0.1:5110,127.0.0.1:5120,127.0.0.1:5130 --api 127.0.0.1:5011 --api-token $token --no-tokens'"
    ;;
stop)
    for id in 1 2 3; do
        [ -f "$dir/node$id/pid" ] && kill "$(cat "$dir/node$id/pid")" 2>/dev/null || true
    done
    # The nodes are not this shell's children: wait until each has exited (its
    # ports free for the next start).
    for id in 1 2 3; do
        [ -f "$dir/node$id/pid" ] || continue
        pid=$(cat "$dir/node$id/pid")
        for _ in $(seq 1 300); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
    done
    ;;
*)
    echo "usage: $0 start|stop DIR" >&2
    exit 2
    ;;
esac
