"""Short demo: runs flashgdn forward + backward on whatever device exists, prints the
time per call and the relative error against the float64 token-by-token reference.

    python bench/demo.py            # GPU if present, else the CPU backend
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import flashgdn
from flashgdn.reference import recurrent_gated_delta_rule_ref


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def timed(fn, device: str, reps: int) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lens", default=None, help="comma-separated sequence lengths")
    ap.add_argument("--heads", default="2,8", help="H_qk,H_v")
    args = ap.parse_args()
    dev = args.device
    lens = [int(x) for x in (args.lens or ("4096,2048,1000,63" if dev == "cuda" else "300,65")).split(",")]
    hqk, hv = (int(x) for x in args.heads.split(","))
    T, N = sum(lens), len(lens)
    torch.manual_seed(0)
    q = torch.randn(1, T, hqk, 128, device=dev).bfloat16()
    k = F.normalize(torch.randn(1, T, hqk, 128, device=dev), dim=-1).bfloat16()
    v = torch.randn(1, T, hv, 128, device=dev).bfloat16()
    g = F.logsigmoid(torch.randn(1, T, hv, device=dev)) / 16
    g[..., ::4] = 0.0
    beta = torch.sigmoid(torch.randn(1, T, hv, device=dev))
    h0 = torch.randn(N, hv, 128, 128, device=dev) * 0.1
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu)

    print(f"flashgdn {flashgdn.__version__} on {dev}"
          + (f" ({torch.cuda.get_device_name()})" if dev == "cuda" else "")
          + f": lengths {lens}, heads {hqk}/{hv}")
    o, ht = flashgdn.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    ro, rh = recurrent_gated_delta_rule_ref(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
    print(f"forward  rel err vs float64 reference: o {rel(o, ro):.2e}  final state {rel(ht, rh):.2e}")

    reps = 20 if dev == "cuda" else 2
    t_fwd = timed(lambda: flashgdn.chunk_gated_delta_rule(q, k, v, g, beta, **kw), dev, reps)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]

    def fwd_bwd():
        o_, ht_ = flashgdn.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5],
                                                  output_final_state=True, cu_seqlens=cu)
        return torch.autograd.grad(o_.float().sum() + ht_.sum(), leaves)

    t_fb = timed(fwd_bwd, dev, reps)
    print(f"time per call: forward {t_fwd:.3f} ms, forward+backward {t_fb:.3f} ms")


if __name__ == "__main__":
    main()
