#!/usr/bin/env bash
# The demo: a throwaway etcd, two pods in two network namespaces networked by our `calico`
# + `calico-ipam`, a ping between them, the etcd keys written, DEL, and proof that nothing
# is left. Everything lives in namespaces this script creates; the real host is untouched.
# Usage: tests/scripts/demo.sh path/to/calico   (run as root)
set -euo pipefail

BIN=$(realpath "${1:-target/release/calico}")
TAG=demo$$
HOST=calico-$TAG-host UP=calico-$TAG-up PODA=calico-$TAG-a PODB=calico-$TAG-b
WORK=$(mktemp -d /tmp/calico-demo.XXXXXX)
ETCD_PID=""

cleanup() {
  [ -n "$ETCD_PID" ] && kill "$ETCD_PID" 2>/dev/null && wait "$ETCD_PID" 2>/dev/null || true
  for ns in $PODA $PODB $UP $HOST; do ip netns del "$ns" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
in_host() { ip netns exec "$HOST" "$@"; }

say "host netns $HOST with an uplink (what a real host has)"
ip netns add "$HOST"; ip netns add "$UP"
in_host ip link set lo up
ip link add "up-$TAG" netns "$HOST" type veth peer name "peer-$TAG" netns "$UP"
in_host ip addr add 198.51.100.2/24 dev "up-$TAG"; in_host ip link set "up-$TAG" up
ip -n "$UP" link set "peer-$TAG" up; ip -n "$UP" addr add 198.51.100.1/24 dev "peer-$TAG"
in_host ip route add default via 198.51.100.1
in_host sysctl -qw net.ipv4.ip_forward=1

say "throwaway etcd inside the host netns"
PORT=23791
in_host etcd --name demo --data-dir "$WORK/etcd" \
  --listen-client-urls "http://127.0.0.1:$PORT" --advertise-client-urls "http://127.0.0.1:$PORT" \
  --listen-peer-urls http://127.0.0.1:23801 --initial-advertise-peer-urls http://127.0.0.1:23801 \
  --initial-cluster demo=http://127.0.0.1:23801 --logger=zap --log-level=error >"$WORK/etcd.log" 2>&1 &
ETCD_PID=$!
ctl() { in_host env ETCDCTL_API=3 etcdctl --endpoints "127.0.0.1:$PORT" "$@"; }
for _ in $(seq 100); do ctl endpoint health >/dev/null 2>&1 && break; sleep 0.1; done
ctl endpoint health

say "seed what calico/node would have written: ClusterInformation, Node, IPPool"
NOW=$(date -u +%Y-%m-%dT%H:%M:%SZ)
ctl put /calico/resources/v3/projectcalico.org/clusterinformations/default \
  "{\"kind\":\"ClusterInformation\",\"apiVersion\":\"projectcalico.org/v3\",\"metadata\":{\"name\":\"default\",\"creationTimestamp\":\"$NOW\"},\"spec\":{\"datastoreReady\":true}}" >/dev/null
ctl put /calico/resources/v3/projectcalico.org/nodes/demo-node \
  "{\"kind\":\"Node\",\"apiVersion\":\"projectcalico.org/v3\",\"metadata\":{\"name\":\"demo-node\",\"creationTimestamp\":\"$NOW\"},\"spec\":{}}" >/dev/null
ctl put /calico/resources/v3/projectcalico.org/ippools/default-ipv4-ippool \
  "{\"kind\":\"IPPool\",\"apiVersion\":\"projectcalico.org/v3\",\"metadata\":{\"name\":\"default-ipv4-ippool\",\"creationTimestamp\":\"$NOW\"},\"spec\":{\"cidr\":\"10.244.0.0/16\",\"blockSize\":26,\"ipipMode\":\"Never\",\"natOutgoing\":true,\"nodeSelector\":\"all()\"}}" >/dev/null

mkdir -p "$WORK/bin"; ln -s "$BIN" "$WORK/bin/calico"; ln -s calico "$WORK/bin/calico-ipam"
cat >"$WORK/conf.json" <<JSON
{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"calico","etcd_endpoints":"http://127.0.0.1:$PORT",
 "nodename":"demo-node","nodename_file_optional":true,"mtu":1440,
 "log_file_path":"$WORK/cni.log","ipam_lock_file":"$WORK/ipam.lock","ipam":{"type":"calico-ipam"}}
JSON

cni() { # cni COMMAND CONTAINERID NETNS POD
  in_host env CNI_COMMAND="$1" CNI_CONTAINERID="$2" CNI_NETNS="/run/netns/$3" CNI_IFNAME=eth0 \
    CNI_PATH="$WORK/bin" CNI_ARGS="K8S_POD_NAMESPACE=default;K8S_POD_NAME=$4;K8S_POD_INFRA_CONTAINER_ID=$2" \
    "$WORK/bin/calico" <"$WORK/conf.json"
}

ip netns add "$PODA"; ip netns add "$PODB"
say "ADD pod-a"; RA=$(cni ADD cid-a "$PODA" pod-a); echo "$RA"
say "ADD pod-b"; RB=$(cni ADD cid-b "$PODB" pod-b); echo "$RB"
IPA=$(echo "$RA" | sed -n 's/.*"address": "\([0-9.]*\)\/32".*/\1/p')
IPB=$(echo "$RB" | sed -n 's/.*"address": "\([0-9.]*\)\/32".*/\1/p')

say "pod-a ($IPA) pings pod-b ($IPB) through the host /32 routes"
ip netns exec "$PODA" ping -c 3 -i 0.2 -W 2 "$IPB"
say "pod-a: addresses and routes"; ip -n "$PODA" -br addr show eth0; ip -n "$PODA" route
say "host: veths and routes"; in_host ip -br link show type veth | grep cali || true; in_host ip route | grep cali

say "etcd keys written"
ctl get --prefix /calico --keys-only | grep -v '^$'
say "the WorkloadEndpoint of pod-a"
ctl get --print-value-only /calico/resources/v3/projectcalico.org/workloadendpoints/default/demo--node-k8s-pod--a-eth0

say "DEL both pods"
cni DEL cid-a "$PODA" pod-a; cni DEL cid-b "$PODB" pod-b
say "left behind (expect: no WEPs, no handles, no cali veths, no pod routes)"
echo "WEPs:    $(ctl get --prefix /calico/resources/v3/projectcalico.org/workloadendpoints --keys-only | grep -c . || true)"
echo "handles: $(ctl get --prefix /calico/ipam/v2/handle --keys-only | grep -c . || true)"
echo "veths:   $(in_host ip -br link show type veth | grep -c cali || true)"
echo "routes:  $(in_host ip route | grep -c cali || true)"
say "demo done"
