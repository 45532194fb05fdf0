#!/usr/bin/env python3
"""calico-cni-rs benchmark (not a test).

- ADD and DEL latency of our calico + calico-ipam on a real etcd against Debian's ptp +
  host-local, interleaved run by run (fresh pod netns each), median, p90 and the ratio;
- the same against the Kubernetes test API server (when BENCH_KUBE_API_BIN is set);
- the datastore requests of one ADD and one DEL (etcd's own counters, and the sequence from
  our debug log);
- N concurrent ADDs on one node (all distinct addresses, asserted; total wall time), then N
  concurrent DELs, against the same for ptp + host-local;
- peak RSS of one ADD and one DEL (GNU time, see `peak_rss`), VERSION start-up time.

Everything runs in network namespaces this script creates (a "host" netns with its own etcd on
127.0.0.1, fresh pod netns); nothing touches the real host's network.
Usage: bench.py path/to/calico [runs]   (root; env BENCH_CONCURRENT=100, BENCH_ROUNDS=3;
BENCH_BEFORE=path/to/another/calico adds that binary, interleaved the same way, for a
before/after comparison within one run, named BENCH_BEFORE_LABEL in the report)
"""
import contextlib, json, os, re, resource, shutil, socket, statistics, subprocess, sys, tempfile, time

BIN = os.path.realpath(sys.argv[1] if len(sys.argv) > 1 else "target/release/calico")
RUNS = int(sys.argv[2]) if len(sys.argv) > 2 else 40
# The test API server's binary (tests/kube_api_server.rs `serve_for_bench`), for the
# Kubernetes-datastore rows; skipped when unset.
KUBE_API_BIN = os.environ.get("BENCH_KUBE_API_BIN", "")
BEFORE_BIN = os.path.realpath(os.environ["BENCH_BEFORE"]) if os.environ.get("BENCH_BEFORE") else ""
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

    def __init__(self, name, plugin, conf, cni_path, k8s):
        self.name, self.plugin, self.conf, self.cni_path, self.k8s = name, plugin, conf, cni_path, k8s
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


def bench_kdd(work, bindir, ptp_side):
    """ADD/DEL on the Kubernetes datastore against the test API server, interleaved with
    ptp+host-local; the API requests per ADD and per DEL (the server's log, one connection
    per call)."""
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
        # calico_api_group as the installer writes it into the conflist (empty, the plugin
        # would also ask the API server which group it serves: one request more per call).
        conf = json.dumps({"cniVersion": "1.0.0", "name": "k8s-pod-network", "type": "calico",
                           "datastore_type": "kubernetes", "kubernetes": {"kubeconfig": f"{kdir}/kubeconfig"},
                           "calico_api_group": "crd.projectcalico.org/v1",
                           "policy": {"type": "k8s"}, "nodename": "bench-node", "nodename_file_optional": True,
                           "mtu": 1440, "log_level": "warn", "log_file_path": f"{work}/cni-kdd.log",
                           "ipam_lock_file": f"{work}/ipam-kdd.lock", "ipam": {"type": "calico-ipam"}})
        kdd = Side("kdd", f"{bindir}/calico", conf, bindir, True)
        ref = Side("ptp2", ptp_side.plugin, ptp_side.conf, bindir, False)
        interleaved([ref, kdd])
    finally:
        open(f"{kdir}/stop", "w").close()
        server.wait(timeout=30)
    log = json.load(open(f"{kdir}/requests.json"))
    handshakes = int(open(f"{kdir}/handshakes").read())
    by_conn = {}
    for r in log:
        by_conn.setdefault(r["connection"], []).append(f'{r["method"]} {r["path"]}')
    calls = list(by_conn.values())
    dels = [c for c in calls if any(x.startswith("DELETE ") for x in c)]
    adds = [c for c in calls if c not in dels]
    return kdd, ref, len(log), len(calls), handshakes, adds, dels


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
    etcd = None
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
        etcd.put("/calico/resources/v3/projectcalico.org/ippools/default-ipv4-ippool",
                 {"kind": "IPPool", "apiVersion": "projectcalico.org/v3", "metadata": meta("default-ipv4-ippool"),
                  "spec": {"cidr": "10.244.0.0/16", "blockSize": 26, "nodeSelector": "all()"}})

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

        base = {"cniVersion": "1.0.0", "name": "k8s-pod-network", "type": "calico",
                "etcd_endpoints": f"http://127.0.0.1:{etcd.port}", "nodename": "bench-node",
                "nodename_file_optional": True, "mtu": 1440, "log_level": "warn",
                "log_file_path": f"{work}/cni.log", "ipam_lock_file": f"{work}/ipam.lock",
                "ipam": {"type": "calico-ipam"}}
        ours = Side("calico", f"{bindir}/calico", json.dumps(base), bindir, True)
        debug_conf = json.dumps(dict(base, log_level="debug", log_file_path=f"{work}/cni-debug.log"))
        before = Side("before", f"{beforedir}/calico", ours.conf, beforedir, True) if BEFORE_BIN else None
        ptp = Side("ptp", f"{bindir}/ptp", json.dumps(
            {"cniVersion": "1.0.0", "name": "benchnet", "type": "ptp", "ipMasq": False, "mtu": 1440,
             "ipam": {"type": "host-local", "subnet": "10.252.0.0/16", "dataDir": f"{work}/host-local",
                      "routes": [{"dst": "0.0.0.0/0"}]}}), bindir, False)

        # What every call of either side pays for being run through `ip netns exec`.
        exec_overhead = []
        for _ in range(30):
            t0 = time.perf_counter_ns()
            sh("ip", "netns", "exec", HOST, "/bin/true")
            exec_overhead.append((time.perf_counter_ns() - t0) / 1e6)

        interleaved([ptp, ours] + ([before] if before else []))
        per, seq = etcd_requests(etcd, ours, debug_conf)
        kdd = bench_kdd(work, bindir, ptp) if KUBE_API_BIN else None

        all_sides = [ours, ptp] + ([before] if before else [])
        conc = {s.name: [] for s in all_sides}
        for r in range(ROUNDS):
            for side in rotated(all_sides, r):
                conc[side.name].append(concurrent(side, CONCURRENT, f"{r}{side.name[0]}"))

        rss = {s.name: peak_rss(s) for s in all_sides}
        rss_ours, rss_ptp = rss["calico"], rss["ptp"]
        vers = {k: ([], []) for k in ("calico", "ptp", "true", "before")}
        for _ in range(4):
            for k, path in (("calico", f"{bindir}/calico"), ("ptp", f"{bindir}/ptp"), ("true", "/bin/true"),
                            ("before", f"{beforedir}/calico" if before else "")):
                if path:
                    w, c = version_times(path, 25)
                    vers[k][0].extend(w)
                    vers[k][1].extend(c)
        ver, ref_ver, true_ver, before_ver = (vers[k][0] for k in ("calico", "ptp", "true", "before"))

        def line(label, v):
            return f"| {label} | {statistics.median(v):.1f} | {pct(v, 90):.1f} | {min(v):.1f} | {max(v):.1f} |"

        def ratio(a, b):
            return statistics.median(a) / statistics.median(b)

        print(f"\nmachine: {started}")
        print(f"runs: {RUNS} (+{WARMUP} warm-up) each, ours and the reference interleaved, fresh pod netns each\n")
        print("| operation (ms) | median | p90 | min | max |\n|---|---|---|---|---|")
        print(line("calico+calico-ipam ADD (etcd)", ours.adds))
        print(line("ptp+host-local ADD", ptp.adds))
        print(line("calico+calico-ipam DEL (etcd)", ours.dels))
        print(line("ptp+host-local DEL", ptp.dels))
        print(line("`ip netns exec HOST /bin/true` (in every row above)", exec_overhead))
        print(line("calico+calico-ipam ADD, CPU time (user + system, `ip netns exec` included)", ours.adds_cpu))
        print(line("ptp+host-local ADD, CPU time", ptp.adds_cpu))
        print(line("calico+calico-ipam DEL, CPU time", ours.dels_cpu))
        print(line("ptp+host-local DEL, CPU time", ptp.dels_cpu))
        print(line("calico VERSION (exec to exit)", ver))
        print(line("ptp VERSION (exec to exit)", ref_ver))
        print(line("/bin/true (exec to exit)", true_ver))
        print(line("calico VERSION, CPU time (user + system)", vers["calico"][1]))
        print(line("ptp VERSION, CPU time", vers["ptp"][1]))
        print(line("/bin/true, CPU time", vers["true"][1]))
        if before:
            print(line(f"{BEFORE_LABEL}: calico+calico-ipam ADD (etcd)", before.adds))
            print(line(f"{BEFORE_LABEL}: calico+calico-ipam DEL (etcd)", before.dels))
            print(line(f"{BEFORE_LABEL}: calico+calico-ipam ADD, CPU time", before.adds_cpu))
            print(line(f"{BEFORE_LABEL}: calico+calico-ipam DEL, CPU time", before.dels_cpu))
            print(line(f"{BEFORE_LABEL}: calico VERSION (exec to exit)", before_ver))
            print(line(f"{BEFORE_LABEL}: calico VERSION, CPU time", vers["before"][1]))
        print(f"\nADD ratio ours/ptp+host-local (median): {ratio(ours.adds, ptp.adds):.2f}x   (target <= 0.7x)")
        print(f"DEL ratio ours/ptp+host-local (median): {ratio(ours.dels, ptp.dels):.2f}x   (target <= 0.9x)")
        print(f"VERSION median: {statistics.median(ver):.2f} ms   (target <= 1.5 ms)")
        print(f"peak RSS (median of {len(rss_ours[0])}, max): ADD {statistics.median(rss_ours[0]) / 1024:.1f} MB "
              f"({max(rss_ours[0]) / 1024:.1f}), DEL {statistics.median(rss_ours[1]) / 1024:.1f} MB "
              f"({max(rss_ours[1]) / 1024:.1f})   (target <= 12 MB); ptp+host-local ADD "
              f"{statistics.median(rss_ptp[0]) / 1024:.1f} MB, DEL {statistics.median(rss_ptp[1]) / 1024:.1f} MB")
        if before:
            print(f"{BEFORE_LABEL}: ADD ratio {ratio(before.adds, ptp.adds):.2f}x, DEL ratio {ratio(before.dels, ptp.dels):.2f}x, "
                  f"VERSION {statistics.median(before_ver):.2f} ms, peak RSS ADD "
                  f"{statistics.median(rss['before'][0]) / 1024:.1f} MB, DEL {statistics.median(rss['before'][1]) / 1024:.1f} MB")

        print(f"\n{CONCURRENT} concurrent calls on one node (fresh netns each, all addresses distinct), "
              f"{ROUNDS} rounds, wall time (s):\n")
        print("| | ADD | DEL |\n|---|---|---|")
        for name, label in (("calico", "calico+calico-ipam (etcd)"), ("ptp", "ptp+host-local"),
                            ("before", f"{BEFORE_LABEL}: calico+calico-ipam (etcd)")):
            if name not in conc:
                continue
            a = [x[0] for x in conc[name]]
            d = [x[1] for x in conc[name]]
            print(f"| {label} | {statistics.median(a):.2f} ({', '.join(f'{x:.2f}' for x in a)}) "
                  f"| {statistics.median(d):.2f} ({', '.join(f'{x:.2f}' for x in d)}) |")
        print("(target: ADD <= 0.7 s)")

        print("\netcd requests per call (etcd's counters, 5 pods):\n")
        print("| call | Range | Txn | Put | DeleteRange | WAL fsyncs |\n|---|---|---|---|---|---|")
        for cmd in ("ADD", "DEL"):
            m = {k: statistics.mean(x[k] for x in per[cmd]) for k in per[cmd][0]}
            print(f"| {cmd} | {m['Range']:.1f} | {m['Txn']:.1f} | {m['Put']:.1f} | {m['DeleteRange']:.1f} | {m['fsync']:.1f} |")
        for cmd in ("ADD", "DEL"):
            print(f"\n{cmd} sequence (our debug log, completion order):")
            for s in seq[cmd]:
                print(f"  {s}")

        if kdd:
            (k, r, requests, calls, handshakes, adds, dels) = kdd
            print("\nKubernetes datastore (test API server in the host netns; interleaved with ptp+host-local):\n")
            print("| operation (ms) | median | p90 | min | max |\n|---|---|---|---|---|")
            print(line("calico+calico-ipam ADD (kubernetes, policy k8s)", k.adds))
            print(line("ptp+host-local ADD", r.adds))
            print(line("calico+calico-ipam DEL (kubernetes, policy k8s)", k.dels))
            print(line("ptp+host-local DEL", r.dels))
            print(f"\nKDD ADD ratio (median): {ratio(k.adds, r.adds):.2f}x; DEL ratio: {ratio(k.dels, r.dels):.2f}x")
            print(f"API requests: {requests} in {calls} calls; TLS handshakes: {handshakes} "
                  f"({handshakes / max(calls, 1):.2f} per call); per ADD "
                  f"{statistics.mean(map(len, adds)):.1f}, per DEL {statistics.mean(map(len, dels)):.1f}")
    finally:
        if etcd:
            etcd.stop()
        subprocess.run(["ip", "netns", "del", HOST], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
