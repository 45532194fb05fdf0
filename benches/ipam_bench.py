#!/usr/bin/env python3
"""calico-ipam benchmark (not a test): allocations per second with 1, 4 and 16 parallel callers
(each a simulated node with its own IPAM lock, as on separate hosts), and ADD latency on an empty
pool against a /16 pool that is 90 % allocated (922 of 1024 /26 blocks full, owned by other hosts).

calico-ipam needs no network namespace, so this talks to an etcd on 127.0.0.1 only.
Usage: ipam_bench.py path/to/calico
"""
import base64, json, os, shutil, socket, statistics, subprocess, sys, tempfile, threading, time, urllib.request

BIN = os.path.realpath(sys.argv[1] if len(sys.argv) > 1 else "target/release/calico")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Etcd:
    def __init__(self, work):
        self.port, peer = free_port(), free_port()
        self.proc = subprocess.Popen(
            ["etcd", "--name", "b", "--data-dir", f"{work}/etcd",
             "--listen-client-urls", f"http://127.0.0.1:{self.port}", "--advertise-client-urls", f"http://127.0.0.1:{self.port}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"b=http://127.0.0.1:{peer}", "--logger=zap", "--log-level=error",
             "--quota-backend-bytes", str(4 << 30)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1)
                break
            except Exception:
                time.sleep(0.05)

    def txn_put(self, kvs):
        """Up to 128 puts in one transaction, through etcd's JSON gateway."""
        b64 = lambda s: base64.b64encode(s.encode()).decode()
        body = {"success": [{"requestPut": {"key": b64(k), "value": b64(v)}} for k, v in kvs]}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v3/kv/txn", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=30).read()

    def put(self, k, v):
        self.txn_put([(k, v)])

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


def seed_common(etcd, nodes, pool_cidr):
    etcd.put("/calico/resources/v3/projectcalico.org/clusterinformations/default",
             json.dumps({"kind": "ClusterInformation", "apiVersion": "projectcalico.org/v3", "metadata": {"name": "default"}, "spec": {"datastoreReady": True}}))
    for n in nodes:
        etcd.put(f"/calico/resources/v3/projectcalico.org/nodes/{n}",
                 json.dumps({"kind": "Node", "apiVersion": "projectcalico.org/v3", "metadata": {"name": n}, "spec": {}}))
    etcd.put("/calico/resources/v3/projectcalico.org/ippools/pool",
             json.dumps({"kind": "IPPool", "apiVersion": "projectcalico.org/v3", "metadata": {"name": "pool"}, "spec": {"cidr": pool_cidr, "blockSize": 26}}))


def ipam_add(bindir, work, port, node, cid):
    conf = json.dumps({"cniVersion": "1.0.0", "name": "net1", "etcd_endpoints": f"http://127.0.0.1:{port}",
                       "nodename": node, "log_level": "warn", "log_file_path": f"{work}/cni.log",
                       "ipam_lock_file": f"{work}/lock-{node}", "ipam": {"type": "calico-ipam"}})
    # As the calico plugin runs it: CNI_ARGS with IgnoreUnknown=1 (calico-ipam's own pass, like
    # upstream's, refuses K8S_* keys without it).
    env = dict(os.environ, CNI_COMMAND="ADD", CNI_CONTAINERID=cid, CNI_NETNS="/dev/null", CNI_IFNAME="eth0",
               CNI_PATH=bindir, CNI_ARGS=f"IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={cid}")
    t0 = time.perf_counter_ns()
    p = subprocess.run([f"{bindir}/calico-ipam"], input=conf, env=env, capture_output=True, text=True)
    dt = (time.perf_counter_ns() - t0) / 1e6
    if p.returncode != 0:
        raise SystemExit(f"calico-ipam ADD failed: {p.stdout}")
    return dt


def full_block(i, host):
    """A /26 of 10.200.0.0/16, fully allocated to one handle of `host`."""
    base = 10 << 24 | 200 << 16
    net = base + i * 64
    cidr = f"{net >> 24 & 255}.{net >> 16 & 255}.{net >> 8 & 255}.{net & 255}/26"
    block = {"cidr": cidr, "affinity": f"host:{host}", "allocations": [0] * 64, "unallocated": [],
             "attributes": [{"handle_id": f"net1.fill{i}", "secondary": {"node": host, "pod": f"fill{i}", "namespace": "default"}}],
             "sequenceNumber": 1, "sequenceNumberForAllocation": {}, "deleted": False}
    dashed = cidr.replace("/", "-")
    return [(f"/calico/ipam/v2/assignment/ipv4/block/{dashed}", json.dumps(block)),
            (f"/calico/ipam/v2/host/{host}/ipv4/block/{dashed}", json.dumps({"state": "confirmed", "deleted": False})),
            (f"/calico/ipam/v2/handle/net1.fill{i}", json.dumps({"block": {cidr: 64}, "deleted": False}))]


def main():
    work = tempfile.mkdtemp(prefix="ipam-bench.")
    bindir = f"{work}/bin"
    os.makedirs(bindir)
    shutil.copy2(BIN, f"{bindir}/calico")  # a copy, as installed (see bench.py)
    os.symlink("calico", f"{bindir}/calico-ipam")
    etcd = None
    try:
        # 1. Throughput with 1, 4 and 16 parallel callers (16 simulated nodes).
        etcd = Etcd(work)
        nodes = [f"node{i}" for i in range(16)]
        seed_common(etcd, nodes, "10.100.0.0/16")
        print("\n| parallel callers | allocations | wall (s) | allocations/s |\n|---|---|---|---|")
        for callers in (1, 4, 16):
            per = max(1, 192 // callers)
            failed = []

            def worker(k):
                try:
                    for j in range(per):
                        ipam_add(bindir, work, etcd.port, nodes[k], f"tp{callers}-{k}-{j}")
                except SystemExit as e:
                    failed.append(str(e))
            t0 = time.perf_counter()
            ts = [threading.Thread(target=worker, args=(k,)) for k in range(callers)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            wall = time.perf_counter() - t0
            if failed:
                raise SystemExit(failed[0])
            print(f"| {callers} | {per * callers} | {wall:.2f} | {per * callers / wall:.0f} |")
        etcd.stop()
        shutil.rmtree(f"{work}/etcd", ignore_errors=True)

        # 2. ADD latency: empty pool vs a 90 %-full /16.
        results = {}
        for label, fill in (("empty /16 pool", 0), ("90 %-full /16 pool", 922)):
            etcd = Etcd(work)
            seed_common(etcd, ["lat-node"] + [f"other{i}" for i in range(16)], "10.200.0.0/16")
            kvs = []
            for i in range(fill):
                kvs.extend(full_block(i, f"other{i % 16}"))
            for i in range(0, len(kvs), 120):
                etcd.txn_put(kvs[i:i + 120])
            for w in range(3):
                ipam_add(bindir, work, etcd.port, "lat-node", f"warm{w}")
            lat = [ipam_add(bindir, work, etcd.port, "lat-node", f"lat{j}") for j in range(40)]
            results[label] = lat
            etcd.stop()
            etcd = None
            shutil.rmtree(f"{work}/etcd", ignore_errors=True)
        print("\n| calico-ipam ADD (ms) | median | p90 | max |\n|---|---|---|---|")
        for label, lat in results.items():
            s = sorted(lat)
            print(f"| {label} | {statistics.median(s):.1f} | {s[int(0.9 * (len(s) - 1))]:.1f} | {max(s):.1f} |")
        e, f = (statistics.median(v) for v in results.values())
        print(f"\n90 %-full / empty median ADD latency: {f / e:.2f}x   (target <= 1.2x)")
    finally:
        if etcd:
            etcd.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
