#!/usr/bin/env python3
"""End-to-end test of `kvbridge sim`: a small sweep whose figures must hold
properties that follow from the model, checked against the planner as
`kvbridge readers` reports it; its JSON, table and SVG; and its errors,
each naming the option.

Usage: sim_cli_test.py PATH_TO_KVBRIDGE
"""
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

KVB = sys.argv[1]
failures = []


def check(name, ok, detail=""):
    print(("ok   - " if ok else "FAIL - ") + name + ("" if ok else ": " + detail))
    if not ok:
        failures.append(name)


def run(*args):
    return subprocess.run([KVB, *args], capture_output=True, text=True, timeout=60)


def planner_sources(tmp, preset, prefill_tp, decode_tp):
    """Per decode rank, how many prefill ranks `kvbridge readers` says it reads."""
    paths = {}
    for side, tp in (("p", prefill_tp), ("d", decode_tp)):
        paths[side] = []
        for r in range(tp):
            path = os.path.join(tmp, f"{side}{tp}-{r}.json")
            out = run("layout", "--preset", preset, "--tp", str(tp), "--rank", str(r))
            assert out.returncode == 0, out.stderr
            open(path, "w").write(out.stdout)
            paths[side].append(path)
    out = run("readers", "--local", *paths["d"], "--remote", *paths["p"])
    assert out.returncode == 0, out.stderr
    return [len(x["source_ranks"]) for x in json.loads(out.stdout)["locals"]]


def sweep(tmp, preset, prefill_tp, decode_tp, ranks):
    svg = os.path.join(tmp, f"{preset}.svg")
    out = run("sim", "--preset", preset, "--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp),
              "--ranks", ranks, "--requests", "400", "--plan-samples", "5", "--store-nodes", "1,3,12",
              "--store-node-gib", "4", "--json", "--svg", svg)
    check(f"{preset} P{prefill_tp} D{decode_tp}: sim --json exits 0", out.returncode == 0, out.stderr)
    report = json.loads(out.stdout)
    check("the JSON names its format", report["format"] == "kvbridge.sim/1", str(report.get("format")))
    points = report["points"]
    want = planner_sources(tmp, preset, prefill_tp, decode_tp)
    check(f"{preset}: sources per decode rank are the planner's {want}", report["sources_of_rank"] == want,
          str(report["sources_of_rank"]))
    mean_sources = sum(want) / len(want)
    pinned = [p["handshakes_per_decode_rank_pinned"] for p in points]
    groups = [p["pinned_group"] for p in points]
    check(f"{preset}: pinned groups cover every prefill instance",
          all(g * p["decode_instances"] >= p["prefill_instances"] for g, p in zip(groups, points)), str(groups))
    check(f"{preset}: pinned handshakes per decode rank = the planner's sources x the group, at every size",
          all(abs(h - mean_sources * g) < 1e-9 for h, g in zip(pinned, groups)), f"{pinned} vs {mean_sources}")
    if len(set(groups)) == 1:
        check(f"{preset}: pinned handshakes per decode rank stay constant as instances grow", len(set(pinned)) == 1,
              str(pinned))
    for p in points:
        decode_ranks = p["decode_instances"] * decode_tp
        check(f"{preset} {p['ranks']} ranks: total pinned connections = decode ranks x sources",
              p["total_connections_pinned"] == round(decode_ranks * mean_sources * p["pinned_group"]), str(p))
        check(f"{preset} {p['ranks']} ranks: any-routing handshakes between pinned and their bound",
              p["handshakes_per_decode_rank_pinned"] - 1e-9 <= p["handshakes_per_decode_rank_any"]
              <= p["handshakes_per_decode_rank_any_bound"] + 1e-9, str(p))
        check(f"{preset} {p['ranks']} ranks: the connector today fetches every prefill rank",
              abs(p["handshakes_per_decode_rank_today_pinned"] - prefill_tp * p["pinned_group"]) < 1e-9, str(p))
        check(f"{preset} {p['ranks']} ranks: metadata bytes = handshakes x a Metadata frame or more",
              p["metadata_bytes_per_decode_rank_pinned"] >= p["handshakes_per_decode_rank_pinned"]
              * report["metadata_frame_bytes"] * 0.9, str(p))
        check(f"{preset} {p['ranks']} ranks: plan() was timed", 0 < p["plan_p50_us"] <= p["plan_p99_us"], str(p))
    totals = [p["total_connections_pinned"] / p["ranks"] for p in points]
    check(f"{preset}: total pinned connections grow linearly with ranks", max(totals) - min(totals) < 0.35 * max(totals),
          str(totals))
    if len(points) > 1:
        check(f"{preset}: any-routing handshakes grow with prefill instances",
              points[-1]["handshakes_per_decode_rank_any"] > points[0]["handshakes_per_decode_rank_any"],
              str([p["handshakes_per_decode_rank_any"] for p in points]))
    store = {s["nodes"]: s for s in report["store"]}
    check("store rows for 1, 3 and 12 masters", sorted(store) == [1, 3, 12], str(sorted(store)))
    for n, s in store.items():
        check(f"{n} masters: key slots spread keys (max/min under 1.2)",
              s["keys_min"] > 0 and s["keys_max"] / s["keys_min"] < 1.2, str(s))
        check(f"{n} masters: hit rate at most the reuse bound", 0 <= s["hit_rate"] <= report["reuse_upper_bound"] + 1e-9,
              str(s))
    check("mean ops per master fall as masters grow",
          store[12]["ops_per_s_mean"] < store[3]["ops_per_s_mean"] < store[1]["ops_per_s_mean"], str(store))
    root = ET.parse(svg).getroot()
    panels = root.findall("{http://www.w3.org/2000/svg}g")
    check("the SVG parses and has 6 panels", len(panels) == 6, str(len(panels)))
    return report


def main():
    with tempfile.TemporaryDirectory() as tmp:
        sweep(tmp, "llama3-70b", 8, 4, "16,32,64")
        # Decode TP above prefill TP: each decode rank reads one prefill rank.
        r = sweep(tmp, "llama3-8b", 2, 8, "20,40")
        check("llama3-8b P2 D8: one source per decode rank", r["sources_of_rank"] == [1] * 8, str(r["sources_of_rank"]))

        out = run("sim", "--prefill-instances", "3", "--decode-instances", "5", "--requests", "200",
                  "--plan-samples", "3", "--store-nodes", "3")
        check("one point from instance counts exits 0", out.returncode == 0, out.stderr)
        check("the table says the model and prints the point", "kvbridge sim: llama3-70b" in out.stdout
              and "\n    44 " in out.stdout, out.stdout[:600])
        check("the table says etcd is a model", "a model of the discovery scheme, not a measurement" in out.stdout,
              out.stdout[-800:])

        for args, option, code in ((["--decode-tp", "3"], "--decode-tp 3", 1),
                                   (["--ranks", "0"], "--ranks", 1),
                                   (["--ranks", "8"], "--ranks", 1),
                                   (["--reuse", "2"], "--reuse", 1),
                                   (["--store-nodes", "0"], "--store-nodes", 1),
                                   (["--prefill-instances", "2"], "--decode-instances", 1),
                                   (["--preset", "no-such-model"], "--preset", 1),
                                   (["--requests", "x"], "--requests", 2)):
            out = run("sim", *args)
            check(f"sim {' '.join(args)} exits {code} naming {option}",
                  out.returncode == code and option in out.stderr, f"exit {out.returncode}: {out.stderr[:300]}")
    if failures:
        sys.exit(f"{len(failures)} check(s) failed")


if __name__ == "__main__":
    main()
