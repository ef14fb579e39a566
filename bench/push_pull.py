#!/usr/bin/python3
"""Push against pull, paired: the demo in pull mode and in push mode, run
after run, the order alternating (pull first, then push first) so that
neither mode always takes the machine as the other left it.

Prints each run's hand-off (the last prefill rank done to every decode rank
holding its KV: the span that is the same in both modes), its kernel
baseline in its own direction, and per pair the push / pull ratios; then
over the pairs their geometric mean, median and range. The run second in a
pair finds the machine as the first left it (memory just freed, caches), so
the pairs are an even number by default, half in each order, and the
geometric mean of their ratios weighs both orders alike.

Usage: bench/push_pull.py KVBRIDGE [--pairs N] [-- DEMO ARGS...]   (N: 4 by default)
  e.g. bench/push_pull.py build/tools/kvbridge --pairs 4 -- --preset qwen3-next
       --prefill-tp 2 --decode-tp 4 --min-tokens 8192 --max-tokens 16384 --requests 16
"""
import json
import math
import statistics
import subprocess
import sys


def main(argv):
    if len(argv) < 2 or argv[1].startswith("-"):
        sys.exit(__doc__)
    kvb, rest = argv[1], argv[2:]
    pairs = 4
    demo_args = []
    if "--" in rest:
        demo_args = rest[rest.index("--") + 1:]
        rest = rest[:rest.index("--")]
    if rest[:1] == ["--pairs"] and len(rest) == 2 and rest[1].isdigit() and int(rest[1]) > 0:
        pairs = int(rest[1])
    elif rest:
        sys.exit(f"push_pull: unexpected arguments {rest}\n{__doc__}")
    for forbidden in ("--mode", "--json", "--stream"):
        if forbidden in demo_args:
            sys.exit(f"push_pull: {forbidden} is set by this script")

    def run(mode):
        p = subprocess.run([kvb, "demo", "--mode", mode, "--json", "--no-progress", *demo_args],
                           capture_output=True, text=True, timeout=1800)
        if p.returncode != 0:
            sys.exit(f"push_pull: demo --mode {mode} exited {p.returncode}: {p.stderr[-2000:]}")
        r = json.loads(p.stdout)
        if not r["clean"] or r["verify_failures"] != 0:
            sys.exit(f"push_pull: demo --mode {mode} was not clean: {p.stdout[:2000]}")
        print(f"{mode:4}  hand-off {r['handoff_gbps']:.2f} GB/s, p50 {r['handoff_p50_ms']:.1f} ms;"
              f" raw {r['raw_baseline']} {r['raw_gbps']:.2f} GB/s", flush=True)
        return r

    gbps, p50 = [], []
    for i in range(pairs):
        order = ("pull", "push") if i % 2 == 0 else ("push", "pull")
        got = {m: run(m) for m in order}
        g = got["push"]["handoff_gbps"] / got["pull"]["handoff_gbps"]
        # Shorter is better: pull's p50 over push's is the throughput-like ratio.
        t = got["pull"]["handoff_p50_ms"] / got["push"]["handoff_p50_ms"]
        gbps.append(g)
        p50.append(t)
        print(f"pair {i + 1} ({order[0]} first): push / pull hand-off GB/s {g:.2f}, by p50 {t:.2f}", flush=True)
    def gmean(xs):
        return math.exp(sum(math.log(x) for x in xs) / len(xs))

    balance = "" if pairs % 2 == 0 else " (an odd count: pull went first once more)"
    print(f"over {pairs} pairs{balance}: push / pull hand-off GB/s geometric mean {gmean(gbps):.2f},"
          f" median {statistics.median(gbps):.2f}, range {min(gbps):.2f}-{max(gbps):.2f};"
          f" by p50 geometric mean {gmean(p50):.2f}, median {statistics.median(p50):.2f},"
          f" range {min(p50):.2f}-{max(p50):.2f}")


if __name__ == "__main__":
    main(sys.argv)
