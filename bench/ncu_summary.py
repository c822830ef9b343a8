"""One flashgdn forward call on a benchmark row under Nsight Compute, summarised per kernel.

Runs `ncu` on a child process that makes one eager forward call (inputs as bench_gdn.py
draws them, after two warm-up calls outside the profiled range) and prints, for each kernel
whose name matches `--kernels`, its duration, DRAM / L2 traffic, instruction count, issue
and occupancy figures, tensor-pipe instructions and the warp stall reasons, largest first.
ncu locks the clocks and serialises the kernels (no overlap between streams or programmatic
dependents), so durations are longer than the CUDA-graph timings of bench_gdn.py; compare
kernels with each other, not with those timings.

    python bench/ncu_summary.py --model 4/16 --seqs 1x32768 --kernels "wy_batched|seg_scan"
    python bench/ncu_summary.py --csv saved.csv        # summarise a saved ncu CSV again

docs/perf-notes.md version 32 quotes its figures for wy_batched_kernel, the 128-column pass
and seg_scan_kernel.
"""
from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
from collections import OrderedDict
from typing import Dict, List, Tuple

STALLS = ("barrier", "branch_resolving", "dispatch_stall", "drain", "imc_miss", "lg_throttle",
          "long_scoreboard", "math_pipe_throttle", "membar", "mio_throttle", "misc",
          "no_instruction", "not_selected", "selected", "short_scoreboard", "sleeping",
          "tex_throttle", "wait")
STALL_PREFIX = "smsp__average_warp_latency_issue_stalled_"
METRICS = [
    "gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed", "lts__t_bytes.sum",
    "sm__inst_executed.sum", "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "smsp__inst_executed_pipe_tensor.sum", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",
] + [f"{STALL_PREFIX}{s}.ratio" for s in STALLS]

CHILD = """
import sys, torch, flashgdn
sys.path.insert(0, {bench!r})
import bench_gdn as bg
row = bg.build_rows("fwd", [{model!r}], [{seqs!r}], seed=0)[0]
x = bg.make_inputs(row, seed=0)
def call():
    return flashgdn.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
        initial_state=x["h0"], output_final_state=True, cu_seqlens=x["cu32"],
        cu_seqlens_cpu=x["cu_cpu"])
for _ in range(2):
    call()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
call()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
"""


def parse(lines: List[str]) -> "OrderedDict[Tuple[str, str], Dict[str, Tuple[str, str]]]":
    """ncu --csv rows (one metric a row) -> {(launch id, kernel): {metric: (value, unit)}}."""
    rows = csv.DictReader(line for line in lines if line.startswith('"'))
    out: "OrderedDict[Tuple[str, str], Dict[str, Tuple[str, str]]]" = OrderedDict()
    for r in rows:
        key = (r["ID"], r["Kernel Name"].split("(")[0].replace("void ", ""))
        out.setdefault(key, {})[r["Metric Name"]] = (r["Metric Value"], r["Metric Unit"])
    return out


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return float("nan")


def report(kernels: "OrderedDict[Tuple[str, str], Dict[str, Tuple[str, str]]]") -> None:
    for (launch, name), m in kernels.items():
        def get(metric: str) -> float:
            return number(m.get(metric, ("nan", ""))[0])
        print(f"== launch {launch}: {name}")
        print(f"   time {get('gpu__time_duration.sum') / 1e3:.1f} us, "
              f"DRAM read {get('dram__bytes_read.sum') / 1e6:.1f} MB, "
              f"write {get('dram__bytes_write.sum') / 1e6:.1f} MB "
              f"({get('dram__throughput.avg.pct_of_peak_sustained_elapsed'):.0f}% of peak), "
              f"L2 {get('lts__t_bytes.sum') / 1e6:.1f} MB")
        print(f"   {get('sm__inst_executed.sum') / 1e6:.2f} M warp instructions, issue active "
              f"{get('smsp__issue_active.avg.pct_of_peak_sustained_active'):.0f}%, warps active "
              f"{get('sm__warps_active.avg.pct_of_peak_sustained_active'):.0f}%, tensor "
              f"{get('smsp__inst_executed_pipe_tensor.sum') / 1e6:.2f} M, shared bank conflicts "
              f"{get('l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum') / 1e6:.2f} M")
        stalls = sorted(((get(f"{STALL_PREFIX}{s}.ratio"), s) for s in STALLS), reverse=True)
        print("   stalls (cycles a warp instruction): " +
              ", ".join(f"{s} {v:.0f}" for v, s in stalls[:8] if v == v and v > 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="4/16", help="h_qk/h_v, e.g. 2/8")
    ap.add_argument("--seqs", default="1x32768", help="a bench_gdn.py sequence label")
    ap.add_argument("--kernels", default="wy_batched|seg_scan|state_fwd_cols",
                    help="regular expression on kernel names")
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("--save", default=None, help="also write ncu's CSV here")
    ap.add_argument("--csv", default=None, help="summarise this saved CSV instead of running")
    args = ap.parse_args()
    if args.csv:
        with open(args.csv) as f:
            report(parse(f.read().splitlines()))
        return
    child = CHILD.format(bench=os.path.dirname(os.path.abspath(__file__)), model=args.model,
                         seqs=args.seqs)
    cmd = [args.ncu, "--profile-from-start", "off", "-k", f"regex:{args.kernels}",
           "--metrics", ",".join(METRICS), "--csv", sys.executable, "-c", child]
    ran = subprocess.run(cmd, capture_output=True, text=True)
    if ran.returncode != 0:
        sys.exit(f"ncu failed ({ran.returncode}):\n{ran.stderr[-2000:]}")
    if args.save:
        with open(args.save, "w") as f:
            f.write(ran.stdout)
    report(parse(ran.stdout.splitlines()))


if __name__ == "__main__":
    main()
