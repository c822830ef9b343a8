"""Context parallelism on and off: the TP8 / TP4 rows of the forward table (issue 4).

For each row, in one process on one GPU, times flashgdn's forward with
FLASHGDN_CP=off (one segment per sequence) and =auto (the planner's split), plus any
`--sweep` settings (FLASHGDN_FWD_BW / FLASHGDN_CP_SEG), with `--passes tf32,wgmma` the
other state-pass kernels (FLASHGDN_FWD_PASS), with `--switches` opt-in kernels
(FLASHGDN_COLS_WGMMA, ...), and FLA's forward when it is
installed; prints a markdown table with the CP speedup and FLA / flashgdn, and the
relative difference of each CP setting's outputs from the unsplit pass. Inputs and
timing (CUDA graphs, median of replays) as bench/bench_gdn.py.

    python bench/bench_cp.py                                  # 2/8 and 4/16 rows
    python bench/bench_cp.py --sweep 16:64,32:64,32:128       # BW:SEG settings as well
    python bench/bench_cp.py --switches COLS_WGMMA=1   # opt-in kernels, CP auto
"""
from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gdn as bg  # noqa: E402

ROWS = ("1x32768", "1x16384", "28672+4096", "1x8192", "8192x4")
MODELS = ("2/8", "4/16")
ENV_KEYS = ("FLASHGDN_CP", "FLASHGDN_CP_SEG", "FLASHGDN_FWD_BW", "FLASHGDN_WGMMA",
            "FLASHGDN_FWD_PASS", "FLASHGDN_COLS_WGMMA", "FLASHGDN_BWD_COLS",
            "FLASHGDN_CP_OVERLAP", "FLASHGDN_CP_SUB", "FLASHGDN_CP_CORR", "FLASHGDN_DEBUG",
            "FLASHGDN_COLS_PING", "FLASHGDN_WY_BATCHED", "FLASHGDN_WY_HEADS", "FLASHGDN_CP_SAT",
            "FLASHGDN_CP_SCAN", "FLASHGDN_PDL", "FLASHGDN_COLS_STAGES",
            "FLASHGDN_STEP_US_BW128", "FLASHGDN_CP_WALK", "FLASHGDN_CP_P0_MERGE",
            "FLASHGDN_COMBINE_US", "FLASHGDN_CP_WALK_STAGES", "FLASHGDN_PLAN_ASIDE",
            "FLASHGDN_PLAN_LEAN", "FLASHGDN_HOST_CHOICE", "FLASHGDN_HOST_SCHEDULE",
            "FLASHGDN_UNFUSED_WY_US",
            "FLASHGDN_UNFUSED_WY_LONGEST", "FLASHGDN_P0_LIST", "FLASHGDN_HOST_EXACT_P0",
            "FLASHGDN_TRI16", "FLASHGDN_WY_OCC4",
            "FLASHGDN_COLS_OWG", "FLASHGDN_KQ_COPIES", "FLASHGDN_WY_LEAN",
            "FLASHGDN_FUSED", "FLASHGDN_HOST_COLS", "FLASHGDN_HOST_SEGS", "FLASHGDN_COLS_TMA",
            "FLASHGDN_TMA_WY_PHASES", "FLASHGDN_WY_LEAN_KONLY", "FLASHGDN_CP_SHORT_LONGEST",
            "FLASHGDN_CP_SHORT_MIN", "FLASHGDN_HOST_SPLIT", "FLASHGDN_FLAT_HEADS",
            "FLASHGDN_TMA_KCONV")


@contextmanager
def env(settings: Dict[str, str]) -> Iterator[None]:
    keys = set(ENV_KEYS) | set(settings)  # a switch missing from ENV_KEYS must not leak
    old = {k: os.environ.get(k) for k in keys}
    for k in keys:
        os.environ.pop(k, None)
    os.environ.update(settings)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def settings_list(sweep: Optional[str], passes: List[str],
                  switches: Optional[str] = None) -> List[Tuple[str, Dict[str, str]]]:
    out = [("CP off", {"FLASHGDN_CP": "off"}), ("CP auto", {"FLASHGDN_CP": "auto"})]
    for name in passes:
        out.append((f"CP auto {name}", {"FLASHGDN_CP": "auto", "FLASHGDN_FWD_PASS": name}))
    for item in (switches.split(",") if switches else []):
        # NAME=VAL[+NAME=VAL...], NAME without the FLASHGDN_ prefix
        pairs = [kv.split("=", 1) for kv in item.split("+")]
        env_set = {"FLASHGDN_CP": "auto", **{f"FLASHGDN_{k}": v for k, v in pairs}}
        unknown = [k for k in env_set if k not in ENV_KEYS]
        if unknown:
            raise SystemExit(f"--switches: unknown {unknown}; known: {list(ENV_KEYS)}")
        out.append((f"auto {item}", env_set))
    for item in (sweep.split(",") if sweep else []):
        bw, seg, *fwd_pass = item.split(":")
        name = f"BW{bw} seg{seg}" + (f" {fwd_pass[0]}" if fwd_pass else "")
        out.append((name, {"FLASHGDN_CP": "on", "FLASHGDN_FWD_BW": bw, "FLASHGDN_CP_SEG": seg,
                           **({"FLASHGDN_FWD_PASS": fwd_pass[0]} if fwd_pass else {})}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--seqs", default=",".join(ROWS))
    ap.add_argument("--sweep", default=None,
                    help="extra BW:SEG[:PASS] settings (BW 16, 32 or 128, PASS a FLASHGDN_FWD_PASS), e.g. 16:64,128:32,32:64:tf32")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--cu-seqlens-cpu", action="store_true",
                    help="pass the host copy of cu_seqlens to flashgdn and FLA (FLA's "
                         "cu_seqlens_cpu; flashgdn's planner then knows the longest sequence)")
    ap.add_argument("--wgmma", action="store_true",
                    help="also time the warpgroup (wgmma) state pass (= --passes wgmma)")
    ap.add_argument("--passes", default="",
                    help="other state passes to time with CP auto (FLASHGDN_FWD_PASS), "
                         "e.g. tf32,wgmma; the default columns use the default pass (f16)")
    ap.add_argument("--switches", default=None,
                    help="opt-in switches to time with CP auto, one column each, NAME=VAL "
                         "without the FLASHGDN_ prefix, + to combine, e.g. "
                         "COLS_WGMMA=1,FWD_BW=128+CP=off")
    ap.add_argument("--fp16", action="store_true",
                    help="q, k and v in fp16 (bench_gdn's bf16 inputs converted): the fp16 "
                         "instantiations of the passes")
    args = ap.parse_args()

    import torch
    import flashgdn

    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_fn
    except Exception as exc:  # noqa: BLE001 - FLA is optional here
        fla_fn = None
        print(f"FLA not available ({exc}): no FLA column")
    timer = bg.Timer(warmup=5, reps=args.reps, max_seconds=4.0)
    rows = bg.build_rows("fwd", args.models.split(","), args.seqs.split(","), seed=0)
    passes = [x for x in args.passes.split(",") if x]
    if args.wgmma and "wgmma" not in passes:
        passes.append("wgmma")
    settings = settings_list(args.sweep, passes, args.switches)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, flashgdn "
          f"{flashgdn.__version__}{', fp16 inputs' if args.fp16 else ''}")
    head = ["h_qk/h_v", "sequences"] + [f"{n} ms" for n, _ in settings] + \
        ["CP speedup"] + (["FLA ms", "FLA / flashgdn (auto)"] if fla_fn else []) + \
        ["max rel diff vs off"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        x = bg.make_inputs(row, seed=0)
        if args.fp16:
            x.update({key: x[key].half() for key in ("q", "k", "v")})
        host = {"cu_seqlens_cpu": x["cu_cpu"]} if args.cu_seqlens_cpu else {}

        def ours() -> Tuple[torch.Tensor, torch.Tensor]:
            return flashgdn.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                   initial_state=x["h0"], output_final_state=True,
                                                   cu_seqlens=x["cu32"], **host)

        times, outs = [], []
        for _, s in settings:
            with env(s):
                outs.append(ours())
                times.append(timer.time(ours)[0])
        diffs = [max(bg.rel_err(o, outs[0][0]), bg.rel_err(h, outs[0][1])) for o, h in outs[1:]]
        cells = [row.model.key, row.seq_label] + [f"{t:.3f}" for t in times] + \
            [f"{times[0] / times[1]:.2f}x"]
        if fla_fn:
            def fla() -> object:
                return fla_fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                              output_final_state=True, cu_seqlens=x["cu64"], **host)
            t_fla = timer.time(fla)[0]
            cells += [f"{t_fla:.3f}", f"{t_fla / times[1]:.2f}"]
        cells.append(" ".join(f"{d:.1e}" for d in diffs))
        print("| " + " | ".join(cells) + " |", flush=True)
        del x, outs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
