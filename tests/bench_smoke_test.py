#!/usr/bin/env python3
"""Smoke test of `kvbridge bench`: a quick local run prints one JSON array
whose rows carry every required key, with positive figures. Speeds are not
asserted (STYLE.md: speed is measured in bench/, never asserted in a test).

Usage: bench_smoke_test.py PATH_TO_KVBRIDGE
"""
import json
import subprocess
import sys

REQUIRED = {"transport": str, "op": str, "block_bytes": int, "pattern": str, "batch": int,
            "gbps": (int, float), "baseline": str, "baseline_gbps": (int, float), "ratio": (int, float)}


def main():
    cmd = [sys.argv[1], "bench", "--quick", "--transport", "local", "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if run.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd)} exited {run.returncode}: {run.stderr}")
    rows = json.loads(run.stdout)
    if not isinstance(rows, list) or not rows:
        sys.exit("FAIL: expected a non-empty JSON array")
    for i, row in enumerate(rows):
        for key, kind in REQUIRED.items():
            if key not in row or not isinstance(row[key], kind):
                sys.exit(f"FAIL: row {i} lacks {key} of type {kind}: {row}")
        if row["op"] not in ("read", "write") or row["pattern"] not in ("contiguous", "shuffled"):
            sys.exit(f"FAIL: row {i} has an unknown op or pattern: {row}")
        for key in ("block_bytes", "batch", "gbps", "baseline_gbps", "ratio"):
            if not row[key] > 0:
                sys.exit(f"FAIL: row {i} has {key} <= 0: {row}")
        if row["transport"] != "local" or row["baseline"] != "memcpy":
            sys.exit(f"FAIL: row {i} is not a local row against memcpy: {row}")
    seen = {(r["op"], r["pattern"]) for r in rows}
    if len(seen) != 4:
        sys.exit(f"FAIL: expected read/write x contiguous/shuffled rows, got {sorted(seen)}")
    print(f"ok: {len(rows)} rows")


if __name__ == "__main__":
    main()
