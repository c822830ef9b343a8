#!/usr/bin/env python3
"""Gated DeltaNet benchmark: the public Qwen3.5 head-config table, flashgdn next to its peers.

Rows (FlashQLA's published H200 table, d = 128):
  forward:  h_qk/h_v in 2/8, 4/16, 8/32, 16/64, 16/32, 8/24, 16/48, 16/16, 32/32, each with the
            19 sequence mixes 1x32768 ... 1024x8 (packed varlen, one cu_seqlens, B = 1);
            named with --seqs only: packed training batches 2048x64 and 512x1024;
  backward: h_qk/h_v in 16/32, 8/16, 4/8, 2/4; 8192 and 32768 tokens split into 1, 2, 4, 8
            random sequences (fixed seed, every sequence >= 64 tokens; lengths are printed).

Inputs (as FlashQLA's benchmark draws them): q, k = l2-normalised randn (bf16); v = randn (bf16);
g = logsigmoid(randn) / 16 (fp32) with every 4th value head at g = 0 (25 %); beta = sigmoid(randn)
(fp32); initial state randn * 0.1 (fp32, [N, H_v, 128, 128]); output_final_state=True. Backward
rows use dO = randn (bf16) and dS_T = randn / 8 (fp32).

Timing: each call is run eagerly 3 times on a side stream (JIT, autotuning, host caches), then
captured once in a CUDA graph; the graph is replayed for warm-up and then timed replay by replay
with CUDA events; the median is reported. No L2 flush between replays. A peer whose call cannot
be captured is timed eagerly instead (per-call events, marked "eager" in the outputs).
Backward rows time forward + backward in one graph (the forward call, then
torch.autograd.grad of (o, final_state) with respect to q, k, v, g, beta, h0) and also the
forward alone on the same inputs; backward alone is roughly the difference.

Peers (each optional; an import or call failure is recorded with its reason, never fatal):
  flashgdn   flashgdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
             output_final_state=True, cu_seqlens=int32 [N+1], cu_seqlens_cpu) (the host
             copy, as FLA gets it; since 2026-11-23 session 17, after its figures)
  fla        fla.ops.gated_delta_rule.chunk_gated_delta_rule, same layout, cu_seqlens int64 on
             the GPU plus cu_seqlens_cpu (no host sync inside the graph)
  flashinfer flashinfer.gdn_prefill.chunk_gated_delta_rule: q/k/v [T, H, 128] (batch dim
             dropped), g as the linear gate alpha = exp(g), beta [T, H_v], state [N, H_v, V, K]
             (transposed in and out), cu_seqlens int64; forward only
  flashqla   flash_qla.chunk_gated_delta_rule, FLA's layout, cu_seqlens int64
Layout conversions happen before timing; outputs are converted back only for the error check.

Arithmetic floor per row: floor = max(FLOPs / R, bytes / B), where R is the bf16 rate of
torch.matmul on 8192^3 random bf16 matrices and B the device-to-device copy bandwidth of a
1 GiB copy (bytes read + written), both measured in the same run. FLOPs count the chunked
algorithm (chunks of c = 64 tokens, the last chunk of a sequence may be shorter; d = 128;
a GEMM m x n x k is 2mnk; elementwise work is not counted). Work that depends only on q and k
is counted once per q/k head, everything else once per value head (see FWD_TERMS and
BWD_TERMS below; `--dry-run` prints the per-row totals). Bytes are the minimum: every input
read once, every output written once (backward rows: forward inputs and outputs, plus the
backward's inputs dO, dS_T and outputs dq, dk, dv, dg, dbeta, dh0). Ratios are peer time /
flashgdn time (> 1: flashgdn faster); geometric means are per model config over the rows where
both ran. The markdown also checks each row against FlashQLA's published H200 table
(bench/published_h200.tsv): issue 4's test (FLA / flashgdn here at least FlashQLA's published
FLA / FlashQLA) and issue 5's target (1.25x the best published peer; backward rows: 1.25x
faster than FlashQLA's published backward, absolute H200 times).

    python bench/bench_gdn.py --mode fwd --models 2/8,4/16 --json out/fwd.json
    python bench/bench_gdn.py --dry-run                       # rows, FLOPs, bytes; no GPU
    python bench/bench_gdn.py --merge out/a.json out/b.json --md out/table.md --png out/t.png
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata as _md
import inspect
import json
import math
import os
import random
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # --help, --dry-run and --merge work without torch
    torch = None  # type: ignore[assignment]
    F = None  # type: ignore[assignment]

D = 128  # head dim (K = V = 128)
CHUNK = 64
PEERS: Tuple[str, ...] = ("flashgdn", "fla", "flashinfer", "flashqla")
TITLES: Dict[str, str] = {"flashgdn": "flashgdn", "fla": "FLA", "flashinfer": "FlashInfer",
                          "flashqla": "FlashQLA"}
NAN = float("nan")

# ------------------------------------------------------------------------------------ rows


@dataclass(frozen=True)
class Model:
    label: str
    h_qk: int
    h_v: int

    @property
    def key(self) -> str:
        return f"{self.h_qk}/{self.h_v}"


FWD_MODELS: Tuple[Model, ...] = (
    Model("397B/122B TP8", 2, 8), Model("397B/122B TP4", 4, 16), Model("397B/122B TP2", 8, 32),
    Model("397B/122B TP1", 16, 64), Model("35B/9B/4B TP1", 16, 32), Model("27B TP2", 8, 24),
    Model("27B TP1", 16, 48), Model("2B/0.8B TP1", 16, 16), Model("Sym h32", 32, 32),
)
FWD_SEQS: Tuple[Tuple[str, Tuple[int, ...]], ...] = (
    ("1x32768", (32768,)), ("1x16384", (16384,)), ("1x8192", (8192,)), ("1x4096", (4096,)),
    ("1x2048", (2048,)), ("28672+4096", (28672, 4096)), ("24576+8192", (24576, 8192)),
    ("16384+16384", (16384, 16384)), ("8192+24576", (8192, 24576)),
    ("4096+28672", (4096, 28672)), ("12288+4096", (12288, 4096)), ("6144+2048", (6144, 2048)),
    ("4096+4096", (4096, 4096)), ("2048+6144", (2048, 6144)), ("1024+7168", (1024, 7168)),
    ("8192x4", (8192,) * 4), ("4096x8", (4096,) * 8), ("2048x4", (2048,) * 4),
    ("1024x8", (1024,) * 8),
)
# Packed training-style batches of many short sequences (not in FlashQLA's table; run only
# when named with --seqs): where a split must stay possible (one sequence could hold almost
# every token) but the device declines it, the split's launches are mostly empty blocks
# (docs/perf-notes.md, plan).
PACKED_SEQS: Tuple[Tuple[str, Tuple[int, ...]], ...] = (
    ("2048x64", (2048,) * 64), ("512x1024", (512,) * 1024),
)
BWD_MODELS: Tuple[Model, ...] = (
    Model("hk16_hv32", 16, 32), Model("hk8_hv16", 8, 16), Model("hk4_hv8", 4, 8),
    Model("hk2_hv4", 2, 4),
)
BWD_TOTALS: Tuple[int, ...] = (8192, 32768)
BWD_SPLITS: Tuple[int, ...] = (1, 2, 4, 8)
MIN_SEQ = 64


def random_split(total: int, n: int, seed: int) -> Tuple[int, ...]:
    """`n` random lengths summing to `total`, each >= MIN_SEQ; deterministic in (total, n, seed)."""
    if n == 1:
        return (total,)
    rng = random.Random(seed * 1_000_003 + total * 17 + n)
    spare = total - MIN_SEQ * n
    cuts = sorted(rng.sample(range(1, spare), n - 1))
    edges = [0, *cuts, spare]
    return tuple(MIN_SEQ + b - a for a, b in zip(edges, edges[1:]))


@dataclass(frozen=True)
class Row:
    mode: str  # "fwd" or "bwd" (forward + backward)
    model: Model
    seq_label: str
    lens: Tuple[int, ...]

    @property
    def tokens(self) -> int:
        return sum(self.lens)


def _bwd_seqs(seed: int) -> List[Tuple[str, Tuple[int, ...]]]:
    return [(f"{t // 1024}k_{n}seq", random_split(t, n, seed)) for t in BWD_TOTALS
            for n in BWD_SPLITS]


def _pick(items: Sequence[Any], key: Callable[[Any], str], wanted: Optional[List[str]]) -> List[Any]:
    return list(items) if wanted is None else [x for x in items if key(x) in wanted]


def parse_seqs(label: str) -> Optional[Tuple[int, ...]]:
    """Lengths of a forward row named outside the table: "NxL" (N sequences of L tokens) or
    "A+B+..." (one sequence each), e.g. 1x24576 or 12288+512+512; None if it is neither.
    The table's own "8192x4" and its kin are FlashQLA's names, L x N (4 sequences of 8192):
    an unknown "NxL" whose L is under a chunk but whose N is not is read as written, with a
    warning, since "16384x4" (16384 sequences of 4 tokens) was meant as 4 of 16384 once."""
    try:
        if "x" in label:
            n, length = label.split("x")
            lens = (int(length),) * int(n)
            if int(length) < 64 <= int(n):
                print(f"bench_gdn: --seqs {label}: {n} sequences of {length} tokens (N x L); "
                      f"for {length} sequences of {n} write {length}x{n}", file=sys.stderr)
        else:
            lens = tuple(int(x) for x in label.split("+"))
    except ValueError:
        return None
    return lens if lens and min(lens) > 0 else None


def build_rows(mode: str, models: Optional[List[str]], seqs: Optional[List[str]],
               seed: int) -> List[Row]:
    """Rows in run order (forward first), filtered by `--models` / `--seqs`; rows named
    outside the tables (parse_seqs) are added after them."""
    tables = []
    if mode in ("fwd", "both"):
        extra = list(PACKED_SEQS) if seqs else []
        known = {s for s, _ in list(FWD_SEQS) + extra}
        for label in seqs or []:
            lens = None if label in known else parse_seqs(label)  # (a table's label: no warning)
            if lens is not None:
                extra.append((label, lens))
        tables.append(("fwd", FWD_MODELS, list(FWD_SEQS) + extra))
    if mode in ("bwd", "both"):
        bwd_seqs = _bwd_seqs(seed)
        known = {s for s, _ in bwd_seqs}
        for label in seqs or []:
            lens = None if label in known else parse_seqs(label)
            if lens is not None:
                bwd_seqs.append((label, lens))
        tables.append(("bwd", BWD_MODELS, bwd_seqs))
    rows: List[Row] = []
    known_models, known_seqs = set(), set()
    for m, mlist, slist in tables:
        known_models |= {x.key for x in mlist}
        known_seqs |= {s for s, _ in slist}
        for model in _pick(mlist, lambda x: x.key, models):
            for label, lens in _pick(slist, lambda x: x[0], seqs):
                rows.append(Row(m, model, label, lens))
    for name, wanted, known in (("--models", models, known_models), ("--seqs", seqs, known_seqs)):
        unknown = sorted(set(wanted or []) - known)
        if unknown:
            raise SystemExit(f"{name}: unknown {unknown}; choose from {sorted(known)}")
    return rows


# ------------------------------------------------------------------------- FLOPs and bytes


def _mm(m: float, n: float, k: float) -> float:
    return 2.0 * m * n * k


# (term, counted per "qk" head or per "v" head, FLOPs for one chunk of c tokens).
# A = strictly lower (beta K K^T * decay), T = (I + A)^-1, W = T (beta exp(G) K), U = T (beta V),
# V' = U - W S, O = exp(G) Q S + P V' with P = lower(Q K^T * decay), S <- decay S + K'^T V'.
Term = Tuple[str, str, Callable[[int], float]]
FWD_TERMS: Tuple[Term, ...] = (
    ("K K^T", "qk", lambda c: _mm(c, c, D)),
    ("Q K^T", "qk", lambda c: _mm(c, c, D)),
    ("T = (I + A)^-1 (triangular, c^3/3)", "v", lambda c: c ** 3 / 3.0),
    ("W = T (beta K)", "v", lambda c: _mm(c, D, c)),
    ("U = T (beta V)", "v", lambda c: _mm(c, D, c)),
    ("W S", "v", lambda c: _mm(c, D, D)),
    ("Q S", "v", lambda c: _mm(c, D, D)),
    ("S += K^T V'", "v", lambda c: _mm(D, D, c)),
    ("P V'", "v", lambda c: _mm(c, D, c)),
)
# Backward of one chunk, recomputing A, T, W, U and the chunk states from the inputs.
BWD_TERMS: Tuple[Term, ...] = (
    ("recompute K K^T, Q K^T", "qk", lambda c: 2 * _mm(c, c, D)),
    ("recompute T", "v", lambda c: c ** 3 / 3.0),
    ("recompute W, U", "v", lambda c: 2 * _mm(c, D, c)),
    ("recompute W S, K^T V'", "v", lambda c: 2 * _mm(c, D, D)),
    ("dV' = P^T dO + K dS", "v", lambda c: _mm(c, D, c) + _mm(c, D, D)),
    ("dS_prev = Q^T dO - W^T dV'", "v", lambda c: 2 * _mm(D, D, c)),
    ("dP = dO V'^T", "v", lambda c: _mm(c, c, D)),
    ("dQ = dO S^T + dP K", "v", lambda c: _mm(c, D, D) + _mm(c, D, c)),
    ("dK = dP^T Q + V' dS^T", "v", lambda c: _mm(c, D, c) + _mm(c, D, D)),
    ("dW = -dV' S^T", "v", lambda c: _mm(c, D, D)),
    ("dT = dW (beta K)^T + dV' (beta V)^T", "v", lambda c: 2 * _mm(c, c, D)),
    ("T^T dW, T^T dV'", "v", lambda c: 2 * _mm(c, D, c)),
    ("dA = -T^T dT T^T", "v", lambda c: 2 * _mm(c, c, c)),
    ("dK += dA K + dA^T K", "v", lambda c: 2 * _mm(c, D, c)),
)


def _chunks(lens: Iterable[int]) -> Iterable[int]:
    for n in lens:
        full, rest = divmod(n, CHUNK)
        yield from [CHUNK] * full
        if rest:
            yield rest


def count_flops(model: Model, lens: Sequence[int], terms: Sequence[Term]) -> float:
    heads = {"qk": model.h_qk, "v": model.h_v}
    return sum(heads[kind] * fn(c) for c in _chunks(lens) for _, kind, fn in terms)


def io_bytes(model: Model, lens: Sequence[int]) -> Tuple[float, float]:
    """Bytes of the forward's (inputs, outputs): q, k, v bf16, g, beta, h0 fp32; o bf16, state fp32."""
    t, n = sum(lens), len(lens)
    state = n * model.h_v * D * D * 4
    inputs = 2 * t * model.h_qk * D * 2 + t * model.h_v * D * 2 + 2 * t * model.h_v * 4 + state
    outputs = t * model.h_v * D * 2 + state
    return float(inputs), float(outputs)


def work(row: Row) -> Tuple[float, float]:
    """(FLOPs, bytes) of what is timed: the forward, or forward + backward.

    The backward reads the forward's inputs and dO, dS_T (the size of its outputs) and writes
    one gradient per input."""
    f = count_flops(row.model, row.lens, FWD_TERMS)
    inputs, outputs = io_bytes(row.model, row.lens)
    b = inputs + outputs
    if row.mode == "bwd":
        f += count_flops(row.model, row.lens, BWD_TERMS)
        b += 2 * inputs + outputs
    return f, b


def floor_ms(flops: float, nbytes: float, tflops: float, gbps: float) -> float:
    if not (tflops > 0 and gbps > 0):
        return NAN
    return max(flops / (tflops * 1e12), nbytes / (gbps * 1e9)) * 1e3


# ------------------------------------------------------------------------------- results


@dataclass
class Measurement:
    ms: float = NAN  # forward (fwd rows) or forward + backward (bwd rows)
    fwd_ms: float = NAN  # bwd rows: the forward alone on the same inputs
    timing: str = ""  # "graph" or "eager (...)"
    reps: int = 0
    error: str = ""


@dataclass
class RowResult:
    mode: str
    model_label: str
    h_qk: int
    h_v: int
    seq_label: str
    lens: List[int]
    tokens: int
    flops: float
    bytes: float
    floor_ms: float
    fwd_floor_ms: float
    results: Dict[str, Measurement] = field(default_factory=dict)
    checks: Dict[str, Dict[str, Any]] = field(default_factory=dict)

    @property
    def model_key(self) -> str:
        return f"{self.h_qk}/{self.h_v}"

    def ratio(self, peer: str) -> float:
        """peer / flashgdn (forward rows: forward; backward rows: forward + backward)."""
        ours, theirs = self.results.get("flashgdn"), self.results.get(peer)
        if ours is None or theirs is None:
            return NAN
        return theirs.ms / ours.ms if ours.ms > 0 and theirs.ms > 0 else NAN

    def ours_over_floor(self) -> float:
        ours = self.results.get("flashgdn")
        return ours.ms / self.floor_ms if ours and self.floor_ms > 0 else NAN


def make_row_result(row: Row, tflops: float, gbps: float) -> RowResult:
    f, b = work(row)
    fwd_floor = floor_ms(count_flops(row.model, row.lens, FWD_TERMS),
                         sum(io_bytes(row.model, row.lens)), tflops, gbps)
    return RowResult(row.mode, row.model.label, row.model.h_qk, row.model.h_v, row.seq_label,
                     list(row.lens), row.tokens, f, b, floor_ms(f, b, tflops, gbps), fwd_floor)


def geomean(xs: Iterable[float]) -> float:
    vals = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in vals) / len(vals)) if vals else NAN


def geomeans(results: Sequence[RowResult], peers: Sequence[str]) -> Dict[str, Dict[str, Dict[str, float]]]:
    """{mode: {"h_qk/h_v": {peer: geometric mean of peer/flashgdn}}}."""
    out: Dict[str, Dict[str, Dict[str, float]]] = {}
    for r in results:
        out.setdefault(r.mode, {}).setdefault(r.model_key, {})
    for mode, by_model in out.items():
        for key in by_model:
            rows = [r for r in results if r.mode == mode and r.model_key == key]
            by_model[key] = {p: geomean(r.ratio(p) for r in rows) for p in peers if p != "flashgdn"}
    return out


# ------------------------------------------------------------------------------- the GPU


def make_inputs(row: Row, seed: int, dev: str = "cuda") -> Dict[str, Any]:
    torch.manual_seed(seed)
    t, n, hq, hv = row.tokens, len(row.lens), row.model.h_qk, row.model.h_v
    q = F.normalize(torch.randn(1, t, hq, D, device=dev), dim=-1).bfloat16()
    k = F.normalize(torch.randn(1, t, hq, D, device=dev), dim=-1).bfloat16()
    v = torch.randn(1, t, hv, D, device=dev).bfloat16()
    g = F.logsigmoid(torch.randn(1, t, hv, device=dev)) / 16
    g[..., ::4] = 0.0
    beta = torch.sigmoid(torch.randn(1, t, hv, device=dev))
    h0 = torch.randn(n, hv, D, D, device=dev) * 0.1
    offsets = [0]
    for length in row.lens:
        offsets.append(offsets[-1] + length)
    cu_cpu = torch.tensor(offsets, dtype=torch.int64)
    x: Dict[str, Any] = dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0, cu_cpu=cu_cpu,
                             cu32=cu_cpu.to(dev, torch.int32), cu64=cu_cpu.to(dev),
                             max_len=max(row.lens))
    if row.mode == "bwd":
        x["do"] = torch.randn(1, t, hv, D, device=dev).bfloat16()
        x["dht"] = torch.randn(n, hv, D, D, device=dev) / 8
    return x


GRAD_KEYS: Tuple[str, ...] = ("q", "k", "v", "g", "beta", "h0")


class ContextLost(RuntimeError):
    """The CUDA context is unusable (e.g. after an illegal memory access); stop the run."""


def _sync() -> None:
    try:
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001
        raise ContextLost(_err(exc)) from exc


def _err(exc: BaseException, limit: int = 400) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + " ..."


def _dist_version(*names: str) -> str:
    for name in names:
        try:
            return _md.version(name)
        except _md.PackageNotFoundError:
            continue
    return ""


class Peer:
    """One implementation: import it, convert the canonical inputs, call it."""

    name = ""
    has_bwd = True

    def __init__(self, options: argparse.Namespace) -> None:
        self.options = options
        self.fn: Optional[Callable[..., Any]] = None
        self.version = ""
        self.error = ""
        try:
            self.load()
        except Exception as exc:  # noqa: BLE001 - any import failure is a result
            self.fn = None
            self.error = ("not installed: " if isinstance(exc, ImportError) else "") + _err(exc)

    def load(self) -> None:
        raise NotImplementedError

    def prepare(self, x: Dict[str, Any]) -> Dict[str, Any]:
        """Peer-layout tensors (outside the timed region)."""
        return dict(x)

    def forward(self, a: Dict[str, Any]) -> Tuple[Any, Any]:
        raise NotImplementedError

    def canonical(self, o: Any, ht: Any) -> Tuple[Any, Any]:
        """Outputs back in flashgdn's layout (o [1, T, H_v, 128], state [N, H_v, K, V])."""
        return o, ht


class FlashGDNPeer(Peer):
    name = "flashgdn"

    def load(self) -> None:
        import flashgdn

        if not getattr(flashgdn, "HAS_CUDA", True):
            raise RuntimeError("flashgdn was built without its CUDA backend")
        self.fn = flashgdn.chunk_gated_delta_rule
        self.version = getattr(flashgdn, "__version__", "")
        self.extra: Dict[str, Any] = dict(self.options.flashgdn_kwargs)

    def forward(self, a: Dict[str, Any]) -> Tuple[Any, Any]:
        # the host copy of cu_seqlens as FLA gets it; --flashgdn-kwargs cu_seqlens_cpu=None
        # times flashgdn without it
        kw = {"cu_seqlens_cpu": a["cu_cpu"], **self.extra}
        return self.fn(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["h0"],
                       output_final_state=True, cu_seqlens=a["cu32"], **kw)


class FLAPeer(Peer):
    name = "fla"

    def load(self) -> None:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        self.fn = chunk_gated_delta_rule
        self.version = _dist_version("fla-core", "flash-linear-attention")
        if self.options.fla_triton_bwd:
            # FLA refuses its Triton dqkwg backward on Hopper with Triton >= 3.4 (its issue #640:
            # wrong results) unless TileLang is installed. Timing-only override, labelled as such.
            import fla.ops.common.chunk_o as chunk_o

            chunk_o.TRITON_ABOVE_3_4_0 = False
            self.version += " (Triton backward forced)"

    def forward(self, a: Dict[str, Any]) -> Tuple[Any, Any]:
        return self.fn(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["h0"],
                       output_final_state=True, cu_seqlens=a["cu64"], cu_seqlens_cpu=a["cu_cpu"])


class FlashInferPeer(Peer):
    name = "flashinfer"
    has_bwd = False

    def load(self) -> None:
        from flashinfer.gdn_prefill import chunk_gated_delta_rule

        self.fn = chunk_gated_delta_rule
        self.version = _dist_version("flashinfer-python", "flashinfer")
        params = inspect.signature(chunk_gated_delta_rule).parameters
        self.pass_max_len = "max_seqlen" in params

    def prepare(self, x: Dict[str, Any]) -> Dict[str, Any]:
        g = x["g"][0]
        return dict(
            q=x["q"][0].contiguous(), k=x["k"][0].contiguous(), v=x["v"][0].contiguous(),
            g=(g.exp() if self.options.fi_g_space == "linear" else g).contiguous(),
            beta=x["beta"][0].contiguous(), h0=x["h0"].transpose(-1, -2).contiguous(),
            cu64=x["cu64"], max_len=x["max_len"])

    def forward(self, a: Dict[str, Any]) -> Tuple[Any, Any]:
        extra = {"max_seqlen": a["max_len"]} if self.pass_max_len else {}
        return self.fn(a["q"], a["k"], a["v"], g=a["g"], beta=a["beta"], initial_state=a["h0"],
                       output_final_state=True, cu_seqlens=a["cu64"], **extra)

    def canonical(self, o: Any, ht: Any) -> Tuple[Any, Any]:
        return o.unsqueeze(0), ht.transpose(-1, -2)


class FlashQLAPeer(Peer):
    name = "flashqla"

    def load(self) -> None:
        import flash_qla

        self.fn = flash_qla.chunk_gated_delta_rule
        self.version = getattr(flash_qla, "__version__", "") or _dist_version("flash-qla")
        tl = _dist_version("tilelang")
        if tl:
            self.version += f" (tilelang {tl})"

    def forward(self, a: Dict[str, Any]) -> Tuple[Any, Any]:
        return self.fn(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["h0"],
                       output_final_state=True, cu_seqlens=a["cu64"])


PEER_CLASSES: Dict[str, type] = {"flashgdn": FlashGDNPeer, "fla": FLAPeer,
                                 "flashinfer": FlashInferPeer, "flashqla": FlashQLAPeer}


@dataclass
class Timer:
    warmup: int
    reps: int
    max_seconds: float
    min_reps: int = 5

    def _events(self, fn: Callable[[], Any], n: int) -> List[float]:
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                 for _ in range(n)]
        for start, end in pairs:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in pairs]

    def _budget(self, est_ms: float) -> Tuple[int, int]:
        per = max(est_ms, 1e-3)
        warm = max(1, min(self.warmup, int(0.25 * self.max_seconds * 1e3 / per)))
        reps = max(self.min_reps, min(self.reps, int(self.max_seconds * 1e3 / per)))
        return warm, reps

    def time(self, fn: Callable[[], Any]) -> Tuple[float, int, str]:
        """(median ms, replays, method). Exceptions from the eager warm-up propagate."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        _sync()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                fn()
            torch.cuda.synchronize()
            run, method = graph.replay, "graph"
        except Exception as exc:  # noqa: BLE001 - fall back to eager timing, say so
            graph = None
            _sync()
            run, method = fn, f"eager (graph capture failed: {_err(exc, 160)})"
        est = self._events(run, 1)[0]
        warm, reps = self._budget(est)
        self._events(run, warm)
        times = sorted(self._events(run, reps))
        del graph
        return times[len(times) // 2], reps, method


def rel_err(x: Any, ref: Any) -> float:
    x, ref = x.detach().float(), ref.detach().float()
    den = ref.norm().item()
    return (x - ref).norm().item() / den if den > 0 else NAN


def run_outputs(peer: Peer, x: Dict[str, Any], grads: bool) -> Dict[str, Any]:
    """One eager call; outputs (and gradients) in flashgdn's layout, for the error check."""
    a = peer.prepare(x)
    if not grads:
        with torch.no_grad():
            o, ht = peer.canonical(*peer.forward(a))
        return {"o": o, "ht": ht}
    leaves = {key: a[key].detach().clone().requires_grad_() for key in GRAD_KEYS}
    o, ht = peer.forward({**a, **leaves})
    gs = torch.autograd.grad((o, ht), list(leaves.values()), (x["do"], x["dht"]), allow_unused=True)
    out = {"o": o.detach(), "ht": ht.detach()}
    out.update({f"d{key}": gr for key, gr in zip(GRAD_KEYS, gs) if gr is not None})
    return out


def check_row(peers: Sequence[Peer], x: Dict[str, Any], mode: str) -> Dict[str, Dict[str, Any]]:
    ours = peers[0]
    try:
        ref = run_outputs(ours, x, grads=mode == "bwd")
    except Exception as exc:  # noqa: BLE001
        _sync()
        return {"flashgdn": {"error": _err(exc)}}
    out: Dict[str, Dict[str, Any]] = {}
    for peer in peers[1:]:
        if peer.error:
            continue
        grads = mode == "bwd" and peer.has_bwd
        note: Dict[str, Any] = {}
        for attempt in ((True, False) if grads else (False,)):
            try:
                got = run_outputs(peer, x, grads=attempt)
                note.update({key: rel_err(got[key], ref[key]) for key in got if key in ref})
                break
            except Exception as exc:  # noqa: BLE001
                _sync()
                note["grads error" if attempt else "error"] = _err(exc, 200)
        out[peer.name] = note
        torch.cuda.empty_cache()
    return out


def measure(peer: Peer, x: Dict[str, Any], mode: str, timer: Timer) -> Measurement:
    m = Measurement()
    if peer.error:
        m.error = peer.error
        return m
    a: Dict[str, Any] = {}
    try:
        a = peer.prepare(x)
        fwd = lambda: peer.forward(a)  # noqa: E731
        if mode == "fwd":
            m.ms, m.reps, m.timing = timer.time(fwd)
            return m
        m.fwd_ms, m.reps, m.timing = timer.time(fwd)
        if not peer.has_bwd:
            m.error = "forward only (no backward API)"
            return m
        leaves = {key: a[key].detach().clone().requires_grad_() for key in GRAD_KEYS}
        b = {**a, **leaves}
        targets, seeds = list(leaves.values()), (x["do"], x["dht"])

        def step() -> Any:
            o, ht = peer.forward(b)
            return torch.autograd.grad((o, ht), targets, seeds, allow_unused=True)

        m.ms, m.reps, method = timer.time(step)
        if method != m.timing:
            m.timing = f"fwd {m.timing}; fwd+bwd {method}"
    except ContextLost:
        raise
    except Exception as exc:  # noqa: BLE001 - a failing peer is a result, not a crash
        m.error = _err(exc)
        _sync()
    finally:
        a.clear()
        torch.cuda.empty_cache()
    return m


def measure_rates(timer: Timer) -> Tuple[float, float]:
    """(bf16 matmul TFLOP/s on 8192^3, device-to-device copy GB/s counting read + write)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    ms, _, _ = timer.time(lambda: torch.matmul(a, b, out=c))
    tflops = 2.0 * n ** 3 / (ms * 1e-3) / 1e12
    del a, b, c
    size = 1 << 30
    src = torch.empty(size, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms, _, _ = timer.time(lambda: dst.copy_(src))
    gbps = 2.0 * size / (ms * 1e-3) / 1e9
    del src, dst
    torch.cuda.empty_cache()
    return tflops, gbps


# ------------------------------------------------------------------------------ reporting


def fmt_ms(ms: float) -> str:
    return f"{ms:.3f}" if math.isfinite(ms) else "-"


def fmt_x(x: float) -> str:
    if not math.isfinite(x):
        return "-"
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def fmt_check(c: Dict[str, Any]) -> str:
    """Relative errors (floats) and failure texts (strings) of one error check."""
    def one(key: str, val: Any) -> str:
        if isinstance(val, str):
            return f"{key}: {val}"
        return f"{key} {val:.1e}" if val is not None and math.isfinite(val) else f"{key} -"
    return ", ".join(one(k, v) for k, v in c.items())


def fmt_seqs(r: RowResult) -> str:
    if r.mode == "bwd" and len(r.lens) > 1:
        return f"{r.seq_label} ({'+'.join(map(str, r.lens))})"
    return r.seq_label


def progress_line(i: int, n: int, r: RowResult, peers: Sequence[str]) -> str:
    parts = []
    for p in peers:
        m = r.results.get(p)
        if m is None:
            continue
        if math.isfinite(m.ms):
            cell = f"{m.ms:.3f} ms"
            if r.mode == "bwd":
                cell += f" (fwd {fmt_ms(m.fwd_ms)})"
            if p != "flashgdn":
                cell += f" x{fmt_x(r.ratio(p))}"
        elif r.mode == "bwd" and math.isfinite(m.fwd_ms):
            no_bwd = m.error.startswith("forward only")
            cell = f"fwd {m.fwd_ms:.3f} ms, " + ("no bwd" if no_bwd else "fwd+bwd fails")
        else:
            cell = "fails"
        parts.append(f"{p} {cell}")
    floor = f"floor {fmt_ms(r.floor_ms)} ms (ours {fmt_x(r.ours_over_floor())}x)"
    return (f"[{r.mode} {i}/{n}] {r.model_key} {fmt_seqs(r)}: " + " | ".join(parts)
            + f" | {floor}")


def _to_jsonable(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_jsonable(v) for v in obj]
    return obj


def _from_json_float(x: Any) -> float:
    return NAN if x is None else float(x)


def write_json(path: str, meta: Dict[str, Any], results: Sequence[RowResult],
               peers: Sequence[str]) -> None:
    doc = {"meta": meta, "rows": [asdict(r) for r in results],
           "geomean": geomeans(results, peers)}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(_to_jsonable(doc), fh, indent=1)
    os.replace(tmp, path)


def load_json(path: str) -> Tuple[Dict[str, Any], List[RowResult]]:
    with open(path) as fh:
        doc = json.load(fh)
    rows = []
    for d in doc["rows"]:
        res = {p: Measurement(ms=_from_json_float(m["ms"]), fwd_ms=_from_json_float(m["fwd_ms"]),
                              timing=m["timing"], reps=m["reps"], error=m["error"])
               for p, m in d["results"].items()}
        floats = {k: _from_json_float(d[k]) for k in ("flops", "bytes", "floor_ms", "fwd_floor_ms")}
        rows.append(RowResult(d["mode"], d["model_label"], d["h_qk"], d["h_v"], d["seq_label"],
                              d["lens"], d["tokens"], **floats, results=res,
                              checks=d.get("checks", {})))
    return doc["meta"], rows


PUBLISHED_TSV = os.path.join(os.path.dirname(os.path.abspath(__file__)), "published_h200.tsv")
ISSUE5_MARGIN = 1.25  # issue 5: at least this much faster than the best peer on every row


def load_published(path: str = PUBLISHED_TSV) -> Dict[Tuple[str, str, str], Dict[str, float]]:
    """FlashQLA's published H200 table (bench/published_h200.tsv): {(mode, h_qk/h_v, label):
    {"flashqla": ms, "flashinfer": ms or NaN, "fla": ms}}; empty if the file is missing."""
    out: Dict[Tuple[str, str, str], Dict[str, float]] = {}
    if not os.path.exists(path):
        return out
    with open(path) as fh:
        rows = [line.rstrip("\n").split("\t") for line in fh if not line.startswith("#")]
    for mode, key, label, fq, fi, fla in rows[1:]:
        out[(mode, key, label)] = {"flashqla": float(fq),
                                   "flashinfer": float(fi) if fi != "-" else NAN,
                                   "fla": float(fla)}
    return out


def target_lines(results: Sequence[RowResult]) -> List[str]:
    """The issues' targets row by row against FlashQLA's published H200 table: forward rows
    (where FLA ran here) meet issue 4 when FLA / flashgdn here is at least FlashQLA's published
    FLA / FlashQLA, and issue 5 when it is ISSUE5_MARGIN x the best published peer's ratio
    (FlashQLA, FlashInfer; FLA itself counts 1); backward rows meet issue 5 when flashgdn's
    backward (fwd+bwd - fwd, measured here) is ISSUE5_MARGIN x faster than FlashQLA's
    published backward (absolute H200 times: compare on an H200)."""
    pub = load_published()
    if not pub:
        return []
    lines: List[str] = []
    fwd_body, n4, n5, n, n_floor = [], 0, 0, 0, 0
    for r in results:
        ref = pub.get((r.mode, r.model_key, r.seq_label))
        ours, fla = r.results.get("flashgdn"), r.results.get("fla")
        if r.mode != "fwd" or ref is None or ours is None or fla is None:
            continue
        if not (ours.ms > 0 and fla.ms > 0):
            continue
        ratio = fla.ms / ours.ms
        r_q = ref["fla"] / ref["flashqla"]
        r_i = ref["fla"] / ref["flashinfer"] if ref["flashinfer"] > 0 else NAN
        best = max(x for x in (1.0, r_q, r_i) if math.isfinite(x))
        need = fla.ms / (ISSUE5_MARGIN * best)
        ok4, ok5 = ratio >= r_q, ratio >= ISSUE5_MARGIN * best
        # a target under this device's floor (its FLOPs at the measured tensor rate, its
        # minimal bytes at the measured copy rate) is out of every implementation's reach
        # here: FLA's time on this device over a ratio published on an H200 (4.8 TB/s)
        under = r.fwd_floor_ms > 0 and need < r.fwd_floor_ms
        n, n4, n5, n_floor = n + 1, n4 + ok4, n5 + ok5, n_floor + under
        fwd_body.append([r.model_key, r.seq_label, fmt_ms(ours.ms), fmt_ms(fla.ms), fmt_x(ratio),
                         fmt_x(r_q), fmt_x(r_i), "yes" if ok4 else "no", fmt_ms(need),
                         "yes" if ok5 else "no", fmt_ms(r.fwd_floor_ms),
                         "under the floor" if under else ""])
    if fwd_body:
        lines += ["### Targets: forward against FlashQLA's published H200 ratios", "",
                  f"Issue 4's test (FLA / ours at least FlashQLA's published FLA / FlashQLA) holds "
                  f"on {n4} of {n} rows; issue 5's ({ISSUE5_MARGIN}x the best published peer's "
                  f"ratio) on {n5} of {n}. `issue 5 ms`: the flashgdn time that would meet it "
                  f"here; on {n_floor} rows it is under this device's floor (`floor ms`: the "
                  "row's FLOPs at the measured tensor rate or its minimal bytes at the measured "
                  "copy rate, whichever is longer), out of any implementation's reach here. "
                  "Source: bench/published_h200.tsv.", "",
                  *_md_table(["h_qk/h_v", "sequences", "flashgdn ms", "FLA ms", "FLA / ours",
                              "FLA / FlashQLA (pub.)", "FLA / FlashInfer (pub.)", "issue 4",
                              "issue 5 ms", "issue 5", "floor ms", "target"], fwd_body), ""]
    bwd_body, m5, m = [], 0, 0
    for r in results:
        ref = pub.get((r.mode, r.model_key, r.seq_label))
        ours = r.results.get("flashgdn")
        if r.mode != "bwd" or ref is None or ours is None:
            continue
        bwd = ours.ms - ours.fwd_ms
        if not (math.isfinite(bwd) and bwd > 0):
            continue
        need = ref["flashqla"] / ISSUE5_MARGIN
        m, m5 = m + 1, m5 + (bwd <= need)
        bwd_body.append([r.model_key, r.seq_label, fmt_ms(bwd), fmt_ms(ref["flashqla"]),
                         fmt_x(ref["flashqla"] / bwd), fmt_ms(need),
                         "yes" if bwd <= need else "no"])
    if bwd_body:
        lines += ["### Targets: backward against FlashQLA's published H200 backward", "",
                  f"flashgdn's backward = its fwd+bwd minus its forward, measured here; issue 5 "
                  f"({ISSUE5_MARGIN}x faster than FlashQLA's published backward) holds on {m5} of "
                  f"{m} rows. Absolute times: valid against an H200 run.", "",
                  *_md_table(["h_qk/h_v", "sequences", "flashgdn bwd ms", "FlashQLA bwd ms (pub.)",
                              "FlashQLA / ours", "issue 5 ms", "issue 5"], bwd_body), ""]
    return lines


def _md_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> List[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return lines


def write_markdown(path: str, meta: Dict[str, Any], results: Sequence[RowResult],
                   peers: Sequence[str]) -> None:
    status = meta.get("peers", {})
    all_others = [p for p in peers if p != "flashgdn"]
    # peers that could not even be imported get no column; they are listed under "Could not run"
    peers = [p for p in peers if p == "flashgdn" or not status.get(p, {}).get("error")]
    others = [p for p in peers if p != "flashgdn"]
    v = meta.get("versions", {})
    rates = meta.get("rates", {})
    tf, bw = rates.get("bf16_tflops"), rates.get("copy_gbps")
    lines = [
        f"## {meta.get('date', '?')}, {meta.get('device', '?')}, flashgdn {v.get('flashgdn', '?')}"
        f" ({meta.get('git', '?')})", "",
        f"torch {v.get('torch', '?')}, triton {v.get('triton', '?')}, CUDA {v.get('cuda', '?')}; "
        + "; ".join(f"{TITLES[p]} {status.get(p, {}).get('version') or 'n/a'}"
                    for p in all_others) + ".", "",
        "Reproduce: " + ", then ".join(f"`python bench/bench_gdn.py {a}`"
                                       for a in meta.get("argv", [])) + ".", "",
        f"Timing: {meta.get('timing', '')}", "",
        f"Measured in the same run: bf16 matmul (8192^3) {tf:.0f} TFLOP/s, device-to-device copy "
        f"{bw:.0f} GB/s (read + write). Floor = max(FLOPs / rate, bytes / bandwidth) of the "
        "chunked algorithm (bench/bench_gdn.py docstring); `ours / floor` = flashgdn time / floor."
        if tf and bw else "Rates not measured (dry run): floors use assumed rates.", "",
    ]
    for note in [meta["aborted"]] if meta.get("aborted") else meta.get("aborted_runs", []):
        lines += [f"**Run aborted:** {note}", ""]
    missing = [f"- {TITLES[p]}: {status[p]['error']}" for p in all_others
               if status.get(p, {}).get("error")]
    if missing:
        lines += ["Could not run:", *missing, ""]
    fwd = [r for r in results if r.mode == "fwd"]
    bwd = [r for r in results if r.mode == "bwd"]
    gm = geomeans(results, peers)

    def cell(m: Optional[Measurement], key: str = "ms") -> str:
        if m is None:
            return "-"
        val = getattr(m, key)
        mark = "†" if "eager" in m.timing else ""
        if math.isfinite(val):
            return fmt_ms(val) + mark
        return "no bwd" if m.error.startswith("forward only") else "fails"

    if fwd:
        header = ["model", "h_qk/h_v", "sequences", *(f"{TITLES[p]} ms" for p in peers),
                  *(f"{TITLES[p]} / ours" for p in others), "floor ms", "ours / floor"]
        body = [[r.model_label, r.model_key, fmt_seqs(r), *(cell(r.results.get(p)) for p in peers),
                 *(fmt_x(r.ratio(p)) for p in others), fmt_ms(r.floor_ms),
                 fmt_x(r.ours_over_floor())] for r in fwd]
        lines += ["### Forward", "", *_md_table(header, body), ""]
    if bwd:
        header = ["model", "h_qk/h_v", "sequences",
                  *(f"{TITLES[p]} fwd+bwd ms (fwd)" for p in peers),
                  *(f"{TITLES[p]} / ours" for p in others), "floor ms (fwd)", "ours / floor"]
        body = []
        for r in bwd:
            cells = []
            for p in peers:
                m = r.results.get(p)
                cells.append(f"{cell(m)} ({cell(m, 'fwd_ms')})" if m else "-")
            body.append([r.model_label, r.model_key, fmt_seqs(r), *cells,
                         *(fmt_x(r.ratio(p)) for p in others),
                         f"{fmt_ms(r.floor_ms)} ({fmt_ms(r.fwd_floor_ms)})",
                         fmt_x(r.ours_over_floor())])
        lines += ["### Forward + backward (one graph; forward alone in parentheses)", "",
                  *_md_table(header, body), ""]
    if others and gm:
        header = ["mode", "model", "h_qk/h_v", "rows", *(f"{TITLES[p]} / ours" for p in others)]
        body = []
        for mode, by_model in gm.items():
            for key, ratios in by_model.items():
                rows = [r for r in results if r.mode == mode and r.model_key == key]
                body.append([mode, rows[0].model_label, key, str(len(rows)),
                             *(fmt_x(ratios.get(p, NAN)) for p in others)])
        lines += ["### Geometric mean of peer time / flashgdn time per model config", "",
                  *_md_table(header, body), ""]
    lines += target_lines(results)
    checks = [(r, p, c) for r in results for p, c in r.checks.items()]
    if checks:
        body = []
        for r, p, c in checks:
            body.append([r.mode, r.model_key, r.seq_label, TITLES.get(p, p),
                         fmt_check(c).replace("|", "/")])
        lines += ["### Relative error of each peer against flashgdn (first row of each config)", "",
                  *_md_table(["mode", "h_qk/h_v", "sequences", "peer", "relative error"], body), ""]
    notes = sorted({f"{TITLES[p]}: {m.error}" for r in results for p, m in r.results.items()
                    if m.error and p in peers and not m.error.startswith("forward only")})
    eager = any("eager" in m.timing for r in results for m in r.results.values())
    if notes or eager:
        lines += ["Notes:", *(f"- {n}" for n in notes)]
        if eager:
            lines.append("- † timed eagerly (the call could not be captured in a CUDA graph).")
        lines.append("")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        fh.write("\n".join(lines))


def write_png(path: str, results: Sequence[RowResult], peers: Sequence[str]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--png {path}: matplotlib is not installed; skipped (rerun with --merge on a "
              "machine that has it)", flush=True)
        return
    groups: Dict[Tuple[str, str], List[RowResult]] = {}
    for r in results:
        groups.setdefault((r.mode, r.model_key), []).append(r)
    if not groups:
        return
    cols = min(3, len(groups))
    nrows = math.ceil(len(groups) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.5 * cols, 3.6 * nrows), squeeze=False)
    for ax, ((mode, key), rows) in zip(axes.flat, groups.items()):
        xs = list(range(len(rows)))
        for p in peers:
            ys = [r.results[p].ms if p in r.results else NAN for r in rows]
            if any(math.isfinite(y) for y in ys):
                ax.plot(xs, ys, marker="o", ms=3, label=TITLES[p])
        ax.plot(xs, [r.floor_ms for r in rows], ls="--", color="gray", label="floor")
        ax.set_yscale("log")
        ax.set_title(f"{'forward' if mode == 'fwd' else 'forward + backward'}  {rows[0].model_label}"
                     f"  h_qk/h_v = {key}", fontsize=9)
        ax.set_xticks(xs)
        ax.set_xticklabels([r.seq_label for r in rows], rotation=60, fontsize=6)
        ax.set_ylabel("ms")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ---------------------------------------------------------------------------------- main


def versions(peers: Dict[str, Peer]) -> Dict[str, str]:
    out = {"torch": getattr(torch, "__version__", ""),
           "cuda": getattr(getattr(torch, "version", None), "cuda", "") or "",
           "triton": _dist_version("triton"), "tilelang": _dist_version("tilelang"),
           "python": ".".join(map(str, sys.version_info[:3]))}
    if "flashgdn" in peers:
        out["flashgdn"] = peers["flashgdn"].version or "?"
    return out


def git_rev() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, text=True,
                             capture_output=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               text=True, capture_output=True, timeout=10)
        if rev.returncode == 0:
            return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown commit"


def parse_kwargs(text: str) -> Dict[str, Any]:
    import ast

    out: Dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, _, value = item.partition("=")
        out[key.strip()] = ast.literal_eval(value.strip())
    return out


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("fwd", "bwd", "both"), default="both")
    ap.add_argument("--models", default=None, help="h_qk/h_v list, e.g. 2/8,4/16 (default: all)")
    ap.add_argument("--seqs", default=None,
                    help="sequence labels, e.g. 1x32768,28672+4096,8k_4seq (default: all)")
    ap.add_argument("--peers", default=",".join(PEERS), help=f"subset of {','.join(PEERS)}")
    ap.add_argument("--json", default=None, help="write results (rewritten after every row)")
    ap.add_argument("--png", default=None, help="latency plot per config (needs matplotlib)")
    ap.add_argument("--md", default=None, help="markdown tables for docs/benchmarks.md")
    ap.add_argument("--quick", action="store_true", help="few replays (smoke test)")
    ap.add_argument("--warmup", type=int, default=10, help="graph replays before timing")
    ap.add_argument("--reps", type=int, default=100, help="timed replays (median reported)")
    ap.add_argument("--max-seconds", type=float, default=1.0,
                    help="cap on timed replays per call: at least 5 replays, at most this long")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-check", action="store_true", help="skip the relative-error check")
    ap.add_argument("--dry-run", action="store_true",
                    help="list rows with FLOPs, bytes and floors at assumed rates; no GPU")
    ap.add_argument("--assume-tflops", type=float, default=660.0,
                    help="dry run: bf16 rate for the floor (TFLOP/s)")
    ap.add_argument("--assume-gbps", type=float, default=3000.0,
                    help="dry run: copy bandwidth for the floor (GB/s, read + write)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="no GPU: combine result files, then write --json/--md/--png")
    ap.add_argument("--flashgdn-kwargs", type=parse_kwargs, default={},
                    help="extra keyword arguments for flashgdn, e.g. context_parallel=True")
    ap.add_argument("--fi-g-space", choices=("linear", "log"), default="linear",
                    help="how g is handed to FlashInfer (its kernel takes alpha = exp(g))")
    ap.add_argument("--fla-triton-bwd", action="store_true",
                    help="force FLA's Triton backward on Hopper (FLA says it is wrong there, "
                         "issue #640); timing only, labelled in the outputs")
    args = ap.parse_args(argv)
    if args.quick:
        args.warmup, args.reps, args.max_seconds = 2, 10, 0.3
    args.peer_list = [p.strip() for p in args.peers.split(",") if p.strip()]
    bad = [p for p in args.peer_list if p not in PEERS]
    if bad or "flashgdn" not in args.peer_list:
        ap.error(f"--peers must include flashgdn and name only {PEERS}; got {args.peer_list}")
    args.peer_list = [p for p in PEERS if p in args.peer_list]
    split = lambda s: None if s is None else [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    args.model_list, args.seq_list = split(args.models), split(args.seqs)
    return args


def write_outputs(args: argparse.Namespace, meta: Dict[str, Any], results: Sequence[RowResult],
                  peers: Sequence[str]) -> None:
    if args.json:
        write_json(args.json, meta, results, peers)
    if args.md:
        write_markdown(args.md, meta, results, peers)
        print(f"wrote {args.md}", flush=True)
    if args.png:
        write_png(args.png, results, peers)
        if os.path.exists(args.png):
            print(f"wrote {args.png}", flush=True)


def dry_run(args: argparse.Namespace) -> None:
    rows = build_rows(args.mode, args.model_list, args.seq_list, args.seed)
    print(f"{len(rows)} rows; floors at assumed {args.assume_tflops:.0f} TFLOP/s and "
          f"{args.assume_gbps:.0f} GB/s")
    print(f"{'mode':4} {'h_qk/h_v':8} {'sequences':34} {'tokens':>6} {'GFLOP':>9} {'MB':>9} "
          f"{'floor ms':>9} {'bound':>7}")
    results = []
    for row in rows:
        r = make_row_result(row, args.assume_tflops, args.assume_gbps)
        results.append(r)
        bound = "flops" if r.flops / args.assume_tflops / 1e3 > r.bytes / args.assume_gbps else "bytes"
        print(f"{r.mode:4} {r.model_key:8} {fmt_seqs(r):34} {r.tokens:6d} {r.flops / 1e9:9.2f} "
              f"{r.bytes / 1e6:9.1f} {r.floor_ms:9.4f} {bound:>7}")
    for title, terms in (("forward", FWD_TERMS), ("backward", BWD_TERMS)):
        print(f"{title} MFLOP per {CHUNK}-token chunk and head: " + "; ".join(
            f"{name} {fn(CHUNK) / 1e6:.3f} (per {kind})" for name, kind, fn in terms))
    meta = {"date": _dt.date.today().isoformat(), "device": "dry run (no GPU)", "git": git_rev(),
            "versions": {"flashgdn": "?"}, "argv": [" ".join(sys.argv[1:])],
            "timing": "none (dry run)", "rates": {}, "peers": {}}
    write_outputs(args, meta, results, args.peer_list)


def merge(args: argparse.Namespace) -> None:
    """Later files win for a row measured twice (same mode, heads and sequence mix)."""
    meta: Dict[str, Any] = {}
    merged: Dict[Tuple[str, str, str], RowResult] = {}
    peers: List[str] = []
    for path in args.merge:
        m, rows = load_json(path)
        if not meta:
            meta = dict(m, argv=[])
        elif m.get("device") != meta.get("device"):
            print(f"warning: {path} was measured on {m.get('device')}, not {meta.get('device')}")
        meta["argv"] += m.get("argv", [])
        for p, status in m.get("peers", {}).items():
            if not status.get("error") or p not in meta.setdefault("peers", {}):
                meta["peers"][p] = status
        if m.get("aborted"):
            meta.setdefault("aborted_runs", []).append(f"{path}: {m['aborted']}")
        peers += [p for p in m.get("peer_list", PEERS) if p not in peers]
        for r in rows:
            merged[(r.mode, r.model_key, r.seq_label)] = r
    write_outputs(args, meta, list(merged.values()), [p for p in PEERS if p in peers])


def run_rows(rows: Sequence[Row], order: Sequence[Peer], timer: Timer, args: argparse.Namespace,
             meta: Dict[str, Any], results: List[RowResult], tflops: float, gbps: float) -> None:
    checked, reported = set(), set()
    for i, row in enumerate(rows, 1):
        r = make_row_result(row, tflops, gbps)
        try:
            x = make_inputs(row, args.seed)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory
            _sync()
            r.results = {p.name: Measurement(error=f"inputs: {_err(exc)}") for p in order}
            results.append(r)
            print(f"[{row.mode} {i}/{len(rows)}] {row.model.key} {row.seq_label}: inputs failed: "
                  f"{_err(exc)}", flush=True)
            continue
        if not args.no_check and (row.mode, row.model.key) not in checked:
            checked.add((row.mode, row.model.key))
            r.checks = check_row(order, x, row.mode)
            for name, c in r.checks.items():
                print(f"  check {row.mode} {row.model.key} {name} vs flashgdn: {fmt_check(c)}",
                      flush=True)
        for peer in order:
            r.results[peer.name] = measure(peer, x, row.mode, timer)
        del x
        torch.cuda.empty_cache()
        results.append(r)
        print(progress_line(i, len(rows), r, args.peer_list), flush=True)
        for name, m in r.results.items():  # each distinct failure once
            if m.error and (name, m.error) not in reported and not m.error.startswith("forward only"):
                reported.add((name, m.error))
                print(f"  {name} failed: {m.error}", flush=True)
        if args.json:
            write_json(args.json, meta, results, args.peer_list)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    if args.merge:
        return merge(args)
    if torch is None or not torch.cuda.is_available():
        raise SystemExit("needs torch with a CUDA device (use --dry-run or --merge without one)")
    rows = build_rows(args.mode, args.model_list, args.seq_list, args.seed)
    peers = {name: PEER_CLASSES[name](args) for name in args.peer_list}
    if peers["flashgdn"].error:
        print(f"flashgdn unavailable: {peers['flashgdn'].error}", flush=True)
    timer = Timer(args.warmup, args.reps, args.max_seconds)
    tflops, gbps = measure_rates(timer)
    device = torch.cuda.get_device_name()
    meta: Dict[str, Any] = {
        "date": _dt.datetime.now().strftime("%Y-%m-%d %H:%M"), "device": device, "git": git_rev(),
        "versions": versions(peers), "argv": [" ".join(sys.argv[1:])],
        "timing": (f"CUDA graph per call, 3 eager warm-up calls, up to {args.warmup} warm-up "
                   f"replays, median of up to {args.reps} timed replays (at least 5, at most "
                   f"~{args.max_seconds:g} s per call), no L2 flush; backward rows time forward + "
                   "backward (torch.autograd.grad) in one graph."),
        "rates": {"bf16_tflops": tflops, "copy_gbps": gbps},
        "peers": {n: {"version": p.version, "error": p.error} for n, p in peers.items()},
        "peer_list": args.peer_list,
    }
    print(f"{device} | torch {meta['versions']['torch']} | triton {meta['versions']['triton']} | "
          f"bf16 matmul {tflops:.0f} TFLOP/s | copy {gbps:.0f} GB/s", flush=True)
    for n, p in peers.items():
        print(f"  {n}: {p.version if not p.error else p.error}", flush=True)
    order = [peers[n] for n in args.peer_list]
    results: List[RowResult] = []
    try:
        run_rows(rows, order, timer, args, meta, results, tflops, gbps)
    except ContextLost as exc:
        meta["aborted"] = f"CUDA context lost after {len(results)} rows: {exc}"
        print(f"ABORTED: {meta['aborted']}", flush=True)
    for mode, by_model in geomeans(results, args.peer_list).items():
        for key, ratios in by_model.items():
            text = ", ".join(f"{TITLES[p]} {fmt_x(v)}" for p, v in ratios.items())
            print(f"geomean peer/flashgdn {mode} {key}: {text}", flush=True)
    write_outputs(args, meta, results, args.peer_list)


if __name__ == "__main__":
    main()
