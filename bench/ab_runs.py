"""Alternated A/B runs of bench_gdn.py: settings or whole builds side by side on one machine.

Each variant is a name, optionally a wheel to install before its runs, and environment
settings for its runs. The variants run one after the other, round after round (the order
alternates the machine's drift over all of them), each as one `bench_gdn.py --peers flashgdn
--no-check` process; a row's figure is its best (lowest) median over the rounds. The table
gives every variant's ms per row and its ratio to the first variant, the geometric mean of
each ratio (bwd mode: also for the backward alone, fwd+bwd minus the forward of the same
run, as a variant's switch may change the forward too), and `--json` writes {"mode", "variants", "rows": {row: {variant: [ms, fwd_ms]}}}.

Comparing a build against the previous one on the same machine is what an environment
switch inside one build cannot do: the switch's code is there, and costs, even when off
(docs/perf-notes.md version 59: a switch whose code cost the forward 5-8% when off).

    # session 59's final check: session 58's wheel, this one, this one with a switch off
    python bench/ab_runs.py --mode bwd --rounds 2 \\
        --variant old:wheel=.wb_old --variant new:wheel=.wheelbuild \\
        --variant off:wheel=.wheelbuild,FLASHGDN_BWD_EXACT_REACH=0 --json out/ab.json
    # a switch only (the installed build)
    python bench/ab_runs.py --mode fwd --models 16/32 --seqs 1x8192,1x32768 \\
        --variant default --variant seg0:FLASHGDN_REACH_SEG=0

A wheel is a .whl file or a folder holding one; it is installed with `pip install
--no-deps --no-index --force-reinstall` only when the variant before it used another.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from bench_gdn import geomean

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_gdn.py")


@dataclass
class Variant:
    name: str
    wheel: Optional[str] = None
    env: Dict[str, str] = field(default_factory=dict)


def parse_variant(spec: str) -> Variant:
    """NAME[:ITEM,ITEM,...] with ITEM either wheel=PATH or KEY=VALUE (an environment
    setting for the variant's runs; KEY= with nothing after it unsets KEY)."""
    name, _, rest = spec.partition(":")
    if not name or any(c in name for c in "=,/ "):
        raise ValueError(f"--variant {spec!r}: expected NAME[:wheel=PATH,KEY=VALUE,...]")
    v = Variant(name)
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--variant {spec!r}: {item!r} is not KEY=VALUE")
        if key == "wheel":
            v.wheel = value
        else:
            v.env[key] = value
    return v


def wheel_file(path: str) -> str:
    """The .whl a variant names: the file itself or the only wheel in the folder."""
    if path.endswith(".whl"):
        return path
    found = sorted(glob.glob(os.path.join(path, "*.whl")))
    if len(found) != 1:
        raise ValueError(f"wheel={path!r}: expected one .whl there, found {len(found)}")
    return found[0]


Rows = Dict[str, Dict[str, List[float]]]  # row -> variant -> [ms, fwd_ms]


def best_of_rounds(runs: Sequence[Tuple[str, dict]]) -> Rows:
    """(variant, bench_gdn JSON) pairs, any number of rounds each, to each row's best
    flashgdn figure per variant (the lowest ms, with the forward time of that run)."""
    out: Rows = {}
    for name, data in runs:
        for row in data.get("rows", []):
            res = row.get("results", {}).get("flashgdn", {})
            ms = res.get("ms")
            if ms is None or not math.isfinite(ms):
                continue
            key = f'{row["h_qk"]}/{row["h_v"]} {row["seq_label"]}'
            fwd = res.get("fwd_ms")
            fwd = fwd if fwd is not None and math.isfinite(fwd) else float("nan")
            have = out.setdefault(key, {}).get(name)
            if have is None or ms < have[0]:
                out[key][name] = [ms, fwd]
    return out


def backward_alone(rows: Rows) -> Rows:
    """bwd rows' backward alone: fwd+bwd minus the forward of the same run (the [ms, fwd_ms]
    pairs as [ms - fwd_ms, fwd_ms]); a run without a finite forward time is left out."""
    out: Rows = {}
    for key, d in rows.items():
        for n, (ms, fwd) in d.items():
            if math.isfinite(fwd):
                out.setdefault(key, {})[n] = [ms - fwd, fwd]
    return out


def summary(rows: Rows, names: Sequence[str]) -> List[str]:
    """The table: each row's ms per variant and the ratios to the first; then the geometric
    mean, least and greatest of each ratio over the rows both ran."""
    base = names[0]
    lines = ["%-24s " % "row" + " ".join("%10s" % n for n in names) +
             "".join("  %s/%s" % (n, base) for n in names[1:])]
    for key, d in rows.items():
        cells = " ".join("%10.4f" % d[n][0] if n in d else "%10s" % "-" for n in names)
        ratios = "".join("  %*.3f" % (len(n) + len(base) + 1, d[n][0] / d[base][0])
                         if n in d and base in d else "  %*s" % (len(n) + len(base) + 1, "-")
                         for n in names[1:])
        lines.append("%-24s %s%s" % (key, cells, ratios))
    for n in names[1:]:
        rs = [d[n][0] / d[base][0] for d in rows.values() if n in d and base in d]
        if rs:
            lines.append(f"{n} / {base}: geometric mean {geomean(rs):.4f} over {len(rs)} rows, "
                         f"{min(rs):.3f} .. {max(rs):.3f}")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", action="append", required=True, type=parse_variant,
                    help="NAME[:wheel=PATH,KEY=VALUE,...]; the first is the baseline")
    ap.add_argument("--mode", choices=["fwd", "bwd"], default="fwd")
    ap.add_argument("--models", default=None, help="as bench_gdn.py --models")
    ap.add_argument("--seqs", default=None, help="as bench_gdn.py --seqs")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=300, help="seconds a bench_gdn.py run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    names = [v.name for v in args.variant]
    if len(set(names)) != len(names):
        ap.error("--variant: every variant needs its own name")
    installed: Optional[str] = None
    runs: List[Tuple[str, dict]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(1, args.rounds + 1):
            for v in args.variant:
                if v.wheel is not None and wheel_file(v.wheel) != installed:
                    installed = wheel_file(v.wheel)
                    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                                    "--no-index", "--force-reinstall", installed], check=True)
                env = dict(os.environ)
                for k, val in v.env.items():
                    if val:
                        env[k] = val
                    else:
                        env.pop(k, None)
                out = os.path.join(tmp, f"{v.name}_{rnd}.json")
                cmd = [sys.executable, BENCH, "--mode", args.mode, "--peers", "flashgdn",
                       "--no-check", "--reps", str(args.reps), "--json", out]
                if args.models:
                    cmd += ["--models", args.models]
                if args.seqs:
                    cmd += ["--seqs", args.seqs]
                try:
                    rc = subprocess.run(cmd, env=env, timeout=args.timeout,
                                        stdout=subprocess.DEVNULL).returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
                print(f"round {rnd} {v.name}: rc {rc}", flush=True)
                if os.path.exists(out):
                    with open(out) as f:
                        runs.append((v.name, json.load(f)))
    rows = best_of_rounds(runs)
    print("\n".join(summary(rows, names)))
    if args.mode == "bwd":  # a variant's switch may change the forward too: the backward alone
        print("\nbackward alone (fwd+bwd minus the forward of the same run):")
        print("\n".join(summary(backward_alone(rows), names)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": args.mode, "rounds": args.rounds,
                       "variants": [vars(v) for v in args.variant], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
