#!/usr/bin/env python3
"""Per-step timings of ADD and DEL on the Kubernetes datastore, for one or more builds side by
side in one run (interleaved), on the real API server of tests/e2e/real_k8s_harness.rs.

Each call runs with `log_level: debug`; a step's time is when its log line was written,
counted from the call's exec (the log's own timestamps, in ms; the exec instant is taken as
the first line's minus the process start-up, which the first line follows at once). The
milestones are the log messages named in STEPS; the API requests are listed with what the
plugin saw each take. Medians over RUNS pairs.

Usage: BENCH_KUBE_API_BIN=<the e2e test binary> \
       benches/del_steps.py LABEL=path/to/calico [LABEL=path] [runs]
"""
import os, re, shutil, statistics, sys, tempfile, time
from datetime import datetime

builds = [a.split("=", 1) for a in sys.argv[1:] if "=" in a]
RUNS = int(next((a for a in sys.argv[1:] if a.isdigit()), "20"))
# Each build runs as a node of its own (its own affine block and lock file, as two versions
# only ever meet): the harness seeds two.
NODES = ["bench-node", "bench-node-before"]
if not builds or len(builds) > len(NODES):
    raise SystemExit(__doc__)
# bench.py reads its binary from argv at import; it is only used for its helpers here.
sys.argv = [sys.argv[0], builds[0][1]]
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402

LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) \[(\w+)\]\[\d+\] (\S+ \d+): (.*)$")
REQ = re.compile(r'API request method=(\S+) path="?([^" ]+)"? status=(\d+)(?: took=(\S+))?')


def ms_of(stamp):
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S.%f").timestamp() * 1e3


def timeline(stderr, exec_ms):
    """(ms since exec, what) of every log line of one call."""
    out = []
    for line in stderr.splitlines():
        m = LINE.match(line)
        if m:
            what = m.group(4)
            r = REQ.search(what)
            if r:
                path = re.sub(r"/pods/[^/?]+", "/pods/<pod>", r.group(2).split("?")[0])
                path = re.sub(r"/(ipamhandles|blockaffinities|ipamblocks)/[^/?]+", r"/\1/<name>", path)
                what = f"API {r.group(1)} {path} -> {r.group(3)} (took {r.group(4)})"
            else:
                what = re.sub(r"\s+\S+=\S+.*$", "", what)[:90]
            out.append((ms_of(m.group(1)) - exec_ms, what))
    return out


def main():
    if not bench.KUBE_API_BIN:
        raise SystemExit("BENCH_KUBE_API_BIN (the e2e test binary) is needed")
    work = tempfile.mkdtemp(prefix="calico-delsteps.")
    api = None
    try:
        bench.sh("ip", "netns", "add", bench.HOST)
        bench.sh("ip", "netns", "exec", bench.HOST, "ip", "link", "set", "lo", "up")
        api = bench.KubeApi(work, RUNS + 10)
        sides = []
        for (label, path), node in zip(builds, NODES):
            d = f"{work}/{label}"
            os.makedirs(d)
            shutil.copy2(path, f"{d}/calico")
            os.symlink("calico", f"{d}/calico-ipam")
            conf = ('{"cniVersion":"1.0.0","name":"k8s-pod-network","type":"calico",'
                    '"datastore_type":"kubernetes","kubernetes":{"kubeconfig":"%s"},'
                    '"calico_api_group":"crd.projectcalico.org/v1","policy":{"type":"k8s"},'
                    '"nodename":"%s","nodename_file_optional":true,"mtu":1440,'
                    '"log_level":"debug","log_file_path":"%s/cni.log","ipam_lock_file":"%s/ipam.lock",'
                    '"ipam":{"type":"calico-ipam"}}') % (api.kubeconfig, node, d, d)
            sides.append({"label": label, "dir": d, "conf": conf, "calls": {"ADD": [], "DEL": []}})
        for i in range(RUNS + 2):
            for s in bench.rotated(sides, i):
                with bench.pod_netns(f"{bench.TAG}-s{i}-{s['label']}") as ns:
                    cid = f"steps{s['label']}{i:04d}"
                    args = f"K8S_POD_NAMESPACE=default;K8S_POD_NAME=pod-{i};K8S_POD_INFRA_CONTAINER_ID={cid}"
                    for cmd in ("ADD", "DEL"):
                        t0 = time.time() * 1e3
                        dt, _, err = bench.run_cni(f"{s['dir']}/calico", cmd, cid, ns, s["conf"], s["dir"], args)
                        if i >= 2:  # warm-up
                            s["calls"][cmd].append((dt, timeline(err, t0)))
        for s in sides:
            for cmd in ("ADD", "DEL"):
                calls = s["calls"][cmd]
                print(f"\n## {s['label']} {cmd}: median {statistics.median(c[0] for c in calls):.1f} ms "
                      f"(wall, from exec to exit; {len(calls)} calls)")
                # The steps of the call whose wall time is the median, and each step's median
                # over all calls that logged it (matched by order of appearance).
                by_step = {}
                for _, tl in calls:
                    seen = {}
                    for t, what in tl:
                        k = (what, seen.get(what, 0))
                        seen[what] = k[1] + 1
                        by_step.setdefault(k, []).append(t)
                med_call = sorted(calls, key=lambda c: c[0])[len(calls) // 2]
                seen = {}
                for _, what in med_call[1]:
                    k = (what, seen.get(what, 0))
                    seen[what] = k[1] + 1
                    ts = by_step.get(k, [])
                    print(f"  {statistics.median(ts):7.1f} ms  {what}")
    finally:
        if api:
            api.stop()
        bench.subprocess.run(["ip", "netns", "del", bench.HOST])
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
