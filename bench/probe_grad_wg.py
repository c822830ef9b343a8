"""Phase clocks of grad_chunk_wg_kernel (the per-chunk gradients on wgmma, FLASHGDN_GRAD_WG=1).

FLASHGDN_DEBUG bit 1 << 20 launches the kernel's timing-only instantiation: thread 0 of
blocks 0 and 64 records clock64() at each phase boundary of the first two value heads of
its second item (the kernel is persistent since session 62: that item's first operands were
copied under the first item's tail), and a one-thread kernel after it prints them (cycles
from that item's start):

    h0/h1: the head's scalar loads issued, h and dS landed (B1), dO / U / dVt landed and the
           h / dS row pass done (B2's wait), the U / dVt / dO row pass done, Y / Z / R with
           their epilogues (and the 64 x 64 products' issue) done, the 64 x 64 products done,
           their epilogue done, the dG / dbeta pass done
    end:   the last head's sums synced, the M tiles written (with the last head's dg / dbeta
           stores), the dq / dk products done, synced, and the item's end (the next item's
           copies issued)
    then:  the item's nanoseconds (globaltimer: the clock's rate) and the block's items' total

The timing-only instantiation spills more than the default one (ptxas: 192 bytes against
80 in session 62), so its phases run somewhat slower than the default kernel's.

    python bench/probe_grad_wg.py            # 16/32 x 32768 and 2/4 x 8192, bf16

Needs a GPU and the CUDA build; bf16 inputs, the 128-column backward passes
(FLASHGDN_BWD_COLS=1), the ready queue off. docs/benchmarks.md "Session 61" and "Session 62"
have its output.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

os.environ.update(FLASHGDN_GRAD_WG="1", FLASHGDN_BWD_COLS="1", FLASHGDN_BWD_QUEUE="0")
import flashgdn  # noqa: E402  (the switches are read per call; set before the first)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("probe_grad_wg.py needs a CUDA device")
    for hqk, hv, T in ((16, 32, 32768), (2, 4, 8192)):
        torch.manual_seed(0)
        dev = "cuda"
        q = F.normalize(torch.randn(1, T, hqk, 128, device=dev), dim=-1).bfloat16()
        k = F.normalize(torch.randn(1, T, hqk, 128, device=dev), dim=-1).bfloat16()
        v = torch.randn(1, T, hv, 128, device=dev).bfloat16()
        g = F.logsigmoid(torch.randn(1, T, hv, device=dev)) / 16
        beta = torch.rand(1, T, hv, device=dev).sigmoid()
        leaves = [x.requires_grad_() for x in (q, k, v, g, beta)]
        for it in range(3):  # two warm calls, then the probed one
            os.environ["FLASHGDN_DEBUG"] = "1048576" if it == 2 else "0"
            o, _ = flashgdn.chunk_gated_delta_rule(*leaves, output_final_state=False)
            o.float().sum().backward()
            torch.cuda.synchronize()
        print(f"^ {hqk}/{hv} x {T}", flush=True)
    os.environ["FLASHGDN_DEBUG"] = "0"


if __name__ == "__main__":
    main()
