#!/usr/bin/env python3
"""calico-cni-rs benchmark (not a test).

- ADD and DEL latency of our calico + calico-ipam against Debian's ptp + host-local,
  interleaved run by run (fresh pod netns each), median, p90 and the ratio, on the
  configurations Calico's manifests install: etcd with `policy.type: k8s` (the pod and its
  namespace read from the API server), the Kubernetes datastore (KDD, policy k8s, file
  logging), and etcd without the API reads (the rows of earlier runs);
- the API server is the real kube-apiserver v1.35 `make deps` builds (tests/e2e/real_k8s_harness.rs
  `serve_for_bench`: Calico's CRDs, the plugin's own RBAC and token, an audit log), when
  BENCH_KUBE_API_BIN is set and the peers are built; without it only the etcd rows without
  policy k8s are measured;
- the datastore requests of one ADD and one DEL (etcd's own counters, the API server's audit
  log, and the sequence from our debug log);
- N concurrent ADDs on one node (all distinct addresses, asserted; total wall time), then N
  concurrent DELs, against the same for ptp + host-local;
- peak RSS of one ADD and one DEL (GNU time, see `peak_rss`), VERSION start-up time.

Everything runs in network namespaces this script creates (a "host" netns with its own etcd on
127.0.0.1, fresh pod netns); nothing touches the real host's network.
Usage: bench.py path/to/calico [runs]   (root; env BENCH_CONCURRENT=100, BENCH_ROUNDS=3;
BENCH_BEFORE=path/to/another/calico adds that binary, interleaved the same way, for a
before/after comparison within one run, named BENCH_BEFORE_LABEL in the report, with the
ratio of medians and its 90 % bootstrap interval)

CALICO_UPSTREAM_BIN names the folder of upstream Calico v3.32.1's binaries (built from its
source outside this repository; the bench takes its `calico`): upstream's plugin then runs
beside ours on every configuration, interleaved the same way, as another node of the same
cluster, and a same-build control (this build as a third node) with it, so that a ratio
inside the control's spread reads as no difference. Unset, the bench says so and leaves
those rows out.
"""
import contextlib, json, os, random, re, resource, shutil, socket, statistics, subprocess, sys, tempfile, time

BIN = os.path.realpath(sys.argv[1] if len(sys.argv) > 1 else "target/release/calico")
RUNS = int(sys.argv[2]) if len(sys.argv) > 2 else 40
# The real API server's harness binary (tests/e2e/real_k8s_harness.rs `serve_for_bench`), for
# the rows with the API server; skipped when unset.
KUBE_API_BIN = os.environ.get("BENCH_KUBE_API_BIN", "")
BEFORE_BIN = os.path.realpath(os.environ["BENCH_BEFORE"]) if os.environ.get("BENCH_BEFORE") else ""
UPSTREAM_DIR = os.environ.get("CALICO_UPSTREAM_BIN", "")
# How the report names that binary (`make bench` compares the static musl build this way).
BEFORE_LABEL = os.environ.get("BENCH_BEFORE_LABEL", "before")
CONCURRENT = int(os.environ.get("BENCH_CONCURRENT", "100"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
WARMUP = 3
TAG = f"bench{os.getpid()}"
HOST = f"{TAG}-host"
GNU_TIME = "/usr/bin/time"


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


def ratio_interval(a, b, resamples=4000):
    """median(a) / median(b), with a 90 % bootstrap interval (each side resampled)."""
    rng = random.Random(1)
    boot = sorted(
        statistics.median(rng.choices(a, k=len(a))) / statistics.median(rng.choices(b, k=len(b)))
        for _ in range(resamples)
    )
    point = statistics.median(a) / statistics.median(b)
    return f"{point:.3f} [{boot[int(0.05 * resamples)]:.3f}, {boot[int(0.95 * resamples) - 1]:.3f}]"


def netns_batch(verb, names):
    """`ip netns add|del` for many names in one `ip -batch` process."""
    subprocess.run(["ip", "-force", "-batch", "-"], input="".join(f"netns {verb} {n}\n" for n in names),
                   capture_output=True, text=True)


@contextlib.contextmanager
def pod_netns(name):
    """A fresh pod network namespace for the block; its path. Removed afterwards."""
    sh("ip", "netns", "add", name)
    try:
        yield f"/run/netns/{name}"
    finally:
        subprocess.run(["ip", "netns", "del", name])


def cni_env(command, cid, netns, cni_path, args):
    return dict(os.environ, CNI_COMMAND=command, CNI_CONTAINERID=cid, CNI_NETNS=netns,
                CNI_IFNAME="eth0", CNI_PATH=cni_path, CNI_ARGS=args)


def children_cpu_ms():
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (ru.ru_utime + ru.ru_stime) * 1e3


LAST_CPU = [0.0]


def run_cni(plugin, command, cid, netns, conf, cni_path, args="", wrap=()):
    """One call as a runtime makes it (in the host netns); (ms, stdout, stderr). The call's
    CPU time (its process tree's user + system, `ip netns exec` included) goes to LAST_CPU."""
    env = cni_env(command, cid, netns, cni_path, args)
    c0 = children_cpu_ms()
    t0 = time.perf_counter_ns()
    p = subprocess.run([*wrap, "ip", "netns", "exec", HOST, plugin], input=conf, env=env,
                       capture_output=True, text=True)
    dt = (time.perf_counter_ns() - t0) / 1e6
    LAST_CPU[0] = children_cpu_ms() - c0
    if p.returncode != 0:
        raise SystemExit(f"{plugin} {command} failed: {p.stdout} {p.stderr}")
    return dt, p.stdout, p.stderr


class Side:
    """One plugin set under test: how to call it and what it measured."""

    def __init__(self, name, plugin, conf, cni_path, k8s, label=""):
        self.name, self.plugin, self.conf, self.cni_path, self.k8s = name, plugin, conf, cni_path, k8s
        self.label = label or name
        self.adds, self.dels = [], []
        self.adds_cpu, self.dels_cpu = [], []

    def args(self, pod, cid):
        return f"K8S_POD_NAMESPACE=default;K8S_POD_NAME={pod};K8S_POD_INFRA_CONTAINER_ID={cid}" if self.k8s else ""

    def add_del(self, i, keep):
        with pod_netns(f"{TAG}-p{i}-{self.name}") as ns:
            cid = f"{self.name}{i:04d}"
            args = self.args(f"pod-{i}", cid)
            a, _, _ = run_cni(self.plugin, "ADD", cid, ns, self.conf, self.cni_path, args)
            a_cpu = LAST_CPU[0]
            d, _, _ = run_cni(self.plugin, "DEL", cid, ns, self.conf, self.cni_path, args)
            d_cpu = LAST_CPU[0]
        if keep:
            self.adds.append(a)
            self.dels.append(d)
            self.adds_cpu.append(a_cpu)
            self.dels_cpu.append(d_cpu)


def rotated(items, i):
    """`items` in the i-th order of a rotation (so each goes first as often as the others)."""
    k = i % len(items)
    return items[k:] + items[:k]


def interleaved(sides):
    """ADD then DEL of each side, run by run, the order rotating (same machine state)."""
    for i in range(WARMUP + RUNS):
        for s in rotated(sides, i):
            s.add_del(i, i >= WARMUP)


def concurrent(side, n, label):
    """n ADDs started at once on one node (fresh netns each), then n DELs at once: wall
    times (s) and the addresses, which must all differ."""
    names = [f"{TAG}-c{label}{i}" for i in range(n)]
    netns_batch("add", names)
    try:
        def all_at_once(command):
            procs = []
            t0 = time.perf_counter()
            for i, ns in enumerate(names):
                cid = f"c{label}{i:04d}"
                env = cni_env(command, cid, f"/run/netns/{ns}", side.cni_path, side.args(f"pod-{i}", cid))
                p = subprocess.Popen(["ip", "netns", "exec", HOST, side.plugin], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
                p.stdin.write(side.conf)
                p.stdin.close()
                procs.append(p)
            outs = []
            for p in procs:
                outs.append(p.stdout.read())
                p.wait()
            wall = time.perf_counter() - t0
            failed = [o for p, o in zip(procs, outs) if p.returncode != 0]
            if failed:
                raise SystemExit(f"{len(failed)} of {n} concurrent {side.name} {command}s failed: {failed[0]}")
            return wall, outs

        add_wall, outs = all_at_once("ADD")
        ips = [json.loads(o)["ips"][0]["address"].split("/")[0] for o in outs]
        if len(set(ips)) != n:
            dup = sorted({ip for ip in ips if ips.count(ip) > 1})
            raise SystemExit(f"concurrent {side.name} ADDs handed out duplicate addresses: {dup}")
        del_wall, _ = all_at_once("DEL")
        return add_wall, del_wall
    finally:
        netns_batch("del", names)


def peak_rss(side, runs=5):
    """Peak RSS (KiB) of one ADD and one DEL: GNU time's %M, i.e. wait4's ru_maxrss of the
    `ip netns exec` process that execs the plugin (ip's own RSS, ~2.4 MB, is smaller). Not
    Python's getrusage: a child forked from Python inherits Python's ~14 MB high-water mark
    across exec, so every child would look at least that big."""
    add, dele = [], []
    for i in range(runs):
        with pod_netns(f"{TAG}-rss{side.name}{i}") as ns:
            cid = f"rss{side.name}{i}"
            args = side.args(f"pod-{i}", cid)
            for cmd, out in (("ADD", add), ("DEL", dele)):
                _, _, err = run_cni(side.plugin, cmd, cid, ns, side.conf, side.cni_path, args,
                                    wrap=(GNU_TIME, "-f", "rss=%M"))
                out.append(int(re.findall(r"rss=(\d+)", err)[-1]))
    return add, dele


class Etcd:
    def __init__(self, work):
        self.port, peer = free_port(), free_port()
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", HOST, "etcd", "--name", "bench", "--data-dir", f"{work}/etcd",
             "--listen-client-urls", f"http://127.0.0.1:{self.port}", "--advertise-client-urls", f"http://127.0.0.1:{self.port}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"bench=http://127.0.0.1:{peer}", "--logger=zap", "--log-level=error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.ctl = ["ip", "netns", "exec", HOST, "env", "ETCDCTL_API=3", "etcdctl", "--endpoints", f"127.0.0.1:{self.port}"]
        for _ in range(200):
            if subprocess.run(self.ctl + ["endpoint", "health"], capture_output=True).returncode == 0:
                break
            time.sleep(0.05)

    def put(self, k, v):
        sh(*self.ctl, "put", k, json.dumps(v))

    def counters(self):
        """etcd's own request counters (KV methods) and WAL fsyncs, read in the host netns."""
        text = subprocess.run(["ip", "netns", "exec", HOST, sys.executable, "-c",
                               "import urllib.request,sys;sys.stdout.write(urllib.request.urlopen("
                               f"'http://127.0.0.1:{self.port}/metrics').read().decode())"],
                              capture_output=True, text=True, check=True).stdout
        out = {}
        for line in text.splitlines():
            m = re.match(r'grpc_server_handled_total\{.*grpc_method="(\w+)",grpc_service="etcdserverpb.KV".*\} (\d+)', line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0) + int(m.group(2))
            m = re.match(r"etcd_disk_wal_fsync_duration_seconds_count (\d+)", line)
            if m:
                out["fsync"] = int(m.group(1))
        return out

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


def etcd_requests(etcd, side, debug_conf, pods=5):
    """Requests per ADD and per DEL counted by etcd, and one ADD's and DEL's sequence from our
    debug log (`etcd request` lines: what, and how long each took)."""
    def diff(a, b):
        return {k: b.get(k, 0) - a.get(k, 0) for k in ("Range", "Txn", "Put", "DeleteRange", "fsync")}
    per = {"ADD": [], "DEL": []}
    for i in range(pods):
        with pod_netns(f"{TAG}-req{i}") as ns:
            cid = f"req{i:04d}"
            args = side.args(f"pod-{i}", cid)
            for cmd in ("ADD", "DEL"):
                before = etcd.counters()
                run_cni(side.plugin, cmd, cid, ns, side.conf, side.cni_path, args)
                per[cmd].append(diff(before, etcd.counters()))
    seq = {}
    with pod_netns(f"{TAG}-reqdbg") as ns:
        for cmd in ("ADD", "DEL"):
            _, _, err = run_cni(side.plugin, cmd, "reqdbg0001", ns, debug_conf, side.cni_path,
                                side.args("pod-dbg", "reqdbg0001"))
            seq[cmd] = [f"{m.group(1)} ({m.group(2)})" for m in
                        re.finditer(r'etcd request what="([^"]+)" attempt=\d+ took=(\S+)', err)]
    return per, seq


class KubeApi:
    """The real kube-apiserver (tests/e2e/real_k8s_harness.rs `serve_for_bench`) in the host netns,
    seeded with the node, the pool and pods pod-0..pod-N and pod-dbg; its audit log counts
    the plugin's requests."""
    PLUGIN_USER = "system:serviceaccount:kube-system:calico-cni-plugin"

    def __init__(self, work, pods):
        self.dir = f"{work}/kube"
        os.makedirs(self.dir)
        env = dict(os.environ, BENCH_KUBE_API_NETNS=HOST, BENCH_KUBE_API_DIR=self.dir, BENCH_PODS=str(pods))
        self.log = open(f"{work}/kube-harness.log", "w")
        self.proc = subprocess.Popen([KUBE_API_BIN, "--ignored", "--exact", "real_k8s_harness::serve_for_bench",
                                      "--nocapture"],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT)
        for _ in range(3000):
            if os.path.exists(f"{self.dir}/ready"):
                break
            if self.proc.poll() is not None:
                raise SystemExit(f"the API server harness exited: see {work}/kube-harness.log")
            time.sleep(0.05)
        else:
            raise SystemExit("the real API server did not start within 150 s")
        self.kubeconfig = f"{self.dir}/kubeconfig"
        self.audit = open(f"{self.dir}/audit").read().strip()

    def stop(self):
        open(f"{self.dir}/stop", "w").close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def plugin_requests(self):
        """(received, done, verb, path, code) of every request by the plugin's ServiceAccount,
        in the order received (epoch seconds)."""
        out = []
        for line in open(self.audit):
            e = json.loads(line)
            if e.get("user", {}).get("username") != self.PLUGIN_USER:
                continue
            uri = e.get("requestURI", "").split("?")[0]
            out.append((epoch(e["requestReceivedTimestamp"]), epoch(e["stageTimestamp"]), e.get("verb", ""),
                        uri, e.get("responseStatus", {}).get("code", 0)))
        out.sort()
        return out


def epoch(rfc3339):
    """Seconds since the epoch of the audit log's `2026-11-26T18:56:23.123456Z`."""
    main, _, frac = rfc3339.rstrip("Z").partition(".")
    return time.mktime(time.strptime(main, "%Y-%m-%dT%H:%M:%S")) - time.timezone + float("0." + (frac or "0"))


def api_requests(api, side, debug_conf, pods=5):
    """The API requests of each ADD and DEL (the audit log's, by when the server received
    them), and one ADD's and DEL's API requests from our debug log (in completion order,
    with how long each took as the plugin saw it)."""
    windows = []
    for i in range(pods):
        with pod_netns(f"{TAG}-areq{side.name}{i}") as ns:
            cid = f"areq{side.name}{i:04d}"
            args = side.args(f"pod-{i}", cid)
            for cmd in ("ADD", "DEL"):
                t0 = time.time()
                run_cni(side.plugin, cmd, cid, ns, side.conf, side.cni_path, args)
                windows.append((cmd, t0, time.time()))
    seq = {}
    with pod_netns(f"{TAG}-areqdbg{side.name}") as ns:
        for cmd in ("ADD", "DEL"):
            _, _, err = run_cni(side.plugin, cmd, f"areqdbg{side.name}", ns, debug_conf, side.cni_path,
                                side.args("pod-dbg", f"areqdbg{side.name}"))
            seq[cmd] = [f"{m.group(1)} {m.group(2)} -> {m.group(3)} ({m.group(4)})" for m in
                        re.finditer(r'API request method=(\S+) path="?([^" ]+)"? status=(\d+)(?: took=(\S+))?', err)]
    time.sleep(1.0)  # the audit log is written as each answer completes
    reqs = api.plugin_requests()
    per = {"ADD": [], "DEL": []}
    for cmd, t0, t1 in windows:
        per[cmd].append([r for r in reqs if t0 <= r[0] <= t1])
    return per, seq


def version_times(path, n=100):
    """VERSION from exec to exit: wall times (ms) and the child's CPU times (user + system, ms,
    from wait4: what the process itself costs, whatever else the machine runs)."""
    wall, cpu = [], []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        p = subprocess.Popen([path], env={"CNI_COMMAND": "VERSION"}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        _, _, ru = os.wait4(p.pid, 0)
        wall.append((time.perf_counter_ns() - t0) / 1e6)
        cpu.append((ru.ru_utime + ru.ru_stime) * 1e3)
        p.returncode = 0
    return wall, cpu


def machine():
    model = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    return (f"{os.uname().nodename}: {os.cpu_count()} CPUs ({model}), kernel {os.uname().release}, "
            f"load {os.getloadavg()[0]:.2f} at start; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


def main():
    if os.geteuid() != 0:
        raise SystemExit("bench.py must run as root (it creates network namespaces)")
    if not os.access(GNU_TIME, os.X_OK):
        raise SystemExit(f"{GNU_TIME} (Debian package `time`) is needed for the peak RSS")
    started = machine()
    work = tempfile.mkdtemp(prefix="calico-bench.")
    etcd = api = None
    try:
        sh("ip", "netns", "add", HOST)
        sh("ip", "netns", "exec", HOST, "ip", "link", "set", "lo", "up")
        etcd = Etcd(work)
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        meta = lambda n: {"name": n, "creationTimestamp": now}
        etcd.put("/calico/resources/v3/projectcalico.org/clusterinformations/default",
                 {"kind": "ClusterInformation", "apiVersion": "projectcalico.org/v3", "metadata": meta("default"),
                  "spec": {"datastoreReady": True}})
        etcd.put("/calico/resources/v3/projectcalico.org/nodes/bench-node",
                 {"kind": "Node", "apiVersion": "projectcalico.org/v3", "metadata": meta("bench-node"), "spec": {}})
        # The other binary's calls run as another node of the same cluster (blocks, lock file
        # and the blocks its lock holders keep of their own), as two plugin versions would
        # only ever meet.
        for node in ("bench-node-before", "bench-node-upstream", "bench-node-control"):
            etcd.put(f"/calico/resources/v3/projectcalico.org/nodes/{node}",
                     {"kind": "Node", "apiVersion": "projectcalico.org/v3", "metadata": meta(node), "spec": {}})
        etcd.put("/calico/resources/v3/projectcalico.org/ippools/default-ipv4-ippool",
                 {"kind": "IPPool", "apiVersion": "projectcalico.org/v3", "metadata": meta("default-ipv4-ippool"),
                  "spec": {"cidr": "10.244.0.0/16", "blockSize": 26, "nodeSelector": "all()"}})

        # The real API server, for etcd with policy k8s and for the Kubernetes datastore.
        api = KubeApi(work, max(WARMUP + RUNS, CONCURRENT) + 5) if KUBE_API_BIN else None

        bindir = f"{work}/bin"
        os.makedirs(bindir)
        # Copies, as an installer puts the plugin in /opt/cni/bin: a binary the linker has
        # just written sits in the page cache in small pieces, which makes every exec of it
        # fault more (measured: ~1 ms more CPU per ADD than the same bytes copied).
        shutil.copy2(BIN, f"{bindir}/calico")
        os.symlink("calico", f"{bindir}/calico-ipam")
        for p in ("ptp", "host-local"):
            os.symlink(f"/usr/lib/cni/{p}", f"{bindir}/{p}")
        # The other binary in a directory of its own (calico-ipam runs in-process only when
        # it is the same file as calico).
        beforedir = f"{work}/before"
        if BEFORE_BIN:
            os.makedirs(beforedir)
            shutil.copy2(BEFORE_BIN, f"{beforedir}/calico")
            os.symlink("calico", f"{beforedir}/calico-ipam")
        # Upstream's calico (it picks its role by its file name: calico-ipam is its copy, as
        # its image installs it) and this build again for the control, each in its own folder.
        upstreamdir, controldir = f"{work}/upstream", f"{work}/control"
        if UPSTREAM_DIR:
            upstream_calico = os.path.join(UPSTREAM_DIR, "calico")
            if not os.access(upstream_calico, os.X_OK):
                raise SystemExit(f"CALICO_UPSTREAM_BIN={UPSTREAM_DIR} holds no calico")
            os.makedirs(upstreamdir)
            shutil.copy2(upstream_calico, f"{upstreamdir}/calico")
            shutil.copy2(upstream_calico, f"{upstreamdir}/calico-ipam")
            os.makedirs(controldir)
            shutil.copy2(BIN, f"{controldir}/calico")
            os.symlink("calico", f"{controldir}/calico-ipam")
        else:
            print("bench: CALICO_UPSTREAM_BIN is unset (the folder of upstream Calico v3.32.1's binaries, "
                  "built from its source outside this repository): the upstream rows are left out", file=sys.stderr)

        plain = {"cniVersion": "1.0.0", "name": "k8s-pod-network", "type": "calico",
                 "etcd_endpoints": f"http://127.0.0.1:{etcd.port}", "nodename": "bench-node",
                 "nodename_file_optional": True, "mtu": 1440, "log_level": "warn",
                 "log_file_path": f"{work}/cni.log", "ipam_lock_file": f"{work}/ipam.lock",
                 "ipam": {"type": "calico-ipam"},
                 # A pod's ADD makes its API client even without policy type k8s (upstream's
                 # too, and fails without one); from an API root alone nothing is read.
                 "kubernetes": {"k8s_api_root": "https://127.0.0.1:1"}}
        # Calico's etcd manifest: policy k8s, the pod and its namespace read from the API
        # server with the plugin's kubeconfig.
        base = dict(plain, policy={"type": "k8s"}, kubernetes={"kubeconfig": api.kubeconfig}) if api else plain
        ours = Side("calico", f"{bindir}/calico", json.dumps(base), bindir, True,
                    "calico+calico-ipam (etcd, policy k8s)" if api else "calico+calico-ipam (etcd)")
        debug_conf = json.dumps(dict(base, log_level="debug", log_file_path=f"{work}/cni-debug.log"))
        sides = [ours]
        plain_side = None
        if api:
            plain_side = Side("plain", f"{bindir}/calico", json.dumps(plain), bindir, True,
                              "calico+calico-ipam (etcd, no API reads)")
            sides.append(plain_side)
        kdd = kdd_conf = None
        if api:
            # Calico's Kubernetes-datastore manifest, calico_api_group as the installer writes
            # it (empty, the plugin would also ask the API server which group it serves).
            kdd_conf = {"cniVersion": "1.0.0", "name": "k8s-pod-network", "type": "calico",
                        "datastore_type": "kubernetes", "kubernetes": {"kubeconfig": api.kubeconfig},
                        "calico_api_group": "crd.projectcalico.org/v1",
                        "policy": {"type": "k8s"}, "nodename": "bench-node", "nodename_file_optional": True,
                        "mtu": 1440, "log_level": "warn", "log_file_path": f"{work}/cni-kdd.log",
                        "ipam_lock_file": f"{work}/ipam-kdd.lock", "ipam": {"type": "calico-ipam"}}
            kdd = Side("kdd", f"{bindir}/calico", json.dumps(kdd_conf), bindir, True,
                       "calico+calico-ipam (Kubernetes datastore)")
            sides.append(kdd)
        befores = []
        if BEFORE_BIN:
            as_other_node = lambda conf, lock: json.dumps(
                dict(json.loads(conf), nodename="bench-node-before", ipam_lock_file=f"{work}/{lock}"))
            befores.append(Side("before", f"{beforedir}/calico", as_other_node(ours.conf, "ipam-before.lock"),
                                beforedir, True, f"{BEFORE_LABEL}: {ours.label}"))
            if kdd:
                befores.append(Side("beforekdd", f"{beforedir}/calico",
                                    as_other_node(kdd.conf, "ipam-kdd-before.lock"), beforedir, True,
                                    f"{BEFORE_LABEL}: {kdd.label}"))
        sides += befores
        # Upstream and the control: each configuration of ours again, as another node.
        peers = {}  # ours' side name -> (upstream side, control side)
        if UPSTREAM_DIR:
            as_node = lambda side, node, lock: json.dumps(
                dict(json.loads(side.conf), nodename=node, ipam_lock_file=f"{work}/{lock}"))
            for mine in [x for x in (ours, plain_side, kdd) if x]:
                up = Side(f"up{mine.name}", f"{upstreamdir}/calico",
                          as_node(mine, "bench-node-upstream", f"ipam-up-{mine.name}.lock"), upstreamdir, True,
                          f"upstream v3.32.1: {mine.label}")
                ctl = Side(f"ctl{mine.name}", f"{controldir}/calico",
                           as_node(mine, "bench-node-control", f"ipam-ctl-{mine.name}.lock"), controldir, True,
                           f"control (this build): {mine.label}")
                peers[mine.name] = (up, ctl)
                sides += [up, ctl]
        ptp = Side("ptp", f"{bindir}/ptp", json.dumps(
            {"cniVersion": "1.0.0", "name": "benchnet", "type": "ptp", "ipMasq": False, "mtu": 1440,
             "ipam": {"type": "host-local", "subnet": "10.252.0.0/16", "dataDir": f"{work}/host-local",
                      "routes": [{"dst": "0.0.0.0/0"}]}}), bindir, False, "ptp+host-local")

        # What every call of either side pays for being run through `ip netns exec`.
        exec_overhead = []
        for _ in range(30):
            t0 = time.perf_counter_ns()
            sh("ip", "netns", "exec", HOST, "/bin/true")
            exec_overhead.append((time.perf_counter_ns() - t0) / 1e6)

        interleaved([ptp] + sides)
        per, seq = etcd_requests(etcd, ours, debug_conf)
        api_reqs = {}
        if api:
            api_reqs["calico"] = api_requests(api, ours, debug_conf)
            kdd_debug = json.dumps(dict(kdd_conf, log_level="debug", log_file_path=f"{work}/cni-kdd-debug.log"))
            api_reqs["kdd"] = api_requests(api, kdd, kdd_debug)
        # Upstream's, counted the same way (etcd's counters, the API server's audit log).
        up_per = {}
        up_api = {}
        if "calico" in peers:
            up = peers["calico"][0]
            up_per = etcd_requests(etcd, up, up.conf)[0]
            if api:
                up_api["calico"] = api_requests(api, up, up.conf)[0]
                up_api["kdd"] = api_requests(api, peers["kdd"][0], peers["kdd"][0].conf)[0]

        conc_sides = [ours, ptp] + ([plain_side] if plain_side else []) + [b for b in befores if b.name == "before"]
        if "calico" in peers:
            conc_sides.append(peers["calico"][0])
        conc = {s.name: [] for s in conc_sides}
        for r in range(ROUNDS):
            for side in rotated(conc_sides, r):
                conc[side.name].append(concurrent(side, CONCURRENT, f"{r}{side.name[0]}"))

        rss = {s.name: peak_rss(s) for s in [ptp] + sides}
        vers = {k: ([], []) for k in ("calico", "ptp", "true", "before")}
        for _ in range(4):
            for k, path in (("calico", f"{bindir}/calico"), ("ptp", f"{bindir}/ptp"), ("true", "/bin/true"),
                            ("before", f"{beforedir}/calico" if BEFORE_BIN else "")):
                if path:
                    w, c = version_times(path, 25)
                    vers[k][0].extend(w)
                    vers[k][1].extend(c)

        def line(label, v):
            return f"| {label} | {statistics.median(v):.1f} | {pct(v, 90):.1f} | {min(v):.1f} | {max(v):.1f} |"

        def ratio(a, b):
            return statistics.median(a) / statistics.median(b)

        print(f"\nmachine: {started}; load {os.getloadavg()[0]:.2f} at the end")
        print(f"runs: {RUNS} (+{WARMUP} warm-up) each, every side interleaved run by run, fresh pod netns each")
        if api:
            print("API server: the real kube-apiserver v1.35 (make deps, audit log on) in the host netns, "
                  "Calico's CRDs and the plugin's RBAC; direct plugin calls, no portmap (the pod-start rows chain it)")
        print("\n| operation (ms) | median | p90 | min | max | ratio to ptp+host-local |\n|---|---|---|---|---|---|")
        for cmd in ("ADD", "DEL"):
            ref = ptp.adds if cmd == "ADD" else ptp.dels
            for s in sides + [ptp]:
                v = s.adds if cmd == "ADD" else s.dels
                print(line(f"{s.label} {cmd}", v) + f" {ratio(v, ref):.2f}x |")
        print("\n| operation (ms) | median | p90 | min | max |\n|---|---|---|---|---|")
        print(line("`ip netns exec HOST /bin/true` (in every row above)", exec_overhead))
        for s in sides + [ptp]:
            print(line(f"{s.label} ADD, CPU time (user + system, `ip netns exec` included)", s.adds_cpu))
            print(line(f"{s.label} DEL, CPU time", s.dels_cpu))
        print(line("calico VERSION (exec to exit)", vers["calico"][0]))
        print(line("ptp VERSION (exec to exit)", vers["ptp"][0]))
        print(line("/bin/true (exec to exit)", vers["true"][0]))
        print(line("calico VERSION, CPU time (user + system)", vers["calico"][1]))
        print(line("ptp VERSION, CPU time", vers["ptp"][1]))
        print(line("/bin/true, CPU time", vers["true"][1]))
        if BEFORE_BIN:
            print(line(f"{BEFORE_LABEL}: calico VERSION (exec to exit)", vers["before"][0]))
            print(line(f"{BEFORE_LABEL}: calico VERSION, CPU time", vers["before"][1]))
            print(f"\nthis build ÷ {BEFORE_LABEL}, ratio of medians [90 % bootstrap, 4000 resamples "
                  "of each side]:\n\n| configuration | ADD | DEL |\n|---|---|---|")
            for mine, theirs in ((ours, "before"), (kdd, "beforekdd")):
                other = next((b for b in befores if b.name == theirs), None)
                if mine and other:
                    cells = [ratio_interval(a, b) for a, b in
                             ((mine.adds, other.adds), (mine.dels, other.dels))]
                    print(f"| {mine.label} | {cells[0]} | {cells[1]} |")
        if peers:
            print("\nours ÷ upstream Calico v3.32.1, and ours ÷ the same build as another node (the control), "
                  "ratio of medians [90 % bootstrap, 4000 resamples of each side]:\n\n"
                  "| configuration | against | ADD | DEL | ADD CPU | DEL CPU | peak RSS ADD | peak RSS DEL |\n"
                  "|---|---|---|---|---|---|---|---|")
            for mine in [x for x in (ours, plain_side, kdd) if x]:
                for other in peers[mine.name]:
                    cells = [ratio_interval(a, b) for a, b in
                             ((mine.adds, other.adds), (mine.dels, other.dels),
                              (mine.adds_cpu, other.adds_cpu), (mine.dels_cpu, other.dels_cpu))]
                    (ra, rd), (oa, od) = rss[mine.name], rss[other.name]
                    against = "upstream" if other.name.startswith("up") else "control"
                    print(f"| {mine.label} | {against} | {' | '.join(cells)} | {ratio(ra, oa):.3f} | {ratio(rd, od):.3f} |")
        etcd_plain = plain_side or ours
        print(f"\netcd, no API reads: ADD ratio ours/ptp+host-local (median): {ratio(etcd_plain.adds, ptp.adds):.2f}x   (target <= 0.7x)")
        print(f"etcd, no API reads: DEL ratio ours/ptp+host-local (median): {ratio(etcd_plain.dels, ptp.dels):.2f}x   (target <= 0.9x)")
        print(f"VERSION median: {statistics.median(vers['calico'][0]):.2f} ms   (target <= 1.5 ms)")
        print("\npeak RSS, MB (median of 5; max):\n\n| | ADD | DEL |\n|---|---|---|")
        for s in sides + [ptp]:
            a, d = rss[s.name]
            print(f"| {s.label} | {statistics.median(a) / 1024:.1f} ({max(a) / 1024:.1f}) "
                  f"| {statistics.median(d) / 1024:.1f} ({max(d) / 1024:.1f}) |")
        print("(target <= 12 MB)")

        print(f"\n{CONCURRENT} concurrent calls on one node (fresh netns each, all addresses distinct), "
              f"{ROUNDS} rounds, wall time (s):\n")
        print("| | ADD | DEL |\n|---|---|---|")
        for s in conc_sides:
            a = [x[0] for x in conc[s.name]]
            d = [x[1] for x in conc[s.name]]
            print(f"| {s.label} | {statistics.median(a):.2f} ({', '.join(f'{x:.2f}' for x in a)}) "
                  f"| {statistics.median(d):.2f} ({', '.join(f'{x:.2f}' for x in d)}) |")
        print("(target: ADD <= 0.7 s)")

        print(f"\netcd requests per call of {ours.label} (etcd's counters, 5 pods):\n")
        print("| call | Range | Txn | Put | DeleteRange | WAL fsyncs |\n|---|---|---|---|---|---|")
        for who, counted in (("", per), ("upstream v3.32.1 ", up_per)):
            for cmd in ("ADD", "DEL") if counted else ():
                m = {k: statistics.mean(x[k] for x in counted[cmd]) for k in counted[cmd][0]}
                print(f"| {who}{cmd} | {m['Range']:.1f} | {m['Txn']:.1f} | {m['Put']:.1f} | {m['DeleteRange']:.1f} "
                      f"| {m['fsync']:.1f} |")
        for cmd in ("ADD", "DEL"):
            print(f"\n{cmd} sequence (our debug log, completion order):")
            for s in seq[cmd]:
                print(f"  {s}")

        for name, (aper, aseq) in api_reqs.items():
            label = ours.label if name == "calico" else kdd.label
            print(f"\nAPI requests of {label} (the real server's audit log, 5 pods): per ADD "
                  f"{statistics.mean(map(len, aper['ADD'])):.1f}, per DEL {statistics.mean(map(len, aper['DEL'])):.1f}")
            if name in up_api:
                uper = up_api[name]
                print(f"upstream v3.32.1, the same: per ADD {statistics.mean(map(len, uper['ADD'])):.1f}, "
                      f"per DEL {statistics.mean(map(len, uper['DEL'])):.1f}")
                for cmd in ("ADD", "DEL"):
                    print(f"  upstream's last {cmd}: " + ", ".join(f"{v} {p} -> {c}" for (_, _, v, p, c) in uper[cmd][-1]))
            for cmd in ("ADD", "DEL"):
                one = aper[cmd][-1]
                t0 = one[0][0] if one else 0
                print(f"\none {cmd}, as the server received and answered them (ms from the first):")
                for (rx, done, verb, path, code) in one:
                    print(f"  +{(rx - t0) * 1e3:5.1f} .. +{(done - t0) * 1e3:5.1f}  {verb} {path} -> {code}")
                print(f"{cmd}, our debug log (completion order, time as the plugin saw it):")
                for x in aseq[cmd]:
                    print(f"  {x}")
    finally:
        if api:
            api.stop()
        if etcd:
            etcd.stop()
        subprocess.run(["ip", "netns", "del", HOST], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
