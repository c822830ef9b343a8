"""Shared fixtures: input generation, the float64 reference, error metrics, devices.

GPU tests run whenever torch sees a CUDA device and are skipped, loudly, only when
none is present. A CUDA device with a flashgdn build that lacks the CUDA backend
is a failure, not a skip.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
import warnings
from typing import List, Optional

import pytest
import torch
import torch.nn.functional as F

import flashgdn
from flashgdn.reference import recurrent_gated_delta_rule_ref

HAS_GPU = torch.cuda.is_available()
NO_GPU_REASON = "no CUDA device present: GPU test SKIPPED (run on a GPU machine to cover it)"


def pytest_report_header(config):
    if HAS_GPU:
        return [f"flashgdn {flashgdn.__version__}: GPU {torch.cuda.get_device_name()} "
                f"(CUDA backend built: {flashgdn.HAS_CUDA})"]
    return ["!" * 78, "flashgdn: NO CUDA DEVICE -- every GPU test will be SKIPPED", "!" * 78]


def pytest_configure(config):
    if not HAS_GPU:
        warnings.warn("flashgdn tests: no CUDA device, GPU tests are skipped", stacklevel=1)
    # Under pytest-xdist (`-n W`) each worker gets its share of the cores for torch's CPU
    # work (the float64 reference, the CPU backend's comparisons) instead of all of them:
    # 8 workers x 16 threads on the device's 16 cores is where test_backward's CPU cases had
    # taken over 10 minutes while its 40 GPU cases took 33 s (session 59); with this setting
    # the whole file ran in 39 s (session 60, H100).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu,
                                               pytest.mark.skipif(not HAS_GPU,
                                                                  reason=NO_GPU_REASON)])]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    if request.param == "cuda":
        assert flashgdn.HAS_CUDA, "a CUDA device is present but flashgdn was built without CUDA"
    return request.param


@dataclasses.dataclass
class Case:
    name: str
    lens: List[int]            # sequence lengths
    hqk: int
    hv: int
    varlen: bool = True        # packed with cu_seqlens (else B = len(lens), equal lengths)
    h0: bool = True
    gate: str = "normal"       # normal | zero_heads | all_zero | very_negative | mixed
    dtype: torch.dtype = torch.bfloat16
    gate_dtype: torch.dtype = torch.float32
    cu_dtype: torch.dtype = torch.int32


def make_inputs(case: Case, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(case.lens) if case.varlen else case.lens[0]
    B = 1 if case.varlen else len(case.lens)
    if not case.varlen:
        assert all(n == T for n in case.lens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q = randn(B, T, case.hqk, 128)
    k = F.normalize(randn(B, T, case.hqk, 128), dim=-1)
    v = randn(B, T, case.hv, 128)
    g = F.logsigmoid(randn(B, T, case.hv)) / 4
    if case.gate in ("zero_heads", "mixed"):
        g[..., ::4] = 0.0
    if case.gate == "all_zero":
        g.zero_()
    if case.gate in ("very_negative", "mixed"):
        g[..., 1::4] = -20.0 * torch.rand(B, T, len(range(1, case.hv, 4)), generator=gen) - 5.0
    beta = torch.sigmoid(randn(B, T, case.hv))
    N = len(case.lens)
    h0 = randn(N, case.hv, 128, 128) * 0.1 if case.h0 else None
    cu = None
    if case.varlen:
        cu = torch.tensor([0] + list(torch.tensor(case.lens).cumsum(0)), dtype=case.cu_dtype)
    to = dict(device=device)
    return dict(
        q=q.to(case.dtype).to(**to), k=k.to(case.dtype).to(**to), v=v.to(case.dtype).to(**to),
        g=g.to(case.gate_dtype).to(**to), beta=beta.to(case.gate_dtype).to(**to),
        initial_state=None if h0 is None else h0.to(**to),
        cu_seqlens=None if cu is None else cu.to(**to),
    )


def out_of_fp16_range_inputs(seed: int):
    """Head 1 with |v| ~ 3e4 (fp16 copies of U overflow), head 2 with |v| ~ 1e-6 (they
    underflow to subnormals), heads 0 and 3 as usual; g == 0 on head 0, very negative gates
    on head 1; two sequences, an initial state."""
    case = Case("range", [2000, 700], 1, 4, gate="mixed")
    inp = make_inputs(case, "cuda", seed=seed)
    v = inp["v"].float()
    v[:, :, 1] *= 3e4
    v[:, :, 2] *= 1e-6
    inp["v"] = v.to(inp["v"].dtype)
    h0 = inp["initial_state"].clone()
    h0[:, 2] *= 1e-6
    inp["initial_state"] = h0
    return case, inp


def cotangents(o: torch.Tensor, ht: torch.Tensor, seed: int, scale: float = 1.0):
    """Random cotangents (do in o's dtype, dht in fp32), times `scale`, for a backward
    through (o, ht), drawn on the CPU from `seed` (do first) and moved to the outputs'
    device."""
    gen = torch.Generator().manual_seed(seed)
    do = (scale * torch.randn(o.shape, generator=gen)).to(o.dtype).to(o.device)
    dht = (scale * torch.randn(ht.shape, generator=gen)).to(ht.device)
    return do, dht


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    assert torch.isfinite(x).all(), "non-finite values in the result"
    den = ref.norm().item()
    return (x - ref).norm().item() / max(den, 1e-30)


# The float64 reference of the last few distinct inputs: parametrized tests run one case
# under several switches in a row (the CP suite's kernels, modes, schedules), and the
# token-by-token reference of a 16k-32k-token case is the slowest part of such a test.
# Keyed by the inputs' exact bytes, so a hit returns what the call would compute; inputs
# that require grad are never cached.
_REF_KEYS = ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens")
_REF_CACHE: "collections.OrderedDict[bytes, tuple]" = collections.OrderedDict()
_REF_CACHE_SIZE = 2


def _hash_tensor(h, name: str, x: torch.Tensor) -> None:
    h.update(f"{name}:{x.dtype}:{tuple(x.shape)}:{x.device.type}".encode())
    h.update(x.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())


def _reference_key(inp: dict, scale: Optional[float]) -> Optional[bytes]:
    h = hashlib.blake2b(repr(scale).encode(), digest_size=32)
    for name in _REF_KEYS:
        x = inp.get(name)
        if x is None:
            h.update(f"{name}:none".encode())
            continue
        if x.requires_grad:
            return None
        _hash_tensor(h, name, x)
    return h.digest()


def reference(inp: dict, scale: Optional[float] = None):
    key = _reference_key(inp, scale)
    if key is not None and key in _REF_CACHE:
        _REF_CACHE.move_to_end(key)
        return _REF_CACHE[key]
    out = recurrent_gated_delta_rule_ref(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                         scale=scale, initial_state=inp["initial_state"],
                                         cu_seqlens=inp["cu_seqlens"])
    if key is not None:
        _REF_CACHE[key] = out
        while len(_REF_CACHE) > _REF_CACHE_SIZE:
            _REF_CACHE.popitem(last=False)
    return out


# The float64 reference's gradients of the last few distinct (inputs, cotangents): the
# backward tests run one case under several switches in a row, and each would otherwise
# differentiate the token-by-token reference again. Keyed by the inputs' and cotangents'
# exact bytes (as the reference's own cache), so a hit returns what the call would compute.
_GRAD_CACHE: "collections.OrderedDict[bytes, tuple]" = collections.OrderedDict()


def reference_grads(inp: dict, do: torch.Tensor, dht: torch.Tensor, names: List[str]) -> tuple:
    """Gradients of <o, do> + <h_T, dht> through the float64 reference with respect to the
    inputs `names` (in that order); `inp` as make_inputs returns it (no grad)."""
    key = _reference_key(inp, None)
    if key is not None:
        h = hashlib.blake2b(key + repr(names).encode(), digest_size=32)
        _hash_tensor(h, "do", do)
        _hash_tensor(h, "dht", dht)
        key = h.digest()
        if key in _GRAD_CACHE:
            _GRAD_CACHE.move_to_end(key)
            return _GRAD_CACHE[key]
    leaves = {n: (inp[n].double().clone().requires_grad_() if inp[n] is not None else None)
              for n in ("q", "k", "v", "g", "beta", "initial_state")}
    ro, rh = reference({**leaves, "cu_seqlens": inp["cu_seqlens"]})
    refs = torch.autograd.grad((ro * do.double()).sum() + (rh * dht.double()).sum(),
                               [leaves[n] for n in names])
    if key is not None:
        _GRAD_CACHE[key] = refs
        while len(_GRAD_CACHE) > _REF_CACHE_SIZE:
            _GRAD_CACHE.popitem(last=False)
    return refs


def cuda_kernels_run(fn) -> set:
    """The names of the CUDA kernels fn() launches (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA],
                                acc_events=True) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}


CASES = [
    Case("T1_single_token", [1], 1, 1, varlen=False),
    Case("fixed_B2_T100_gva", [100, 100], 2, 4, varlen=False),
    Case("varlen_1_63_64_65_1100", [1, 63, 64, 65, 1100], 1, 2),
    Case("gva_2_8_mixed_gates", [130, 70], 2, 8, gate="mixed"),
    Case("zero_gate_heads", [200], 1, 4, gate="zero_heads", h0=False),
    Case("all_gates_zero", [129], 1, 2, gate="all_zero"),
    Case("very_negative_gates", [150], 1, 2, gate="very_negative"),
    Case("many_short_seqs", [1 + (7 * i) % 23 for i in range(40)], 1, 2, cu_dtype=torch.int64),
    Case("fp16_bf16_gates", [97, 31], 2, 2, dtype=torch.float16, gate_dtype=torch.bfloat16),
    Case("no_initial_state", [192], 2, 2, h0=False),
    # three value heads a q/k head (8/24's ratio): wy_kernel's blocks take 3 heads each
    Case("gva_2_6_mixed_gates", [150, 71], 2, 6, gate="mixed"),
]
