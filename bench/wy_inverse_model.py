"""A CPU model of wy_inverse (csrc/cuda/state_fwd_tma.cuh, FLASHGDN_COLS_TMA=4): T diag(beta)
of a chunk by the doubling in 64 x 64 form, step for step as the kernel forms it, against the
float64 inverse. No GPU needed.

The kernel splits A = diag(beta) (Dec . K K^T) (strictly lower) into its diagonal 16 x 16
blocks (fp32), A1 = blocks (1,0), (3,2) and A2 = the lower left 32 x 32 (fp16 tiles); inverts
the diagonal blocks by fp32 substitution (a column a thread); then, with D the block diagonal
of the inverses so far in fp16, (I + A_diag + A_off)^-1 = D - D A_off D twice (A1: blocks of
16 -> 32, A2: 32 -> 64), X = D A_off rounded to fp16 (the next product's register operand),
Z = X D in fp32; T diag(beta) from the fp32 values (substitution, -Z). This script checks
that algebra (block split, signs, which blocks each product fills) and the size of its
rounding error, so that a wrong block or sign shows here before it shows on the device.

    python bench/wy_inverse_model.py            # a few random chunks, prints the errors
"""
from __future__ import annotations

import argparse

import numpy as np

C = 64


def fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def chunk_a(rng: np.random.Generator, decay: float, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """A = diag(beta) (Dec . K K^T) strictly below the diagonal (l2-normalised k rows), beta;
    rows past `rows` have beta 0 (a chunk's end)."""
    k = rng.standard_normal((C, 128))
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    g = -np.abs(rng.standard_normal(C)) * decay
    beta = rng.uniform(0.0, 1.0, C)
    beta[rows:] = 0.0
    G = np.cumsum(g)
    dec = np.exp(G[:, None] - G[None, :]) * np.tril(np.ones((C, C)), -1)
    return (beta[:, None] * dec * (k @ k.T)).astype(np.float32), beta.astype(np.float32)


def wy_inverse_model(A: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """T diag(beta) (fp16) as the kernel forms it."""
    A1 = np.zeros((C, C), np.float32)
    A2 = np.zeros((C, C), np.float32)
    adg = np.zeros((4, 16, 16), np.float32)
    for rb in range(4):
        for jp in range(rb + 1):
            blk = A[16 * rb:16 * rb + 16, 16 * jp:16 * jp + 16]
            if jp == rb:
                adg[rb] = blk
            elif rb % 2 == 1 and jp == rb - 1:
                A1[16 * rb:16 * rb + 16, 16 * jp:16 * jp + 16] = fp16(blk)
            else:
                A2[16 * rb:16 * rb + 16, 16 * jp:16 * jp + 16] = fp16(blk)
    tdg = np.zeros((4, 16, 16), np.float32)
    for b in range(4):  # fp32 forward substitution, a column at a time
        for jj in range(16):
            tc = np.zeros(16, np.float32)
            for r in range(16):
                acc = np.float32(1.0 if r == jj else 0.0)
                for s in range(r):
                    acc = np.float32(acc - adg[b][r, s] * tc[s])
                tc[r] = acc
            tdg[b][:, jj] = tc
    D = np.zeros((C, C), np.float32)
    for b in range(4):
        D[16 * b:16 * b + 16, 16 * b:16 * b + 16] = fp16(tdg[b])
    z1 = fp16(D @ A1) @ D
    only1 = np.zeros((C, C), bool)
    only1[16:32, 0:16] = only1[48:64, 32:48] = True
    assert not np.any(z1[~only1]), "step 1 fills blocks other than (1,0), (3,2)"
    D[only1] = fp16(-z1[only1])
    z2 = fp16(D @ A2) @ D
    only2 = np.zeros((C, C), bool)
    only2[32:, :32] = True
    assert not np.any(z2[~only2]), "step 2 fills blocks other than the lower left 32 x 32"
    T = np.zeros((C, C), np.float32)
    for b in range(4):
        T[16 * b:16 * b + 16, 16 * b:16 * b + 16] = tdg[b]
    T[only1] = -z1[only1]
    T[only2] = -z2[only2]
    return fp16(T * beta[None, :])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=6)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    worst = 0.0
    for i in range(a.chunks):
        A, beta = chunk_a(rng, decay=1.0 if i % 2 == 0 else 0.05, rows=C if i % 3 else 40)
        tv = wy_inverse_model(A, beta)
        ref = np.linalg.inv(np.eye(C) + A.astype(np.float64)) * beta[None, :].astype(np.float64)
        err = float(np.abs(tv - ref).max() / np.abs(ref).max())
        worst = max(worst, err)
        print(f"chunk {i}: T diag(beta) max error / max |entry| {err:.2e}")
    print(f"worst {worst:.2e} (fp16's half ulp: 4.9e-4)")


if __name__ == "__main__":
    main()
