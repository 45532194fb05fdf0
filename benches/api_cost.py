#!/usr/bin/env python3
"""What each API request of a Kubernetes-datastore ADD costs the API server (issue 18).

The real kube-apiserver (tests/e2e/real_k8s_harness.rs `serve_for_bench`, Calico's CRDs, the
plugin's RBAC, audit log on) in a network namespace of its own; one ADD of the plugin
creates what a node's next ADD finds (its block, the block's affinity, a handle). Then, with
the plugin's own token, each request an ADD into an affine block makes is sent N times on
one connection, back to back, and timed: the wall time per request as a client sees it, and
the API server's CPU time per request (user + system of kube-apiserver, from /proc, over
the N). Then N whole ADDs (and their DELs) of the plugin, with the server's CPU per ADD.

On a node whose API server shares its CPUs with kubelet, containerd and runc (as in the pod
start bench), this CPU is what a pod start of the Kubernetes datastore pays that
ptp + host-local does not.

Usage: benches/api_cost.py path/to/calico   (root; env API_COST_N=200, API_COST_ADDS=30;
BENCH_KUBE_API_BIN: the e2e test binary, built with `cargo test --test e2e --no-run` when unset)
"""
import http.client, json, os, re, shutil, ssl, statistics, subprocess, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench as B  # noqa: E402  (the netns, API server and CNI call helpers)

N = int(os.environ.get("API_COST_N", "200"))
ADDS = int(os.environ.get("API_COST_ADDS", "30"))
CRD = "/apis/crd.projectcalico.org/v1"


def harness_binary():
    if os.environ.get("BENCH_KUBE_API_BIN"):
        return os.environ["BENCH_KUBE_API_BIN"]
    out = subprocess.run(["cargo", "test", "--test", "e2e", "--no-run", "--message-format=json"],
                         capture_output=True, text=True, check=True,
                         cwd=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")).stdout
    for line in out.splitlines():
        m = json.loads(line)
        if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == "e2e" \
                and m.get("executable"):
            return m["executable"]
    raise SystemExit("cargo built no e2e test binary")


def apiserver_pids(audit_path):
    """The harness's kube-apiserver: the one writing this audit log."""
    pids = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            cmd = open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith(b"kube-apiserver") and f"--audit-log-path={audit_path}".encode() in cmd:
            pids.append(p)
    if not pids:
        raise SystemExit(f"no kube-apiserver writing {audit_path}")
    return pids


class ServerCpu:
    def __init__(self, pids):
        self.pids, self.tick = pids, 1000.0 / os.sysconf("SC_CLK_TCK")

    def ms(self):
        t = 0
        for p in self.pids:
            f = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
            t += int(f[11]) + int(f[12])
        return t * self.tick


class Api:
    """One HTTPS connection to the API server as the plugin (its kubeconfig's token)."""

    def __init__(self, kubeconfig):
        text = open(kubeconfig).read()
        self.host, self.port = re.search(r"server: https://([\d.]+):(\d+)", text).groups()
        self.token = re.search(r"token: (\S+)", text).group(1)
        self.ctx = ssl.create_default_context()
        self.ctx.check_hostname, self.ctx.verify_mode = False, ssl.CERT_NONE
        self.conn = None
        self.reconnect()

    def reconnect(self):
        if self.conn:
            self.conn.close()
        self.conn = http.client.HTTPSConnection(self.host, int(self.port), context=self.ctx)

    def req(self, method, path, body=None, ctype="application/json", want=200):
        headers = {"Authorization": "Bearer " + self.token, "Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = ctype
        self.conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
        r = self.conn.getresponse()
        data = r.read()
        if r.status != want:
            raise SystemExit(f"{method} {path}: {r.status} {data[:300]!r}")
        return json.loads(data) if data else None


def measure(label, fn, cpu):
    fn(-1)  # warm: the first of a kind may build caches
    c0, t0 = cpu.ms(), time.perf_counter()
    for i in range(N):
        fn(i)
    wall = (time.perf_counter() - t0) / N * 1e3
    return label, wall, (cpu.ms() - c0) / N


def main():
    if os.geteuid() != 0:
        raise SystemExit("api_cost.py must run as root (it creates network namespaces)")
    calico = os.path.realpath(sys.argv[1] if len(sys.argv) > 1 else "target/release/calico")
    B.KUBE_API_BIN = harness_binary()
    work = tempfile.mkdtemp(prefix="calico-api-cost.")
    api = None
    started = B.machine()
    try:
        B.sh("ip", "netns", "add", B.HOST)
        B.sh("ip", "netns", "exec", B.HOST, "ip", "link", "set", "lo", "up")
        api = B.KubeApi(work, ADDS + 5)
        bindir = f"{work}/bin"
        os.makedirs(bindir)
        shutil.copy2(calico, f"{bindir}/calico")
        os.symlink("calico", f"{bindir}/calico-ipam")
        conf = json.dumps({"cniVersion": "1.0.0", "name": "k8s-pod-network", "type": "calico",
                           "datastore_type": "kubernetes", "kubernetes": {"kubeconfig": api.kubeconfig},
                           "calico_api_group": "crd.projectcalico.org/v1", "policy": {"type": "k8s"},
                           "nodename": "bench-node", "nodename_file_optional": True, "mtu": 1440,
                           "log_level": "warn", "log_file_path": f"{work}/cni.log",
                           "ipam_lock_file": f"{work}/ipam.lock", "ipam": {"type": "calico-ipam"}})
        side = B.Side("kdd", f"{bindir}/calico", conf, bindir, True)
        pids = apiserver_pids(api.audit)
        cpu = ServerCpu(pids)

        # The plugin's whole ADDs (and DELs, not counted): the server's CPU per ADD.
        per_add, add_wall = [], []
        for i in range(ADDS + 1):
            with B.pod_netns(f"{B.TAG}-c{i}") as ns:
                cid, args = f"cost{i:04d}", side.args(f"pod-{i}", f"cost{i:04d}")
                c0 = cpu.ms()
                wall, _, _ = B.run_cni(side.plugin, "ADD", cid, ns, conf, bindir, args)
                time.sleep(0.2)  # the watch's fan-out of the writes
                if i:
                    per_add.append(cpu.ms() - c0)
                    add_wall.append(wall)
                if i < ADDS:
                    B.run_cni(side.plugin, "DEL", cid, ns, conf, bindir, args)
        # pod-ADDS keeps its address: its block, affinity and handle are what the requests
        # below read and write, as a node's next ADD would.

        rows = run_in_host_netns(api.kubeconfig, pids)
        print(f"\nmachine: {started}; load {os.getloadavg()[0]:.2f} at the end")
        print(f"kube-apiserver ({os.path.basename(B.KUBE_API_BIN)} harness), the plugin's token; "
              f"{N} requests of each kind on one connection, back to back")
        print("\n| request (as a Kubernetes-datastore ADD makes it) | wall per request (ms) | API server CPU per request (ms) |")
        print("|---|---|---|")
        for label, wall, c in rows:
            print(f"| {label} | {wall:.2f} | {c:.2f} |")
        print(f"\nThe plugin's ADD, {ADDS} of them (each a fresh process and connection; the server's CPU "
              f"counted until 0.2 s after it returned, in {1000.0 / os.sysconf('SC_CLK_TCK'):.0f} ms ticks): "
              f"API server CPU per ADD mean {statistics.mean(per_add):.1f} ms (median "
              f"{statistics.median(per_add):.0f}); ADD wall median {statistics.median(add_wall):.1f} ms")
    finally:
        if api:
            api.stop()
        subprocess.run(["ip", "netns", "del", B.HOST])
        shutil.rmtree(work, ignore_errors=True)


def run_in_host_netns(kubeconfig, pids):
    """The per-request measurements, run in the API server's netns (it listens on its
    loopback): this script again, as a child (`API_COST_CHILD_*`; bench.py reads argv)."""
    env = dict(os.environ, API_COST_CHILD_KUBECONFIG=kubeconfig, API_COST_CHILD_PIDS=",".join(pids))
    out = subprocess.run(["ip", "netns", "exec", B.HOST, sys.executable, os.path.abspath(__file__)],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"the request measurements failed: {out.stderr}")
    return [tuple(r) for r in json.loads(out.stdout)]


def requests_child(kubeconfig, pids):
    cpu = ServerCpu(pids.split(","))
    api = Api(kubeconfig)
    block = api.req("GET", f"{CRD}/ipamblocks")["items"][0]
    name = block["metadata"]["name"]
    rows = []
    reads = [
        ("GET ClusterInformation (watch cache)", f"{CRD}/clusterinformations/default?resourceVersion=0"),
        ("GET pod (watch cache)", "/api/v1/namespaces/default/pods/pod-1?resourceVersion=0"),
        ("GET namespace (watch cache)", "/api/v1/namespaces/default?resourceVersion=0"),
        ("LIST IPPools (watch cache)", f"{CRD}/ippools?resourceVersion=0"),
        ("GET IPAMConfig (watch cache)", f"{CRD}/ipamconfigs/default?resourceVersion=0"),
        ("LIST IPReservations (watch cache)", f"{CRD}/ipreservations?resourceVersion=0"),
        ("LIST this host's BlockAffinities (label selector, watch cache)",
         f"{CRD}/blockaffinities?labelSelector=projectcalico.org%2Faffinity-type%3Dhost&resourceVersion=0"),
        ("GET IPAMBlock (from etcd; an ADD takes its copy instead)", f"{CRD}/ipamblocks/{name}"),
    ]
    for label, path in reads:
        rows.append(measure(label, lambda i, p=path: api.req("GET", p), cpu))

    state = {"block": api.req("GET", f"{CRD}/ipamblocks/{name}")}

    def put_block(i):
        b = json.loads(json.dumps(state["block"]))
        b["spec"]["allocations"][-1] = None if i % 2 else 0
        state["block"] = api.req("PUT", f"{CRD}/ipamblocks/{name}", b)

    rows.append(measure(f"PUT IPAMBlock ({len(json.dumps(state['block']))} bytes)", put_block, cpu))
    tag = os.getpid()
    rows.append(measure("POST IPAMHandle", lambda i: api.req("POST", f"{CRD}/ipamhandles", {
        "apiVersion": "crd.projectcalico.org/v1", "kind": "IPAMHandle",
        "metadata": {"name": f"cost-{tag}-{i}"},
        "spec": {"handleID": f"cost-{tag}-{i}", "block": {block["spec"]["cidr"]: 1}, "deleted": False}},
        want=201), cpu))
    rows.append(measure("DELETE IPAMHandle (a DEL's)", lambda i: api.req(
        "DELETE", f"{CRD}/ipamhandles/cost-{tag}-{i}"), cpu))

    def patch(i):
        ip = f"10.250.{(i // 250) % 250}.{i % 250}/32"
        api.req("PATCH", "/api/v1/namespaces/default/pods/pod-2/status",
                {"metadata": {"annotations": {"cni.projectcalico.org/podIP": ip, "cni.projectcalico.org/podIPs": ip,
                                              "cni.projectcalico.org/containerID": f"cost{i}"}}},
                ctype="application/strategic-merge-patch+json")

    rows.append(measure("PATCH pod status (strategic merge, the annotations)", patch, cpu))

    def fresh(i):
        api.reconnect()
        api.req("GET", "/api/v1/namespaces/default?resourceVersion=0")

    rows.append(measure("new TLS connection + GET namespace (watch cache)", fresh, cpu))
    json.dump(rows, sys.stdout)


if __name__ == "__main__":
    if os.environ.get("API_COST_CHILD_KUBECONFIG"):
        requests_child(os.environ["API_COST_CHILD_KUBECONFIG"], os.environ["API_COST_CHILD_PIDS"])
    else:
        main()
