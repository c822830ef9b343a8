#!/usr/bin/env python3
"""Run-to-run reproducibility of flashgdn's forward under opt-in switches.

For one head config and one packed sequence, runs the forward with the default kernels
once, then for each setting (FLASHGDN_<KEY>=<value> pairs joined by '+', settings by ',')
its first eager call and `--reps` more eager calls and CUDA-graph replays, and counts those
whose o or final state differ in any bit from the setting's first call; also the largest
relative difference (Frobenius) from the default kernels' outputs, and with --where the
chunks, heads and rows of the first two differing runs.
Inputs: q, k l2-normalised randn, v randn (bf16), g = logsigmoid(randn) / --gdiv,
beta = sigmoid(rand), one sequence of T tokens (cu_seqlens unless --fixed).

    python bench/repeat_check.py --model 32/32 --tokens 32768 --settings COLS_TMA=1,COLS_TMA=3
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, Tuple

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gdn import rel_err as rel  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="32/32", help="h_qk/h_v")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--gdiv", type=float, default=8.0, help="g = logsigmoid(randn) / gdiv")
    ap.add_argument("--settings", default="COLS_TMA=1")
    ap.add_argument("--fixed", action="store_true", help="no cu_seqlens (B = 1, fixed length)")
    ap.add_argument("--where", action="store_true", help="print where the first differences lie")
    ap.add_argument("--dirty", action="store_true",
                    help="before each call, fill and free a NaN block of o's size (rows the "
                         "call leaves unwritten then show as NaN)")
    a = ap.parse_args()
    import flashgdn

    hq, hv = (int(x) for x in a.model.split("/"))
    T, dev = a.tokens, "cuda"
    torch.manual_seed(0)
    q = F.normalize(torch.randn(1, T, hq, 128, device=dev), dim=-1).bfloat16()
    k = F.normalize(torch.randn(1, T, hq, 128, device=dev), dim=-1).bfloat16()
    v = torch.randn(1, T, hv, 128, device=dev).bfloat16()
    g = F.logsigmoid(torch.randn(1, T, hv, device=dev)) / a.gdiv
    beta = torch.rand(1, T, hv, device=dev).sigmoid()
    args = dict(q=q, k=k, v=v, g=g, beta=beta, output_final_state=True)
    if not a.fixed:
        args["cu_seqlens"] = torch.tensor([0, T], device=dev, dtype=torch.int32)

    def call() -> Tuple[torch.Tensor, torch.Tensor]:
        if a.dirty:
            junk = torch.full_like(v, float("nan"))
            del junk
        return flashgdn.chunk_gated_delta_rule(**args)

    def where(o0: torch.Tensor, o1: torch.Tensor) -> str:
        d = (o0.float() - o1.float()).abs().amax(dim=-1)[0]  # [T, H_v]
        idx = (d > 0).nonzero()
        chunks = sorted(set((idx[:, 0] // 64).tolist()))
        rows = sorted(set((idx[:, 0] % 64).tolist()))
        heads = sorted(set(idx[:, 1].tolist()))
        return f"    chunks {chunks[:24]} heads {heads[:24]} rows {rows[:64]} max {d.max().item():.3g}"

    o_ref, h_ref = call()
    torch.cuda.synchronize()
    for s in a.settings.split(","):
        env: Dict[str, str] = dict(kv.split("=") for kv in s.split("+") if kv)
        for key, val in env.items():
            os.environ["FLASHGDN_" + key] = val
        try:
            o0, h0 = call()
            torch.cuda.synchronize()
            bad, gbad, worst, shown = 0, 0, 0.0, 0
            for _ in range(a.reps):
                o1, h1 = call()
                if not (torch.equal(o0, o1) and torch.equal(h0, h1)):
                    bad += 1
                    if a.where and shown < 2:
                        print(where(o0, o1))
                        shown += 1
                worst = max(worst, rel(o1, o_ref), rel(h1, h_ref))
                if a.dirty and not bool(torch.isfinite(o1).all()):
                    bad_rows = (~torch.isfinite(o1.float())).any(dim=-1)[0].nonzero()  # [T, H_v]
                    print(f"    not finite in o: chunks "
                          f"{sorted(set((bad_rows[:, 0] // 64).tolist()))[:24]} heads "
                          f"{sorted(set(bad_rows[:, 1].tolist()))[:24]} rows "
                          f"{sorted(set((bad_rows[:, 0] % 64).tolist()))[:64]}")
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                call()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                og, hg = call()
            for _ in range(a.reps):
                graph.replay()
                torch.cuda.synchronize()
                if not (torch.equal(o0, og) and torch.equal(h0, hg)):
                    gbad += 1
                worst = max(worst, rel(og, o_ref), rel(hg, h_ref))
            print(f"{a.model} x {T} {s}: eager runs differing {bad}/{a.reps}, graph replays "
                  f"differing {gbad}/{a.reps}; first run vs default: o {rel(o0, o_ref):.2e} "
                  f"state {rel(h0, h_ref):.2e}; largest {worst:.2e}", flush=True)
        finally:
            for key in env:
                os.environ.pop("FLASHGDN_" + key, None)


if __name__ == "__main__":
    main()
