"""Side-by-side timing of flashgdn and FLA 0.5 on a few rows of the Qwen3.5 head-config table.

Inputs as FlashQLA's benchmark draws them (l2-normalised q, k; g = logsigmoid(randn)/16 with
every 4th value head at g = 0; beta = sigmoid(randn); fp32 initial state; final state out).
Each call is captured in a CUDA graph and replayed; the median of the replays is reported.

    python bench/compare_fla.py            # needs a GPU; FLA optional (pip install the wheels)
"""
from __future__ import annotations

import argparse
from typing import Callable, List, Tuple

import torch
import torch.nn.functional as F

import flashgdn

try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn
except Exception as exc:  # noqa: BLE001 - report any import failure
    fla_gdn = None
    FLA_ERROR = f"{type(exc).__name__}: {exc}"


def graph_median_ms(fn: Callable[[], object], reps: int) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def inputs(hqk: int, hv: int, lens: List[int]):
    T = sum(lens)
    r = lambda *s: torch.randn(*s, device="cuda")  # noqa: E731
    q = F.normalize(r(1, T, hqk, 128), dim=-1).bfloat16()
    k = F.normalize(r(1, T, hqk, 128), dim=-1).bfloat16()
    v = r(1, T, hv, 128).bfloat16()
    g = F.logsigmoid(r(1, T, hv)) / 16
    g[..., ::4] = 0.0
    beta = torch.sigmoid(r(1, T, hv))
    h0 = r(len(lens), hv, 128, 128) * 0.1
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device="cuda")
    return q, k, v, g, beta, h0, cu


def row(mode: str, hqk: int, hv: int, lens: List[int], reps: int) -> Tuple[float, float, str]:
    q, k, v, g, beta, h0, cu = inputs(hqk, hv, lens)
    cu32, cu_cpu = cu.int(), cu.cpu()
    impls = {"flashgdn": (flashgdn.chunk_gated_delta_rule, dict(cu_seqlens=cu32))}
    if fla_gdn is not None:
        impls["fla"] = (fla_gdn, dict(cu_seqlens=cu, cu_seqlens_cpu=cu_cpu))
    out = {}
    note = ""
    for name, (fn, kw) in impls.items():
        if mode == "fwd":
            call = lambda: fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)  # noqa: E731
        else:
            leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
            do = torch.randn_like(v)

            def call(fn=fn, kw=kw, leaves=leaves, do=do):
                o, ht = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, **kw)
                return torch.autograd.grad([o, ht], leaves, [do, torch.ones_like(ht)])
        try:
            out[name] = graph_median_ms(call, reps)
        except Exception as exc:  # noqa: BLE001 - a peer failing is a result, not a crash
            out[name] = float("nan")
            note += f"{name}: {type(exc).__name__}: {str(exc)[:120]} "
    return out["flashgdn"], out.get("fla", float("nan")), note


ROWS = [("fwd", 2, 8, [32768]), ("fwd", 4, 16, [16384]), ("fwd", 16, 32, [8192] * 4),
        ("fwd", 16, 64, [32768]), ("fwd", 32, 32, [28672, 4096]),
        ("fwd+bwd", 2, 4, [8192]), ("fwd+bwd", 16, 32, [8192]), ("fwd+bwd", 8, 16, [4096] * 8)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rows", default=None, help="comma-separated row indices (default: all)")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, flashgdn "
          f"{flashgdn.__version__}, FLA {'ok' if fla_gdn else FLA_ERROR}")
    print("| mode | h_qk/h_v | sequences | flashgdn ms | FLA ms | FLA / flashgdn | note |")
    print("|---|---|---|---|---|---|---|")
    picked = ROWS if args.rows is None else [ROWS[int(i)] for i in args.rows.split(",")]
    for mode, hqk, hv, lens in picked:
        ours, fla, note = row(mode, hqk, hv, lens, args.reps)
        seqs = "+".join(str(n) for n in lens) if len(set(lens)) > 1 else f"{lens[0]}x{len(lens)}"
        print(f"| {mode} | {hqk}/{hv} | {seqs} | {ours:.3f} | {fla:.3f} | {fla / ours:.2f} | {note} |",
              flush=True)


if __name__ == "__main__":
    main()
