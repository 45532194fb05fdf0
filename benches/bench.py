#!/usr/bin/env python3
"""calico-cni-rs benchmark (not a test): ADD and DEL latency of our calico + calico-ipam on a
real etcd against Debian's ptp + host-local in the same run, VERSION start-up time and peak RSS.

Everything runs in network namespaces this script creates (a "host" netns with its own etcd on
127.0.0.1, one fresh pod netns per run); nothing touches the real host's network.
Usage: bench.py path/to/calico [runs]   (root)
"""
import json, os, resource, shutil, socket, statistics, subprocess, sys, tempfile, time

BIN = os.path.realpath(sys.argv[1] if len(sys.argv) > 1 else "target/release/calico")
RUNS = int(sys.argv[2]) if len(sys.argv) > 2 else 30
# The test API server's binary (tests/kube_api_server.rs `serve_for_bench`), for the
# Kubernetes-datastore rows; skipped when unset.
KUBE_API_BIN = os.environ.get("BENCH_KUBE_API_BIN", "")
WARMUP = 3
TAG = f"bench{os.getpid()}"
HOST = f"{TAG}-host"


def sh(*cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def pct(values, p):
    v = sorted(values)
    k = max(0, min(len(v) - 1, int(round(p / 100.0 * (len(v) - 1)))))
    return v[k]


def run_cni(plugin, command, cid, netns, conf, cni_path, args=""):
    env = dict(os.environ, CNI_COMMAND=command, CNI_CONTAINERID=cid, CNI_NETNS=netns,
               CNI_IFNAME="eth0", CNI_PATH=cni_path, CNI_ARGS=args)
    t0 = time.perf_counter_ns()
    p = subprocess.run(["ip", "netns", "exec", HOST, plugin], input=conf, env=env,
                       capture_output=True, text=True)
    dt = (time.perf_counter_ns() - t0) / 1e6
    if p.returncode != 0:
        raise SystemExit(f"{plugin} {command} failed: {p.stdout} {p.stderr}")
    return dt


def bench_plugin(name, plugin, conf, cni_path, k8s):
    adds, dels = [], []
    for i in range(WARMUP + RUNS):
        ns = f"{TAG}-p{i}-{name}"
        sh("ip", "netns", "add", ns)
        try:
            cid = f"{name}{i:04d}"
            args = f"K8S_POD_NAMESPACE=default;K8S_POD_NAME=pod-{i};K8S_POD_INFRA_CONTAINER_ID={cid}" if k8s else ""
            a = run_cni(plugin, "ADD", cid, f"/run/netns/{ns}", conf, cni_path, args)
            d = run_cni(plugin, "DEL", cid, f"/run/netns/{ns}", conf, cni_path, args)
        finally:
            subprocess.run(["ip", "netns", "del", ns])
        if i >= WARMUP:
            adds.append(a)
            dels.append(d)
    return adds, dels


def bench_kdd(work, bindir, ptp):
    """ADD/DEL on the Kubernetes datastore against the test API server, interleaved with a
    second ptp+host-local run."""
    kdir = f"{work}/kube"
    os.makedirs(kdir)
    env = dict(os.environ, BENCH_KUBE_API_NETNS=f"/run/netns/{HOST}", BENCH_KUBE_API_DIR=kdir,
               BENCH_PODS=str(WARMUP + RUNS + 1))
    server = subprocess.Popen([KUBE_API_BIN, "--ignored", "--exact", "serve_for_bench", "--nocapture"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(400):
            if os.path.exists(f"{kdir}/ready"):
                break
            time.sleep(0.05)
        else:
            raise SystemExit("the test API server did not start")
        conf = json.dumps({"cniVersion": "1.0.0", "name": "k8s-pod-network", "type": "calico",
                           "datastore_type": "kubernetes", "kubernetes": {"kubeconfig": f"{kdir}/kubeconfig"},
                           "policy": {"type": "k8s"}, "nodename": "bench-node", "nodename_file_optional": True,
                           "mtu": 1440, "log_level": "warn", "log_file_path": f"{work}/cni-kdd.log",
                           "ipam_lock_file": f"{work}/ipam-kdd.lock", "ipam": {"type": "calico-ipam"}})
        ref_add, ref_del = bench_plugin("ptp2", f"{bindir}/ptp", ptp, bindir, False)
        k_add, k_del = bench_plugin("kdd", f"{bindir}/calico", conf, bindir, True)
    finally:
        open(f"{kdir}/stop", "w").close()
        server.wait(timeout=30)
    requests = len(json.load(open(f"{kdir}/requests.json")))
    handshakes = int(open(f"{kdir}/handshakes").read())
    return k_add, k_del, ref_add, ref_del, 2 * (WARMUP + RUNS), requests, handshakes


def main():
    if os.geteuid() != 0:
        raise SystemExit("bench.py must run as root (it creates network namespaces)")
    work = tempfile.mkdtemp(prefix="calico-bench.")
    etcd = None
    try:
        sh("ip", "netns", "add", HOST)
        sh("ip", "netns", "exec", HOST, "ip", "link", "set", "lo", "up")
        port, peer = free_port(), free_port()
        etcd = subprocess.Popen(
            ["ip", "netns", "exec", HOST, "etcd", "--name", "bench", "--data-dir", f"{work}/etcd",
             "--listen-client-urls", f"http://127.0.0.1:{port}", "--advertise-client-urls", f"http://127.0.0.1:{port}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"bench=http://127.0.0.1:{peer}", "--logger=zap", "--log-level=error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ctl = ["ip", "netns", "exec", HOST, "env", "ETCDCTL_API=3", "etcdctl", "--endpoints", f"127.0.0.1:{port}"]
        for _ in range(200):
            if subprocess.run(ctl + ["endpoint", "health"], capture_output=True).returncode == 0:
                break
            time.sleep(0.05)
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        meta = lambda n: {"name": n, "creationTimestamp": now}
        puts = {
            "/calico/resources/v3/projectcalico.org/clusterinformations/default":
                {"kind": "ClusterInformation", "apiVersion": "projectcalico.org/v3", "metadata": meta("default"), "spec": {"datastoreReady": True}},
            "/calico/resources/v3/projectcalico.org/nodes/bench-node":
                {"kind": "Node", "apiVersion": "projectcalico.org/v3", "metadata": meta("bench-node"), "spec": {}},
            "/calico/resources/v3/projectcalico.org/ippools/default-ipv4-ippool":
                {"kind": "IPPool", "apiVersion": "projectcalico.org/v3", "metadata": meta("default-ipv4-ippool"),
                 "spec": {"cidr": "10.244.0.0/16", "blockSize": 26, "nodeSelector": "all()"}},
        }
        for k, v in puts.items():
            sh(*ctl, "put", k, json.dumps(v))

        bindir = f"{work}/bin"
        os.makedirs(bindir)
        os.symlink(BIN, f"{bindir}/calico")
        os.symlink("calico", f"{bindir}/calico-ipam")
        for p in ("ptp", "host-local"):
            os.symlink(f"/usr/lib/cni/{p}", f"{bindir}/{p}")

        ours = json.dumps({"cniVersion": "1.0.0", "name": "k8s-pod-network", "type": "calico",
                           "etcd_endpoints": f"http://127.0.0.1:{port}", "nodename": "bench-node",
                           "nodename_file_optional": True, "mtu": 1440, "log_level": "warn",
                           "log_file_path": f"{work}/cni.log", "ipam_lock_file": f"{work}/ipam.lock",
                           "ipam": {"type": "calico-ipam"}})
        ptp = json.dumps({"cniVersion": "1.0.0", "name": "benchnet", "type": "ptp", "ipMasq": False, "mtu": 1440,
                          "ipam": {"type": "host-local", "subnet": "10.252.0.0/16", "dataDir": f"{work}/host-local",
                                   "routes": [{"dst": "0.0.0.0/0"}]}})

        # Interleave the two so both see the same machine state.
        ref_add, ref_del = bench_plugin("ptp", f"{bindir}/ptp", ptp, bindir, False)
        our_add, our_del = bench_plugin("calico", f"{bindir}/calico", ours, bindir, True)
        kdd = bench_kdd(work, bindir, ptp) if KUBE_API_BIN else None

        # VERSION start-up: exec + answer, no stdin read.
        ver = []
        for _ in range(50):
            t0 = time.perf_counter_ns()
            subprocess.run([f"{bindir}/calico"], env={"CNI_COMMAND": "VERSION"}, capture_output=True)
            ver.append((time.perf_counter_ns() - t0) / 1e6)
        ref_ver = []
        for _ in range(50):
            t0 = time.perf_counter_ns()
            subprocess.run([f"{bindir}/ptp"], env={"CNI_COMMAND": "VERSION"}, capture_output=True)
            ref_ver.append((time.perf_counter_ns() - t0) / 1e6)

        # Peak RSS of one ADD+DEL (children's max RSS, KiB on Linux), in a fresh process tree.
        rss_probe = (
            "import resource,subprocess,os,sys\n"
            "env=dict(os.environ,CNI_COMMAND=sys.argv[2],CNI_CONTAINERID='rss1',CNI_NETNS=sys.argv[3],CNI_IFNAME='eth0',"
            "CNI_PATH=sys.argv[4],CNI_ARGS='K8S_POD_NAMESPACE=default;K8S_POD_NAME=rss')\n"
            "subprocess.run([sys.argv[1]],input=sys.stdin.read(),env=env,text=True,capture_output=True,check=True)\n"
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")
        sh("ip", "netns", "add", f"{TAG}-rss")
        try:
            rss = []
            for cmd in ("ADD", "DEL"):
                out = subprocess.run(["ip", "netns", "exec", HOST, sys.executable, "-c", rss_probe,
                                      f"{bindir}/calico", cmd, f"/run/netns/{TAG}-rss", bindir],
                                     input=ours, capture_output=True, text=True, check=True)
                rss.append(int(out.stdout.strip()))
        finally:
            subprocess.run(["ip", "netns", "del", f"{TAG}-rss"])

        def line(label, v):
            return f"| {label} | {statistics.median(v):.1f} | {pct(v, 90):.1f} | {min(v):.1f} | {max(v):.1f} |"

        print(f"\nmachine: {os.uname().nodename} {os.uname().release}, {os.cpu_count()} cores; "
              f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; runs {RUNS} (+{WARMUP} warm-up), fresh netns each\n")
        print("| operation (ms) | median | p90 | min | max |\n|---|---|---|---|---|")
        print(line("calico+calico-ipam ADD (etcd)", our_add))
        print(line("ptp+host-local ADD", ref_add))
        print(line("calico+calico-ipam DEL (etcd)", our_del))
        print(line("ptp+host-local DEL", ref_del))
        print(line("calico VERSION (exec to exit)", ver))
        print(line("ptp VERSION (exec to exit)", ref_ver))
        ratio = statistics.median(our_add) / statistics.median(ref_add)
        print(f"\nADD ratio ours/ptp+host-local (median): {ratio:.2f}x   (target <= 1.0x)")
        print(f"DEL ratio ours/ptp+host-local (median): {statistics.median(our_del) / statistics.median(ref_del):.2f}x")
        print(f"VERSION median: {statistics.median(ver):.2f} ms   (target <= 2 ms)")
        print(f"peak RSS: ADD {rss[0] / 1024:.1f} MB, DEL {rss[1] / 1024:.1f} MB   (target <= 16 MB)")
        if kdd:
            (k_add, k_del, r_add, r_del, calls, requests, handshakes) = kdd
            print("\nKubernetes datastore (test API server in the host netns; same run):\n")
            print("| operation (ms) | median | p90 | min | max |\n|---|---|---|---|---|")
            print(line("calico+calico-ipam ADD (kubernetes, policy k8s)", k_add))
            print(line("ptp+host-local ADD", r_add))
            print(line("calico+calico-ipam DEL (kubernetes, policy k8s)", k_del))
            print(line("ptp+host-local DEL", r_del))
            print(f"\nKDD ADD ratio (median): {statistics.median(k_add) / statistics.median(r_add):.2f}x; "
                  f"DEL ratio: {statistics.median(k_del) / statistics.median(r_del):.2f}x")
            print(f"API requests: {requests} in {calls} calls ({requests / calls:.1f} per call); "
                  f"TLS handshakes: {handshakes} ({handshakes / calls:.2f} per call)")
    finally:
        if etcd:
            etcd.terminate()
            etcd.wait()
        subprocess.run(["ip", "netns", "del", HOST], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
