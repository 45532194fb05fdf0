#!/usr/bin/env python3
"""Combines several runs of benches/pod_start.sh (their BENCH_POD_JSON files) into one ratio
to ptp (or to another row, `--base`) per configuration.

Runs on the same node differ in its speed (ptp's own RunPodSandbox moved by 20 ms between
runs), so pooling their samples mixes two levels. Instead, each run gives its own ratio of
medians to ptp, and the runs' ratios are combined as a mean in log space, weighted by the
row's sample count. The 90 % interval comes from a bootstrap that resamples within each run
(both the row and ptp), so a run's own level is kept.

Usage: benches/pod_start_pool.py run.json... [--configs calico-etcd,calico-kdd] [--base ptp]
       [--keys run_alone_ms,stop_alone_ms,wave_ready_ms] [--resamples 4000]
"""

import argparse
import json
import math
import random
import statistics


def ratio(run, config, key, base_row, rng=None):
    """The run's median of `key` for `config` over `base_row`'s, resampled when `rng` is given."""
    rows, base = run["configs"][config][key], run["configs"][base_row][key]
    if rng is not None:
        rows = [rng.choice(rows) for _ in rows]
        base = [rng.choice(base) for _ in base]
    return statistics.median(rows) / statistics.median(base)


def combined(runs, config, key, ratios):
    """The weighted mean, in log space, of the runs' ratios."""
    weights = [len(run["configs"][config][key]) for run in runs]
    logs = sum(w * math.log(r) for w, r in zip(weights, ratios))
    return math.exp(logs / sum(weights))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="BENCH_POD_JSON files")
    parser.add_argument("--configs", default="")
    parser.add_argument("--keys", default="run_alone_ms,stop_alone_ms,run_wave_ms,wave_ready_ms")
    parser.add_argument("--resamples", type=int, default=4000)
    parser.add_argument("--base", default="ptp", help="the row the others are divided by")
    args = parser.parse_args()
    runs = [json.load(open(path)) for path in args.runs]
    rng = random.Random(1)
    configs = [c for c in args.configs.split(",") if c] or sorted(
        {c for run in runs for c in run["configs"] if c != args.base}
    )
    for config in configs:
        have = [run for run in runs if config in run["configs"] and args.base in run["configs"]]
        if not have:
            print(f"{config}: in none of the runs")
            continue
        for key in args.keys.split(","):
            point = [ratio(run, config, key, args.base) for run in have]
            boot = sorted(
                combined(have, config, key, [ratio(run, config, key, args.base, rng) for run in have])
                for _ in range(args.resamples)
            )
            lo, hi = boot[int(0.05 * len(boot))], boot[int(0.95 * len(boot)) - 1]
            above = sum(b > 1.0 for b in boot) / len(boot)
            per_run = ", ".join(f"{p:.3f}" for p in point)
            samples = sum(len(run["configs"][config][key]) for run in have)
            print(
                f"{config:12s} / {args.base} {key:14s} runs {len(have)} (n={samples}): per run [{per_run}]"
                f" combined {combined(have, config, key, point):.3f} [{lo:.3f}, {hi:.3f}]"
                f" bootstrap share above 1.0: {above:.3f}"
            )


if __name__ == "__main__":
    main()
