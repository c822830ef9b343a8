"""Intra-card context parallelism of the CUDA forward (csrc/planner.h, state_fwd_kernel).

FLASHGDN_CP=on with FLASHGDN_CP_SEG=<chunks> forces short segments, so every case below
splits its sequences into many segments. Heads whose gates do not decay (g == 0) get the
exact entering state of each segment (segment summaries L, M chained by seg_combine_kernel)
and must come out as accurate against the float64 reference as the unsplit pass; decaying
heads may start from a warm-up and must agree with the unsplit pass within bf16 rounding.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
import torch

import flashgdn
from conftest import (HAS_GPU, NO_GPU_REASON, Case, cuda_kernels_run, make_inputs, reference,
                      rel_err)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)]

O_TOL = 4.3e-3
STATE_TOL = 3.7e-3


ENV_KEYS = ("FLASHGDN_CP", "FLASHGDN_CP_SEG", "FLASHGDN_FWD_BW", "FLASHGDN_FWD_PASS",
            "FLASHGDN_COLS_WGMMA", "FLASHGDN_CP_OVERLAP", "FLASHGDN_CP_SUB", "FLASHGDN_CP_CORR",
            "FLASHGDN_BWD_COLS", "FLASHGDN_CP_SCAN", "FLASHGDN_CP_SAT", "FLASHGDN_COLS_PING",
            "FLASHGDN_WY_BATCHED", "FLASHGDN_COLS_STAGES", "FLASHGDN_CP_WALK",
            "FLASHGDN_CP_P0_MERGE", "FLASHGDN_CP_WALK_STAGES", "FLASHGDN_HOST_CHOICE",
            "FLASHGDN_PLAN_ASIDE", "FLASHGDN_HOST_SCHEDULE", "FLASHGDN_UNFUSED_WY_US",
            "FLASHGDN_UNFUSED_WY_LONGEST", "FLASHGDN_P0_LIST", "FLASHGDN_HOST_EXACT_P0",
            "FLASHGDN_TRI16", "FLASHGDN_DEBUG",
            "FLASHGDN_WY_OCC4", "FLASHGDN_COLS_OWG", "FLASHGDN_KQ_COPIES", "FLASHGDN_WY_LEAN",
            "FLASHGDN_WY_LEAN_T", "FLASHGDN_FUSED", "FLASHGDN_HOST_COLS", "FLASHGDN_HOST_SEGS",
            "FLASHGDN_COLS_TMA", "FLASHGDN_TMA_WY_PHASES", "FLASHGDN_WY_LEAN_KONLY",
            "FLASHGDN_CP_SHORT_LONGEST", "FLASHGDN_CP_SHORT_MIN", "FLASHGDN_HOST_SPLIT",
            "FLASHGDN_TMA_KCONV", "FLASHGDN_BWD_SHORT", "FLASHGDN_REACH_SEG",
            "FLASHGDN_EXACT_REACH", "FLASHGDN_BWD_EXACT_REACH")


@contextmanager
def env_vars(settings: dict):
    """The planner's switches set to `settings` (the others unset) for the scope."""
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


def cp_env(mode: str, seg: int = 0):
    return env_vars({"FLASHGDN_CP": mode, **({"FLASHGDN_CP_SEG": str(seg)} if seg else {})})


CP_CASES = [
    Case("one_seq_1100_mixed", [1100], 1, 4, gate="mixed"),
    Case("varlen_mix_gva", [70, 1100, 300, 5, 640], 2, 8, gate="mixed"),
    Case("fixed_B2_zero_heads", [700, 700], 1, 4, varlen=False, gate="zero_heads"),
    Case("all_zero_gates_h0", [900], 1, 2, gate="all_zero"),
    Case("normal_gates_no_h0", [1000, 333], 2, 2, h0=False),
    # long enough that exact segments follow exact segments (the transition M is used)
    Case("long_mixed_h0", [3000], 1, 4, gate="mixed"),
    Case("varlen_long_gva", [2500, 70, 1900], 2, 8, gate="mixed"),
]


@pytest.mark.parametrize("bw", ["32", "128", "128wg", "128wgp"])
@pytest.mark.parametrize("seg", [1, 2, 5])
@pytest.mark.parametrize("case", CP_CASES, ids=lambda c: c.name)
def test_cp_matches_unsplit_and_reference(case: Case, seg: int, bw: str):
    """Each state-pass kernel split into segments (FLASHGDN_FWD_BW: state_fwd_f16_kernel at
    32 columns, state_fwd_cols_kernel at 128, with its own summaries and warm-ups; "128wg":
    state_fwd_cols_wg_kernel, FLASHGDN_COLS_WGMMA=1; "128wgp": its ping-pong schedule,
    =2) against itself unsplit and the reference."""
    inp = make_inputs(case, "cuda", seed=11)
    kernel = {"FLASHGDN_FWD_BW": bw[:3] if bw.startswith("128") else bw,
              **({"FLASHGDN_COLS_WGMMA": "1"} if bw == "128wg" else {}),
              **({"FLASHGDN_COLS_WGMMA": "2"} if bw == "128wgp" else {})}
    with env_vars({"FLASHGDN_CP": "off", **kernel}):
        o_ref, h_ref = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    with env_vars({"FLASHGDN_CP": "on", "FLASHGDN_CP_SEG": str(seg), **kernel}):
        o, ht = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    torch.cuda.synchronize()
    ro, rh = reference(inp)
    check_split(f"{case.name} BW {bw} seg={seg}", case, o, ht, o_ref, h_ref, ro, rh)


@pytest.mark.parametrize("overlap", ["0", "1"])
@pytest.mark.parametrize("bw", ["16", "32", "128"])
@pytest.mark.parametrize("seg", [1, 3])
@pytest.mark.parametrize("case", CP_CASES, ids=lambda c: c.name)
def test_corr_matches_unsplit_and_reference(case: Case, seg: int, bw: str, overlap: str):
    """Exact segments' outputs by correction (FLASHGDN_CP_CORR=1: phase 1 writes their local
    outputs and effective queries, seg_correct_kernel adds Q_eff S_in, the combine forms the
    final state where the last segment is exact), each state-pass kernel, sequential and
    overlapped schedule: against the unsplit pass and the reference, g == 0 heads as exact
    as unsplit."""
    inp = make_inputs(case, "cuda", seed=13)
    with env_vars({"FLASHGDN_CP": "off", "FLASHGDN_FWD_BW": bw}):
        o_ref, h_ref = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    with env_vars({"FLASHGDN_CP": "on", "FLASHGDN_CP_SEG": str(seg), "FLASHGDN_FWD_BW": bw,
                   "FLASHGDN_CP_CORR": "1", "FLASHGDN_CP_OVERLAP": overlap}):
        o, ht = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
        o2 = flashgdn.chunk_gated_delta_rule(**inp)  # no final state asked for
    torch.cuda.synchronize()
    ro, rh = reference(inp)
    check_split(f"{case.name} corr BW {bw} seg={seg} overlap={overlap}", case, o, ht, o_ref,
                h_ref, ro, rh)
    assert torch.equal(o, o2[0] if isinstance(o2, tuple) else o2)


def zero_gate_heads(case: Case) -> range:
    """The heads whose gates are all zero in make_inputs(case)."""
    return {"zero_heads": range(0, case.hv, 4), "mixed": range(0, case.hv, 4),
            "all_zero": range(case.hv)}.get(case.gate, range(0))


def check_split(label: str, case: Case, o, ht, o_ref, h_ref, ro, rh) -> None:
    """A split pass's o and final state (o, ht) against the float64 reference (ro, rh) and
    the unsplit pass (o_ref, h_ref); its g == 0 heads as exact as unsplit."""
    e_o, e_h = rel_err(o, ro), rel_err(ht, rh)
    d_o, d_h = rel_err(o, o_ref), rel_err(ht, h_ref)
    print(f"{label}: vs ref o {e_o:.2e} state {e_h:.2e}; vs unsplit o {d_o:.2e} "
          f"state {d_h:.2e}")
    assert e_o < O_TOL and e_h < STATE_TOL
    assert d_o < 2e-3 and d_h < 1e-3
    for h in zero_gate_heads(case):
        assert_as_exact(h, o, ht, o_ref, h_ref, ro, rh)


def assert_as_exact(h, o, ht, o_ref, h_ref, ro, rh):
    """Head h (g == 0) with CP is as accurate against the float64 reference as without."""
    eo, eo_ref = rel_err(o[:, :, h], ro[:, :, h]), rel_err(o_ref[:, :, h], ro[:, :, h])
    eh, eh_ref = rel_err(ht[:, h], rh[:, h]), rel_err(h_ref[:, h], rh[:, h])
    print(f"  head {h} (g == 0): o {eo:.2e} (unsplit {eo_ref:.2e}) state {eh:.2e} "
          f"(unsplit {eh_ref:.2e})")
    assert eo < 1.25 * eo_ref + 1e-4, f"head {h} (g == 0): o error {eo:.3e} vs {eo_ref:.3e}"
    assert eh < 1.5 * eh_ref + 1e-4, f"head {h} (g == 0): state error {eh:.3e} vs {eh_ref:.3e}"


def check_split_env(label: str, case: Case, inp: dict, split: dict, off: dict) -> None:
    """The unsplit pass (env `off`) and the split one (env `split`), eagerly and replayed from
    a CUDA graph (the same bits), the split one against the float64 reference and the
    unsplit pass (check_split)."""
    o_ref, h_ref, o, ht = forward_pair(inp, off, split, label)
    ro, rh = reference(inp)
    check_split(label, case, o, ht, o_ref, h_ref, ro, rh)


def striped_gate_inputs(case: Case, seed: int) -> dict:
    """make_inputs(case) with head 1's gates zero but for a stretch of strong decay (tokens
    [n/3, n/3 + 200) of each sequence of n, at g = -2): its segments start exact, then from a
    warm-up after the stretch, then exact again, so the combine's chain holds constant maps
    between affine ones; head 0 (g == 0 everywhere) stays exact throughout."""
    inp = make_inputs(case, "cpu", seed=seed)
    g = inp["g"].clone()
    starts = [0] + list(torch.tensor(case.lens).cumsum(0)[:-1]) if case.varlen else [0]
    for b in range(g.shape[0]):
        for s0, n in zip(starts, case.lens if case.varlen else case.lens[:1]):
            g[b, s0:s0 + n, 1] = 0.0
            g[b, s0 + n // 3:min(s0 + n // 3 + 200, s0 + n), 1] = -2.0
    inp["g"] = g
    return {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}


@pytest.mark.parametrize("seg", [1, 3])
@pytest.mark.parametrize("case", [Case("scan_long", [4000], 1, 4, gate="mixed"),
                                  Case("scan_varlen", [3000, 70, 2200, 640], 2, 8,
                                       gate="mixed")],
                         ids=lambda c: c.name)
def test_scan_matches_walk(case: Case, seg: int):
    """The forward's combine as a log-depth scan (seg_scan_kernel, FLASHGDN_CP_WALK=0) against
    the walk (and FLASHGDN_CP_SCAN=0, seg_combine_kernel): at 128 columns with segments of 1 or 3
    chunks (63 or 21 segments of 4000 tokens: 6 or 5 levels), constant maps inside the
    chain (striped_gate_inputs), packed sequences of one to 47 segments. Both against the
    float64 reference and the unsplit pass, and against each other within fp32 rounding of
    the fp16 state pass's rounding (the chains differ by ~1e-6 in S_in, fp32's rounding;
    phase 0's fp16 operands then round some values the other way)."""
    inp = striped_gate_inputs(case, seed=23)
    kernel = {"FLASHGDN_FWD_BW": "128"}
    with env_vars({"FLASHGDN_CP": "off", **kernel}):
        o_ref, h_ref = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    split = {"FLASHGDN_CP": "on", "FLASHGDN_CP_SEG": str(seg), "FLASHGDN_CP_WALK": "0", **kernel}
    with env_vars(split):
        o_scan, h_scan = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    with env_vars({**split, "FLASHGDN_CP_SCAN": "0"}):
        o_walk, h_walk = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    torch.cuda.synchronize()
    ro, rh = reference(inp)
    check_split(f"{case.name} seg {seg} scan", case, o_scan, h_scan, o_ref, h_ref, ro, rh)
    check_split(f"{case.name} seg {seg} walk", case, o_walk, h_walk, o_ref, h_ref, ro, rh)
    assert_chains_agree("scan", o_scan, h_scan, "walk", o_walk, h_walk, o_ref, ro)


def assert_chains_agree(name, o, ht, other_name, o_other, h_other, o_ref, ro) -> None:
    """Two chains' results on striped_gate_inputs: per exact head (head 1 with its decaying
    stretch) o and the state within fp32 rounding of the fp16 state pass's rounding of each
    other, and the first's o as accurate as the unsplit pass's (o_ref) against ro."""
    for h in (0, 1):
        d_o = rel_err(o[:, :, h], o_other[:, :, h])
        d_h = rel_err(ht[:, h], h_other[:, h])
        print(f"  head {h}: {name} vs {other_name} o {d_o:.2e} state {d_h:.2e}")
        # per head: all of the difference sits in the exact heads (over all heads the
        # benchmark rows measure 4e-4 .. 1.1e-3 on o); the bound that matters is the next one
        assert d_o < 5e-3 and d_h < 2e-3, \
            f"head {h}: {name} vs {other_name} o {d_o:.2e} state {d_h:.2e}"
        e_o = rel_err(o[:, :, h], ro[:, :, h])
        e_ref = rel_err(o_ref[:, :, h], ro[:, :, h])
        assert e_o < 1.25 * e_ref + 1e-4, f"head {h}: {name} o error {e_o:.2e} vs {e_ref:.2e}"


@pytest.mark.parametrize("cols", ["16", "32", "16s3"])
@pytest.mark.parametrize("seg", [1, 3, 8])
@pytest.mark.parametrize("case", [Case("walk_long", [4000], 1, 4, gate="mixed"),
                                  Case("walk_varlen", [3000, 70, 2200, 640], 2, 8,
                                       gate="mixed")],
                         ids=lambda c: c.name)
def test_tc_walk_matches_scan(case: Case, seg: int, cols: str):
    """The forward's chain as the combine's walk on tensor cores (seg_walk_kernel, the
    default, 16 or 32 columns a block: fp16 split products at fp32's accuracy, M by bulk
    copies two steps ahead, or three: "16s3") against the scan
    (FLASHGDN_CP_WALK=0) and the float64 reference: 63, 21 or 8 segments of 4000 tokens,
    constant maps inside the chain (striped_gate_inputs), packed sequences. The exact heads'
    o and state within the two chains' fp32 rounding of each other (assert_chains_agree, the
    bound test_scan_matches_walk uses), and as accurate as the unsplit pass."""
    inp = striped_gate_inputs(case, seed=31)
    kernel = {"FLASHGDN_FWD_BW": "128"}
    with env_vars({"FLASHGDN_CP": "off", **kernel}):
        o_ref, h_ref = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    split = {"FLASHGDN_CP": "on", "FLASHGDN_CP_SEG": str(seg), **kernel}
    with env_vars({**split, "FLASHGDN_CP_WALK": "0"}):
        o_scan, h_scan = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    walk = {"FLASHGDN_CP_WALK": cols[:2]}
    if cols.endswith("s3"):  # M three steps ahead (FLASHGDN_CP_WALK_STAGES=3)
        walk["FLASHGDN_CP_WALK_STAGES"] = "3"
    with env_vars({**split, **walk}):
        o_walk, h_walk = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    torch.cuda.synchronize()
    ro, rh = reference(inp)
    check_split(f"{case.name} seg {seg} tc walk {cols}", case, o_walk, h_walk, o_ref, h_ref,
                ro, rh)
    assert_chains_agree("tc walk", o_walk, h_walk, "scan", o_scan, h_scan, o_ref, ro)


@pytest.mark.parametrize("walk", ["0", "16"])
def test_scan_levels_do_not_trust_the_hint(walk: str):
    """cu_seqlens_cpu only steers the planner's estimates: a wrong (well-formed) copy that
    claims sequences of 6656 tokens where one has 12288 must not shorten the scan (levels
    from that claim, 6, would leave the later segments' entering states unformed where 7
    are needed: 96 segments of 2 chunks). Forced split at 128 columns: the same plan either
    way, so the same bits, and the reference's accuracy. The scan (FLASHGDN_CP_WALK=0) and
    the tensor-core walk (the default), which walks the device's sequences whatever the
    hint."""
    case = Case("hint_scan", [12288, 1024], 1, 4, gate="mixed")
    inp = make_inputs(case, "cuda", seed=29)
    total = sum(case.lens)
    wrong = torch.tensor([0, total // 2, total], dtype=torch.int64)
    with env_vars({"FLASHGDN_CP": "on", "FLASHGDN_CP_SEG": "2", "FLASHGDN_FWD_BW": "128",
                   "FLASHGDN_CP_WALK": walk}):
        o, ht = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
        o_w, ht_w = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True,
                                                    cu_seqlens_cpu=wrong)
    torch.cuda.synchronize()
    assert torch.equal(o, o_w) and torch.equal(ht, ht_w), "the hint changed the result"
    ro, rh = reference(inp)
    print(f"wrong hint: o {rel_err(o_w, ro):.2e} state {rel_err(ht_w, rh):.2e}")
    assert rel_err(o_w, ro) < O_TOL and rel_err(ht_w, rh) < STATE_TOL


@pytest.mark.parametrize("case,base", [
    (Case("host_choice_cols", [3000, 700, 1800], 2, 8, gate="mixed"), {}),  # the column block
    (Case("host_choice_ov", [12000, 3000, 9000], 2, 8, gate="mixed"), {}),  # overlapped, 4 subs
    # sequential in merged pairs; saturated without the unfused WY term (planner.h
    # ForwardCost::unfused_wy_us) and with FLASHGDN_CP_SAT=1 (ForwardCost::fused_wy), the only
    # way the device's choice reaches it at 16 heads
    (Case("host_choice_seq", [24576, 1536], 4, 16, gate="mixed"), {}),
    (Case("host_choice_sat", [24576, 1536], 4, 16, gate="mixed"),
     {"FLASHGDN_UNFUSED_WY_US": "0", "FLASHGDN_CP_SAT": "1"}),
], ids=lambda c: c.name if isinstance(c, Case) else ("unfused0" if c else "default"))
def test_host_choice_is_the_device_choice(case: Case, base: dict):
    """With cu_seqlens_cpu the choice plan_kernel makes from cu_seqlens (segment length,
    column block, schedule, merge; flashgdn_plan --tokens shows it for these lengths: 32
    columns unsplit, 32-chunk segments overlapped, 28-chunk segments sequential in merged
    pairs, or saturated with --unfused-wy 0) is made on
    the host (device_choice_on_host) and
    plan_kernel only writes it: the same bits as the device's own choice
    (FLASHGDN_HOST_CHOICE=0; the two compute the same fp64 estimates), eagerly and from a
    CUDA graph. A host copy claiming other lengths (well-formed) steers the choice only:
    the reference's accuracy, the g == 0 heads as exact as unsplit; so does the host's own
    choice, which also tries the lengths of exact segment counts (the default)."""
    inp = make_inputs(case, "cuda", seed=53)
    cu_cpu = inp["cu_seqlens"].cpu()
    with cp_env("off"):
        o_ref, h_ref = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    with env_vars({**base, "FLASHGDN_HOST_CHOICE": "0"}):
        o_d, h_d = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True,
                                                   cu_seqlens_cpu=cu_cpu)
    # the device's candidate lengths only, run in the launches made for the device's choice
    # (FLASHGDN_HOST_SCHEDULE=0: a sequential choice is not re-planned without them)
    with env_vars({**base, "FLASHGDN_HOST_SEGS": "0", "FLASHGDN_HOST_SCHEDULE": "0"}):
        o_h, h_h = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True,
                                                   cu_seqlens_cpu=cu_cpu)
        o_g, h_g = forward_from_graph({**inp, "cu_seqlens_cpu": cu_cpu}, replays=2)
    total = sum(case.lens)
    wrong = torch.tensor([0] + [total * (i + 1) // len(case.lens) for i in range(len(case.lens))],
                         dtype=torch.int64)  # equal lengths
    with env_vars(base):
        # the host's own choice (the lengths of exact segment counts too: host_exact)
        o_x, h_x = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True,
                                                   cu_seqlens_cpu=cu_cpu)
        o_w, h_w = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True,
                                                   cu_seqlens_cpu=wrong)
    torch.cuda.synchronize()
    assert torch.equal(o_d, o_h) and torch.equal(h_d, h_h), "host and device choices differ"
    assert torch.equal(o_h, o_g) and torch.equal(h_h, h_g), "graph replay differs"
    ro, rh = reference(inp)
    check_split(f"{case.name} host choice", case, o_h, h_h, o_ref, h_ref, ro, rh)
    check_split(f"{case.name} host's exact counts", case, o_x, h_x, o_ref, h_ref, ro, rh)
    check_split(f"{case.name} wrong host copy", case, o_w, h_w, o_ref, h_ref, ro, rh)


@pytest.mark.parametrize("schedule", ["1", "0"], ids=["default", "off"])
def test_host_schedule(schedule: str):
    """The host schedule (the default; FLASHGDN_HOST_SCHEDULE=0 turns it off): at 2/8 heads x
    4 packed sequences of 8192 tokens the host makes the device's choice from cu_seqlens_cpu,
    a sequential split (flashgdn_plan --hv 8 --tokens 8192,8192,8192,8192), so the overlapped
    launches made for it are dropped and the choice is made again without them; off, the
    device runs its sequential choice in those launches. Either way against CP off and the
    float64 reference, the g == 0 heads as exact as unsplit, also from a CUDA graph."""
    case = Case("host_schedule", [8192] * 4, 2, 8, gate="mixed")
    inp = {**make_inputs(case, "cuda", seed=59)}
    inp["cu_seqlens_cpu"] = inp["cu_seqlens"].cpu()
    check_split_env(f"host schedule {schedule}", case, inp,
                    {"FLASHGDN_CP": "auto", "FLASHGDN_HOST_SCHEDULE": schedule},
                    {"FLASHGDN_CP": "off"})


@pytest.mark.parametrize("case", [
    # 16/16 heads, 2 x 4096 tokens: unsplit by the worst-case estimates, 24-chunk segments
    # overlapped at these lengths (flashgdn_plan --hv 16 --tokens 4096,4096); mixed gates
    # (g == 0 heads: the exact chain), an initial state
    Case("host_split_h16", [4096, 4096], 16, 16, gate="mixed", h0=True),
    # 8/24 heads, 4096 + 4000 tokens (an odd length), fp16, very negative gates: 32-chunk segments
    Case("host_split_h24", [4096, 4000], 8, 24, gate="very_negative", dtype=torch.float16),
], ids=lambda c: c.name)
def test_host_split_plan(case: Case):
    """launch.cu host_split_plan: packed sequences that the planner's worst-case estimates keep
    unsplit take the device-choice plan where the choice at the lengths of cu_seqlens_cpu is a
    split. It splits (the chain's kernels ran; with FLASHGDN_HOST_SPLIT=0 they do not, as
    before), and its o and final state, eagerly and from a CUDA graph, are a split's against
    the float64 reference and the unsplit pass (check_split: g == 0 heads as exact)."""
    inp = {**make_inputs(case, "cuda", seed=103)}
    inp["cu_seqlens_cpu"] = inp["cu_seqlens"].cpu()
    check_split_env(f"host split {case.name}", case, inp, {"FLASHGDN_CP": "auto"},
                    {"FLASHGDN_CP": "off"})
    chain = ("seg_walk_kernel", "seg_combine_kernel", "seg_scan_kernel")
    for env, split in (({}, True), ({"FLASHGDN_HOST_SPLIT": "0"}, False)):
        with env_vars(env):
            names = cuda_kernels_run(
                lambda: flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True))
        assert any(c in n for n in names for c in chain) == split, (env, sorted(names))


@pytest.mark.parametrize("lens", [[12288, 4096], [16384, 16384]], ids=["merge2", "merge4"])
def test_exact_p0_merge_host_choice(lens):
    """planner.cpp exact_p0_merge: with the host copy, a packed batch's phase-0 merge comes
    from its blocks list-scheduled (8/24 heads: 12288 + 4096 tokens in segments of 24 merged
    in pairs, 16384 + 16384 in fours; tests/cpp/test_planner.cpp
    ExactPhaseZeroMergeForPackedSequences). Those plans' o and final state against the
    float64 reference and CP off, eagerly and from a CUDA graph (check_split_env)."""
    case = Case("exact_merge", lens, 8, 24, varlen=True, gate="mixed")
    inp = make_inputs(case, "cuda", seed=127)
    inp["cu_seqlens_cpu"] = inp["cu_seqlens"].cpu()
    check_split_env(f"exact merge 8/24 {lens}", case, inp, {"FLASHGDN_CP": "auto"},
                    {"FLASHGDN_CP": "off"})


def check_list_schedule_plan(case: Case, seed: int, switch: str, env: dict) -> None:
    """A list-scheduled plan (env, with the host copy of cu_seqlens) against the float64
    reference and CP off (check_split_env), then against the whole waves' plan (`switch`=0):
    other bits (so the plan did change; the same plan gives the same bits), no less
    accurate."""
    inp = make_inputs(case, "cuda", seed=seed)
    inp["cu_seqlens_cpu"] = inp["cu_seqlens"].cpu()
    label = f"{case.name} {case.hqk}/{case.hv} {case.lens} {env}"
    check_split_env(label, case, inp, {"FLASHGDN_CP": "auto", **env}, {"FLASHGDN_CP": "off"})
    o0, _, o1, _ = no_less_accurate(inp, {"FLASHGDN_CP": "auto", switch: "0"},
                                    {"FLASHGDN_CP": "auto", **env}, label)
    assert not torch.equal(o0, o1), f"{label}: the same plan as {switch}=0's whole waves"


@pytest.mark.parametrize("lens,hv,env", [
    ([16384], 48, {}),
    ([8192], 48, {"FLASHGDN_P0_LIST": "2"}),
], ids=["h48_16384_default", "h48_8192_no_margin"])
def test_p0_list_plan(lens, hv, env):
    """planner.h ForwardCost::p0_list (the default; FLASHGDN_P0_LIST=0 leaves it out, =2
    drops its margin): phase 0 of one sequence list-scheduled changes the plan of 16/48 heads
    x 16384 tokens (segments of 48, not 33) and, without the margin, of x 8192 (24, not 26;
    tests/cpp/plan_tool.cpp --no-p0-list / --p0-list-any). Those plans' o and final state stand
    against the float64 reference and CP off, eagerly and from a CUDA graph (check_split_env)."""
    check_list_schedule_plan(Case("p0_list", lens, 16, hv, varlen=True, gate="mixed"), 113,
                             "FLASHGDN_P0_LIST", env)


@pytest.mark.parametrize("lens,hv,env", [
    ([6144, 2048], 48, {}),
    ([12288, 4096], 48, {}),
    ([28672, 4096], 24, {"FLASHGDN_HOST_EXACT_P0": "2"}),
], ids=["h48_6144_2048", "h48_12288_4096", "h24_28672_4096_no_margin"])
def test_exact_p0_plan(lens, hv, env):
    """planner.h ForwardCost::exact_p0 (the default; FLASHGDN_HOST_EXACT_P0=0 leaves it out,
    =2 drops its margin): with the host copy, the packed batch's segment length from phase 0's
    blocks: 16/48 heads 6144 + 2048 split in segments of 24 (unsplit without), 12288 + 4096 in
    48 (32 without), and without the margin 8/24 28672 + 4096 in merged threes of 32 (50 in
    pairs with it; flashgdn_plan --no-exact-p0 / --exact-p0-any). o and the final state
    against the float64 reference and CP off, eagerly and from a CUDA graph."""
    check_list_schedule_plan(Case("exact_p0", lens, hv // 3, hv, varlen=True, gate="mixed"),
                             131, "FLASHGDN_HOST_EXACT_P0", env)


@pytest.mark.parametrize("host", [True, False, None], ids=["host_copy", "single", "device"])
def test_unfused_wy_term_takes_the_fused_pass(host):
    """planner.h ForwardCost::unfused_wy_us: at 16 value heads the sequential split forms the
    WY part inside its pass (state_fwd_tma_kernel's kWy) and the one-wave overlapped or the
    device's saturated schedule does not (wy_lean_kernel, then the plain pass). 4/16 heads,
    12288 + 4096 packed tokens with cu_seqlens_cpu (the host's choice: sequential segments of
    32; overlapped segments of 40 without the term) or one 16384-token sequence (sequential
    segments of 32; overlapped segments of 43 without it): the default runs the fused pass;
    FLASHGDN_UNFUSED_WY_US=0 the plain one, as does FLASHGDN_UNFUSED_WY_LONGEST=512 (the term
    from 512 chunks, longer than any sequence here); each against the float64 reference and
    CP off (check_split), eagerly and from a CUDA graph. (device: 2 x 8192 packed tokens
    without the host copy, whose worst case is planned sequential, so no overlapped launches
    are made and the device's sequential choice takes the fused pass.)"""
    lens = [12288, 4096] if host else [8192, 8192] if host is None else [16384]
    case = Case("unfused_wy", lens, 4, 16, varlen=host is not False, gate="mixed")
    inp = {**make_inputs(case, "cuda", seed=107)}
    if host:
        inp["cu_seqlens_cpu"] = inp["cu_seqlens"].cpu()
    for env, fused in (({}, True), ({"FLASHGDN_UNFUSED_WY_US": "0"}, False),
                       ({"FLASHGDN_UNFUSED_WY_LONGEST": "512"}, False)):
        check_split_env(f"unfused wy {env}", case, inp, {"FLASHGDN_CP": "auto", **env},
                        {"FLASHGDN_CP": "off"})
        with env_vars(env):
            names = cuda_kernels_run(
                lambda: flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True))
        assert any("state_fwd_tma_kernel" in n for n in names) == fused, (env, sorted(names))


@pytest.mark.parametrize("case", [
    # 8/24 heads, no host copy: the device splits in 24-chunk segments, phase 0 merged in
    # pairs, on looped slots (flashgdn_plan --hv 24 --tokens 6000,5000,3000 --no-hint)
    Case("looped_h24_merge", [6000, 5000, 3000], 8, 24, gate="mixed"),
    # 8/24, two sequences (segments unmerged), fp16 inputs, an initial state
    Case("looped_h24", [9000, 7000], 8, 24, gate="zero_heads", dtype=torch.float16),
    # 16/48: the device keeps it unsplit, so phase 0's slots walk one segment a sequence
    Case("looped_h48_unsplit", [6000, 5000, 3000], 16, 48, gate="mixed"),
    # 8/32: a wave of slots a head fills 128 of 132 SMs, so no flat walk (launch.cu flat_heads)
    Case("looped_h32", [6000, 5000, 3000], 8, 32, gate="mixed"),
], ids=lambda c: c.name)
def test_looped_phase0_walk(case: Case):
    """Without the host copy of cu_seqlens, the looped phase 0 of the 128-column forward: o
    and the final state against the float64 reference and CP off, eagerly and from a CUDA
    graph. Where the pass forms P (kWy 1) and a wave of slots a head would leave more than
    5% of the SMs idle, one wave of slots walks every head's (group, head) pairs
    (state_fwd_tma_kernel's kFlat, launch.cu flat_heads): a kernel of its own, with the bits
    of a wave a head (FLASHGDN_FLAT_HEADS=0). The 48-head case must take it (96 of 132 SMs
    a head's way), the 32-head case must not (128 of 132), on an H100 / H200's 132 SMs."""
    inp = make_inputs(case, "cuda", seed=109)
    label = f"looped phase 0 {case.name}"
    check_split_env(label, case, inp, {"FLASHGDN_CP": "auto"}, {"FLASHGDN_CP": "off"})

    def run():
        return flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)

    flat = {n for n in cuda_kernels_run(run) if "state_fwd_tma_kernel" in n}
    with env_vars({"FLASHGDN_FLAT_HEADS": "0"}):
        per_head = {n for n in cuda_kernels_run(run) if "state_fwd_tma_kernel" in n}
    print(f"{label}: flat walk {sorted(flat - per_head)}, a wave a head {sorted(per_head)}")
    if torch.cuda.get_device_properties(0).multi_processor_count == 132:
        if case.name == "looped_h48_unsplit":
            assert flat != per_head and len(flat) == len(per_head), (flat, per_head)
        if case.name == "looped_h32":
            assert flat == per_head, (flat, per_head)
    forward_bit_identical(inp, {"FLASHGDN_FLAT_HEADS": "0"}, {"FLASHGDN_FLAT_HEADS": "1"},
                          f"{label} flat walk")


def state_kernels(names: set) -> set:
    """The forward state passes' kernels among the names cuda_kernels_run found."""
    return {n for n in names if "state_fwd_f16_kernel" in n or "state_fwd_cols_kernel" in n}


def test_host_pins_the_column_block():
    """With cu_seqlens_cpu the host makes the device's choice of column block and the plan
    takes it (launch.cu plan_forward): 2/8 heads, 3000 + 700 + 1800 tokens, 32 columns
    unsplit (flashgdn_plan --hv 8 --tokens 3000,700,1800: the device picks among 32 and
    128). The 128-column kernel the device's choice also launches (FLASHGDN_HOST_COLS=0, to
    return at once) is not launched; o and the final state equal the device's choice bit for
    bit, eagerly and from a CUDA graph, within the float64 reference's tolerance."""
    case = Case("host_cols_32", [3000, 700, 1800], 2, 8, gate="mixed")
    inp = {**make_inputs(case, "cuda", seed=67)}
    inp["cu_seqlens_cpu"] = inp["cu_seqlens"].cpu()

    def run():
        return flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)

    with env_vars({"FLASHGDN_HOST_COLS": "0"}):
        dev_state = state_kernels(cuda_kernels_run(run))
    host_state = state_kernels(cuda_kernels_run(run))
    print(f"device's choice launches {sorted(dev_state)}; pinned {sorted(host_state)}")
    assert any("state_fwd_cols_kernel" in n for n in dev_state), "no column choice to pin"
    assert host_state and all("state_fwd_f16_kernel" in n for n in host_state)
    assert host_state < dev_state
    forward_bit_identical(inp, {"FLASHGDN_HOST_COLS": "0"}, {}, "host cols 32")


def test_plan_cache_keys():
    """launch.cu caches plan_forward's plans; the key holds the host's lengths and the
    switches. Two packings of the same 5500 tokens in three sequences at 2/8 heads plan
    differently (flashgdn_plan --hv 8 --tokens 3000,700,1800: 32 columns unsplit;
    5400,50,50: 128 columns split), and the second, run after the first, must launch what it
    launches with the cache off (FLASHGDN_PLAN_CACHE=0), with the same bits; a switch set
    after a cached call (FLASHGDN_CP=off) must change what the split plan launches."""
    names = {}
    for lens in ([3000, 700, 1800], [5400, 50, 50]):
        case = Case(f"cache_{lens[0]}", lens, 2, 8, gate="mixed")
        inp = make_inputs(case, "cuda", seed=71)
        inp["cu_seqlens_cpu"] = inp["cu_seqlens"].cpu()

        def run():
            return flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)

        run()  # cached from here
        cached = cuda_kernels_run(run)
        with env_vars({"FLASHGDN_PLAN_CACHE": "0"}):
            uncached = cuda_kernels_run(run)
        with env_vars({"FLASHGDN_CP": "off"}):
            off = cuda_kernels_run(run)  # no split: no chain kernels
        print(f"{lens}: cached {sorted(cached)}; CP off {sorted(off)}")
        assert cached == uncached, (lens, cached, uncached)
        names[lens[0]] = cached
        if lens[0] == 5400:
            assert off != cached, (lens, off)
        forward_bit_identical(inp, {"FLASHGDN_PLAN_CACHE": "0"}, {}, f"plan cache {lens}")
    assert names[3000] != names[5400], names


@pytest.mark.parametrize("host", [True, False], ids=["host_copy", "device_only"])
@pytest.mark.parametrize("case", [
    # two value heads a q/k head, a sequential split at 128 columns (flashgdn_plan --hv 16
    # --tokens 8192,8192: segments of 32; looped slots)
    Case("packed_kq_seq", [8192, 8192], 8, 16, gate="mixed"),
    # one value head a q/k head, the overlapped launches (--hv 8 --tokens 12000,3000)
    Case("packed_kq_ov", [12000, 3000], 8, 8, gate="mixed"),
], ids=lambda c: c.name)
def test_packed_split_without_column_choice(case: Case, host: bool):
    """Packed sequences whose split only the 128-column pass can win: the planner leaves the
    column block to no one (planner.cpp), so the pass converts the bf16 k and q tiles itself
    (kq_in_pass; FLASHGDN_DEBUG=256 poisons wy's fp16 copies), with or without the host copy
    of cu_seqlens; with it, the looped passes launch the host's count of the chosen segments
    as slots (SegmentPlan::host_segments). Bit for bit against wy's copies
    (FLASHGDN_KQ_COPIES=1) and a wave of slots (FLASHGDN_HOST_COLS=2), eagerly and from a
    CUDA graph, within the float64 reference's tolerance; a host copy claiming other
    (well-formed) lengths only steers the choice: the reference's accuracy."""
    inp = {**make_inputs(case, "cuda", seed=71)}
    if host:
        inp["cu_seqlens_cpu"] = inp["cu_seqlens"].cpu()
    forward_bit_identical(inp, {"FLASHGDN_KQ_COPIES": "1", "FLASHGDN_HOST_COLS": "2"},
                          {"FLASHGDN_DEBUG": "256"}, f"packed kq {case.name} host {host}")
    if host:
        total = sum(case.lens)
        wrong = torch.tensor([0, 64, total], dtype=torch.int64)  # one short, one long
        o_w, h_w = flashgdn.chunk_gated_delta_rule(**{**inp, "cu_seqlens_cpu": wrong},
                                                   output_final_state=True)
        ro, rh = reference(inp)
        print(f"wrong host copy: o {rel_err(o_w, ro):.2e} state {rel_err(h_w, rh):.2e}")
        assert rel_err(o_w, ro) < O_TOL and rel_err(h_w, rh) < STATE_TOL


def off_and_auto(case: Case, seed: int):
    """A case's inputs and its forward (o, final state) with CP off, then in auto mode."""
    inp = make_inputs(case, "cuda", seed=seed)
    with cp_env("off"):
        o_ref, h_ref = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    with cp_env("auto"):
        o, ht = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    return inp, o_ref, h_ref, o, ht


def test_cp_auto_engages_on_long_single_sequence():
    """Auto mode on a TP8-sized input (2/8 heads, 8192 tokens) splits the sequence; the
    result must equal the unsplit pass within rounding, as exact on g == 0 heads."""
    case = Case("auto", [8192], 2, 8, gate="mixed")
    inp, o_ref, h_ref, o, ht = off_and_auto(case, seed=12)
    # the plan (csrc/planner.h) splits 128 chunks into 7 segments of 19 on the overlapped
    # schedule: the later segments of the g == 0 heads chain transitions, which rounds
    # differently from the unsplit pass
    assert not torch.equal(ht, h_ref), "auto mode did not split (state bit-equal to unsplit)"
    assert rel_err(o, o_ref) < 2e-3 and rel_err(ht, h_ref) < 1e-3
    ro, rh = reference(inp)
    for h in range(0, 8, 4):
        assert_as_exact(h, o, ht, o_ref, h_ref, ro, rh)


@pytest.mark.parametrize("case", [
    Case("reach_h32", [8192], 8, 32, gate="mixed"),
    Case("reach_h16", [8192], 4, 16, varlen=False, gate="zero_heads"),  # fixed length
    Case("reach_h64", [4096], 16, 64, gate="mixed", dtype=torch.float16),
], ids=lambda c: c.name)
def test_reach_segments_default(case: Case):
    """The planner's 16-chunk sequential splits (ForwardCost::reach_seg_longest, SegmentPlan::
    exact_reach; test_planner.cpp ReachSegments): one sequence of 64-128 chunks at 16-64
    value heads plans them by default, and a segment whose warm-up would reach the
    sequence's start (the second, on the g == 0 heads) starts exact from the chain. The
    default's bits are those of the same split forced (FLASHGDN_CP_SEG=16 with
    FLASHGDN_EXACT_REACH=1: the default took it), not those of the plan before it
    (FLASHGDN_REACH_SEG=0); eager equals a CUDA graph's replay; the float64 reference's
    accuracy, the g == 0 heads as exact as unsplit."""
    inp, o_ref, h_ref, o, ht = off_and_auto(case, seed=58)
    with env_vars({"FLASHGDN_CP_SEG": "16", "FLASHGDN_EXACT_REACH": "1"}):
        o_f, h_f = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    with env_vars({"FLASHGDN_REACH_SEG": "0"}):
        o_b, h_b = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    o_g, h_g = forward_from_graph(inp, replays=2)
    torch.cuda.synchronize()
    if torch.cuda.get_device_properties(0).multi_processor_count == 132:  # (the plans' SMs)
        assert torch.equal(o, o_f) and torch.equal(ht, h_f), "the default is not the 16-chunk split"
        assert not torch.equal(ht, h_b), "the plan before the 16-chunk splits gave the same bits"
    assert torch.equal(o, o_g) and torch.equal(ht, h_g), "graph replay differs"
    ro, rh = reference(inp)
    print(f"{case.name}: o {rel_err(o, ro):.2e} state {rel_err(ht, rh):.2e} (before: "
          f"{rel_err(o_b, ro):.2e} {rel_err(h_b, rh):.2e})")
    assert rel_err(o, ro) < O_TOL and rel_err(ht, rh) < STATE_TOL
    for h in range(0, case.hv, 4):
        assert_as_exact(h, o, ht, o_ref, h_ref, ro, rh)


def test_saturated_overlap_opt_in():
    """FLASHGDN_CP_SAT=1 (planner.h estimate_saturated_overlap_us): on 132 SMs 8/32 heads x
    8192 tokens keep the sequential plan's 4 segments of 32 chunks (128 blocks of 128 columns
    plus the exact heads' 48 summaries: more than a wave) and run the warm-started ones
    beside the exact heads' chain, without sub-segments (test_planner.cpp,
    SaturatedOverlapAtTheSequentialSegments). The same blocks at the same segments: the
    default's bits (where the SM count gives both the same segments) and the float64
    reference's accuracy, as exact as unsplit on the g == 0 heads, also from a CUDA graph."""
    case = Case("saturated", [8192], 8, 32, gate="mixed")
    # (without the planner's 16-chunk splits, which take this row since session 58 and are
    # never made saturated: test_reach_segments_default)
    with env_vars({"FLASHGDN_REACH_SEG": "0"}):
        inp, o_ref, h_ref, o, ht = off_and_auto(case, seed=31)
    with env_vars({"FLASHGDN_CP_SAT": "1", "FLASHGDN_REACH_SEG": "0"}):
        o_s, h_s = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
        o_g, h_g = forward_from_graph(inp, replays=2)
    torch.cuda.synchronize()
    assert torch.equal(o_s, o_g) and torch.equal(h_s, h_g), "graph replay differs"
    if torch.cuda.get_device_properties(0).multi_processor_count == 132:
        assert torch.equal(o, o_s) and torch.equal(ht, h_s), "saturated schedule changed bits"
    ro, rh = reference(inp)
    print(f"saturated: o {rel_err(o_s, ro):.2e} state {rel_err(h_s, rh):.2e}")
    assert rel_err(o_s, ro) < O_TOL and rel_err(h_s, rh) < STATE_TOL
    for h in range(0, 32, 4):
        assert_as_exact(h, o_s, h_s, o_ref, h_ref, ro, rh)


@pytest.mark.parametrize("case", [Case("sat_packed", [24576, 1536], 4, 16, gate="mixed"),
                                  Case("sat_packed3", [9000, 3000, 20000], 4, 16,
                                       gate="mixed")],
                         ids=lambda c: c.name)
def test_saturated_overlap_device_plan(case: Case):
    """FLASHGDN_CP_SAT=1 with packed sequences: the host makes the overlapped launches
    without sub-segments (one sequence of all the chunks takes the saturated schedule) and
    the device's plan (choose_plan) may put its best sequential split on that schedule,
    the exact segments a block each, not looped. Against CP off and the float64 reference,
    as exact as unsplit on the g == 0 heads, also from a CUDA graph."""
    inp = make_inputs(case, "cuda", seed=47)
    check_split_env(f"{case.name} saturated", case, inp,
                    {"FLASHGDN_CP": "auto", "FLASHGDN_CP_SAT": "1"}, {"FLASHGDN_CP": "off"})


def test_cp_auto_takes_correction_on_short_tp_sequence():
    """Auto mode at 2/8 heads x 4096 tokens (64 chunks: no split paid before the exact outputs
    by correction) takes the correction plan, segments of 24 chunks at 32 columns on the
    overlapped schedule (csrc/planner.h estimate_corr_us): bit-identical to that plan
    forced, different from the unsplit pass, as exact on g == 0 heads; with
    FLASHGDN_CP_CORR=0 and 128-column segments under 32 chunks only from 128-chunk sequences
    (FLASHGDN_CP_SHORT_LONGEST=128) the planner keeps the unsplit pass (bit-identical to CP
    off); with FLASHGDN_CP_CORR=0 alone it splits at 128 columns (kMinShortSegLongest)."""
    case = Case("auto_corr", [4096], 2, 8, gate="mixed")
    inp, o_ref, h_ref, o, ht = off_and_auto(case, seed=14)
    with env_vars({"FLASHGDN_CP": "on", "FLASHGDN_CP_SEG": "24", "FLASHGDN_FWD_BW": "32",
                   "FLASHGDN_CP_CORR": "1", "FLASHGDN_CP_OVERLAP": "1"}):
        o_f, ht_f = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    with env_vars({"FLASHGDN_CP_CORR": "0", "FLASHGDN_CP_SHORT_LONGEST": "128"}):
        o_0, ht_0 = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    with env_vars({"FLASHGDN_CP_CORR": "0"}):
        o_s, ht_s = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    torch.cuda.synchronize()
    assert torch.equal(o, o_f) and torch.equal(ht, ht_f), "auto mode did not take the plan"
    assert not torch.equal(ht, h_ref), "auto mode did not split (state bit-equal to unsplit)"
    assert torch.equal(o_0, o_ref) and torch.equal(ht_0, h_ref)
    assert not torch.equal(ht_s, h_ref), "CORR=0 did not split at 128 columns"
    ro, rh = reference(inp)
    check_split("auto corr 2/8 x 4096", case, o, ht, o_ref, h_ref, ro, rh)
    check_split("auto corr=0 2/8 x 4096", case, o_s, ht_s, o_ref, h_ref, ro, rh)


def forward_from_graph(inp: dict, replays: int):
    """o and the final state of the forward captured in a CUDA graph (after a warm-up call on
    a side stream, under the switches in force) and replayed `replays` times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, h_g = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return o_g, h_g


def forward_pair(inp: dict, first_env: dict, second_env: dict, label: str):
    """o and the final state under first_env (eagerly), then under second_env eagerly and
    from a CUDA graph (two replays), the graph's equal to the eager call's bit for bit:
    (o, final state) of the first, then of the second's eager call."""
    with env_vars(first_env):
        o0, h0 = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    with env_vars(second_env):
        o1, h1 = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
        o_g, h_g = forward_from_graph(inp, replays=2)
    torch.cuda.synchronize()
    assert torch.equal(o1, o_g) and torch.equal(h1, h_g), f"{label}: graph replay differs"
    return o0, h0, o1, h1


def no_less_accurate(inp: dict, base_env: dict, new_env: dict, label: str):
    """forward_pair under base_env and new_env (eager, and new_env from a CUDA graph equal to
    its eager call): the new switches' o and final state within the float64 reference's
    tolerance and no less accurate than base_env's (errors at most 10% above, + 1e-4);
    (o, final state) of base_env, then of new_env."""
    o0, h0, o1, h1 = forward_pair(inp, base_env, new_env, label)
    ro, rh = reference(inp)
    e0o, e0h, e1o, e1h = rel_err(o0, ro), rel_err(h0, rh), rel_err(o1, ro), rel_err(h1, rh)
    print(f"{label}: o {e1o:.2e} (default {e0o:.2e}) state {e1h:.2e} (default {e0h:.2e})")
    assert e1o < O_TOL and e1h < STATE_TOL
    assert e1o <= 1.1 * e0o + 1e-4 and e1h <= 1.1 * e0h + 1e-4
    return o0, h0, o1, h1


def forward_bit_identical(inp: dict, ref_env: dict, new_env: dict, what: str,
                          check_reference: bool = True):
    """o and the final state under the switches new_env equal those under ref_env bit for
    bit, eagerly and from a CUDA graph (two replays), and (check_reference) lie within the
    float64 reference's tolerance; new_env's eager (o, final state) are returned."""
    o0, h0, o1, h1 = forward_pair(inp, ref_env, new_env, what)
    assert torch.equal(o0, o1) and torch.equal(h0, h1), f"{what} differs"
    if check_reference:
        ro, rh = reference(inp)
        print(f"{what}: o {rel_err(o1, ro):.2e} state {rel_err(h1, rh):.2e}")
        assert rel_err(o1, ro) < O_TOL and rel_err(h1, rh) < STATE_TOL
    return o1, h1


def test_cp_under_cuda_graph():
    case = Case("graph", [2000, 700], 2, 8, gate="mixed")
    inp = make_inputs(case, "cuda", seed=13)
    with cp_env("on", 3):
        o_eager, h_eager = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
        o_g, h_g = forward_from_graph(inp, replays=3)
    assert torch.equal(o_g, o_eager) and torch.equal(h_g, h_eager)


@pytest.mark.parametrize("bw", ["32", "128"])
@pytest.mark.parametrize("case", [CP_CASES[1], CP_CASES[5], CP_CASES[6]], ids=lambda c: c.name)
def test_overlap_bit_identical(case: Case, bw: str):
    """FLASHGDN_CP_OVERLAP=1: the phase-0 blocks of segments that start from h0 or a warm-up
    run on the caller's stream beside the exact heads' chain (phase 1, combine, exact
    phase 0) on a second stream. The same blocks do the same arithmetic: o and the final
    state equal the sequential schedule's bit for bit (varlen mixes, grouped heads, g == 0
    and very negative gates, h0), eagerly and replayed from a CUDA graph. Phase 0 in the
    plan's segments on both (FLASHGDN_CP_P0_MERGE=1: a merged block carries its state past
    a segment's start, which the overlapped launches, a block a segment, do not)."""
    inp = make_inputs(case, "cuda", seed=11)
    split = {"FLASHGDN_CP": "on", "FLASHGDN_CP_SEG": "2", "FLASHGDN_FWD_BW": bw,
             "FLASHGDN_CP_P0_MERGE": "1"}
    with env_vars(split):
        o, ht = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    with env_vars({**split, "FLASHGDN_CP_OVERLAP": "1"}):
        o2, ht2 = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
        torch.cuda.synchronize()
        assert torch.equal(o, o2) and torch.equal(ht, ht2), "overlap differs (eager)"
        o_g, h_g = forward_from_graph(inp, replays=3)
    assert torch.equal(o, o_g) and torch.equal(ht, h_g), "overlap differs (graph)"


def test_overlap_bit_identical_backward(monkeypatch):
    """The backward with FLASHGDN_CP_OVERLAP=1 (its recomputation of the forward pass and
    its reverse pass over dS, each split in two streams): every gradient equal to the
    sequential schedule's bit for bit."""
    from test_backward import run_grads
    case = Case("overlap_bwd", [3000, 300], 1, 4, gate="mixed")
    monkeypatch.setenv("FLASHGDN_CP", "on")
    monkeypatch.setenv("FLASHGDN_CP_SEG", "2")
    names, dflt, _, _ = run_grads(case, "cuda", seed=17)
    monkeypatch.setenv("FLASHGDN_CP_OVERLAP", "1")
    _, ov, _, _ = run_grads(case, "cuda", seed=17)
    for n, a, b in zip(names, ov, dflt):
        assert torch.equal(a, b), f"d{n} differs with FLASHGDN_CP_OVERLAP=1"


_UNSPLIT: dict = {}


def _unsplit_and_reference(case: Case):
    """Inputs (seed 11), the unsplit 128-column pass and the float64 reference of a case,
    computed once per case for the parametrised tests below."""
    if case.name not in _UNSPLIT:
        inp = make_inputs(case, "cuda", seed=11)
        with env_vars({"FLASHGDN_CP": "off", "FLASHGDN_FWD_BW": "128"}):
            o_ref, h_ref = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
        _UNSPLIT[case.name] = (inp, o_ref, h_ref, *reference(inp))
    return _UNSPLIT[case.name]


@pytest.mark.parametrize("overlap", ["0", "1"])
@pytest.mark.parametrize("nsub", ["2", "3", "4"])
@pytest.mark.parametrize("case", [CP_CASES[1], CP_CASES[2], CP_CASES[3], CP_CASES[5],
                                  CP_CASES[6]], ids=lambda c: c.name)
def test_subsegments(case: Case, nsub: str, overlap: str):
    """FLASHGDN_CP_SUB=<n>: phase 0 of every exact segment runs as n sub-segments, each its
    own block of the 128-column kernel, from S_c = M_c S_in + L_c (phase 1 records M_c and
    L_c at the sub-segments' starts, sub_start_kernel forms S_c after the combine). Segments
    of 8 chunks give sub-segments of 4, 3 and 2 chunks (the last one shorter, or absent in a
    short last segment). Against the reference and the unsplit pass; the g == 0 heads as
    exact as unsplit; with and without FLASHGDN_CP_OVERLAP."""
    inp, o_ref, h_ref, ro, rh = _unsplit_and_reference(case)
    with env_vars({"FLASHGDN_CP": "on", "FLASHGDN_CP_SEG": "8", "FLASHGDN_FWD_BW": "128",
                   "FLASHGDN_CP_SUB": nsub, "FLASHGDN_CP_OVERLAP": overlap}):
        o, ht = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    torch.cuda.synchronize()
    check_split(f"{case.name} sub={nsub} overlap={overlap}", case, o, ht, o_ref, h_ref, ro, rh)


def test_overlapped_schedule_auto_and_graph():
    """CP auto at 2/8 heads x 8192 tokens takes the overlapped schedule (its blocks fit in one
    wave beside each other; tests/cpp/test_planner.cpp): the exact (g == 0) heads' phase 0
    runs as 4 sub-segments, so their bits differ from the sequential schedule's
    (FLASHGDN_CP_OVERLAP=0) while both meet the reference's tolerance and the g == 0 heads
    stay as exact as unsplit; eager and replayed from a CUDA graph give the same bits. The
    sequential schedule runs at the planner's segment length (7 segments of 19 chunks, which
    only the overlapped schedule takes by itself: FLASHGDN_CP_SEG with auto forces it)."""
    case = Case("overlap_auto", [8192], 2, 8, gate="mixed")
    inp = make_inputs(case, "cuda", seed=5)
    with env_vars({}):
        o, ht = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
        o_g, h_g = forward_from_graph(inp, replays=1)
    with env_vars({"FLASHGDN_CP_OVERLAP": "0", "FLASHGDN_CP_SEG": "19"}):
        o_seq, h_seq = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    with env_vars({"FLASHGDN_CP": "off", "FLASHGDN_FWD_BW": "128"}):
        o_ref, h_ref = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    assert torch.equal(o, o_g) and torch.equal(ht, h_g)
    assert not torch.equal(ht[:, 0], h_seq[:, 0]), "the exact head ran no sub-segments"
    assert torch.equal(ht[:, 1], h_seq[:, 1]), "a warm-started head changed"
    ro, rh = reference(inp)
    for a, b in ((o, ht), (o_seq, h_seq)):
        assert rel_err(a, ro) < O_TOL and rel_err(b, rh) < STATE_TOL
    for h in range(0, case.hv, 4):
        assert_as_exact(h, o, ht, o_ref, h_ref, ro, rh)


def test_cp_auto_varlen_device_choice():
    """Packed sequences: the host cannot see the lengths, so plan_kernel picks the split on
    the device. Four equal 8192-token sequences at 16/32 heads already fill the GPU (128
    blocks of 128 columns): no split (bit-equal to CP off). One 28672-token sequence next to
    a 4096-token one at 2/8 heads: split."""
    case = Case("equal", [8192] * 4, 16, 32, gate="mixed")
    inp, o_ref, h_ref, o, ht = off_and_auto(case, seed=14)
    assert torch.equal(o, o_ref) and torch.equal(ht, h_ref), "split equal-length sequences"

    case = Case("skewed", [28672, 4096], 2, 8, gate="mixed")
    inp, o_ref, h_ref, o, ht = off_and_auto(case, seed=15)
    assert not torch.equal(ht, h_ref), "auto mode did not split the 28672-token sequence"
    assert rel_err(o, o_ref) < 2e-3 and rel_err(ht, h_ref) < 2e-3
    ro, rh = reference(inp)
    assert rel_err(o, ro) < O_TOL and rel_err(ht, rh) < STATE_TOL
    for h in range(0, 8, 4):
        assert_as_exact(h, o, ht, o_ref, h_ref, ro, rh)


def test_overlapped_schedule_on_the_devices_split():
    """Packed sequences whose split plan_kernel picks (no host copy of cu_seqlens): with
    FLASHGDN_CP_OVERLAP=1 the overlapped schedule runs on the device's segments (the host
    launches both streams before the device has chosen; which blocks work is the device's
    plan). Without sub-segments it must equal the sequential schedule bit for bit; with 4
    sub-segments it must meet the reference's tolerance, the g == 0 heads as exact as
    unsplit."""
    case = Case("skewed_overlap", [7168, 1024], 2, 8, gate="mixed")
    inp = make_inputs(case, "cuda", seed=16)
    with cp_env("off"):
        o_ref, h_ref = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    with env_vars({"FLASHGDN_CP_OVERLAP": "0"}):
        o_seq, h_seq = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    with env_vars({"FLASHGDN_CP_OVERLAP": "1", "FLASHGDN_CP_SUB": "1"}):
        o_ov, h_ov = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    with env_vars({"FLASHGDN_CP_OVERLAP": "1", "FLASHGDN_CP_SUB": "4"}):
        o_sub, h_sub = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    torch.cuda.synchronize()
    assert not torch.equal(h_seq, h_ref), "the device did not split the 7168-token sequence"
    assert torch.equal(o_ov, o_seq) and torch.equal(h_ov, h_seq)
    ro, rh = reference(inp)
    check_split("device split, overlapped, 4 sub-segments", case, o_sub, h_sub, o_ref, h_ref,
                ro, rh)


def test_device_chooses_the_schedule():
    """Packed sequences at few heads (SegmentPlan::device_overlap): the host launches the
    overlapped schedule (two streams, 4 sub-segments) and plan_kernel picks, with the split,
    overlapped or sequential. 7168 + 1024 tokens at 2/8 heads: overlapped (the exact head's
    bits differ from the sequential schedule's by its sub-segments; warm-started heads equal
    them), within the reference's tolerance, g == 0 heads as exact as unsplit, eager equal
    to a CUDA graph's replay. 12288 + 13 x 512 at 2/8 heads: the overlapped launches too, but
    the device's cost model picks the sequential split under them (simulated on the host
    with planner.h: segments of 24 chunks, 330 us against 340 overlapped in segments of
    64; 12288 + 8 x 512, this test's case before 2026-11-25, now runs overlapped): bit for
    bit the sequential schedule's (FLASHGDN_CP_OVERLAP=0)."""
    def run(case: Case, seed: int):
        """inputs; CP auto eager and from a graph; the sequential schedule's; CP off's"""
        inp = make_inputs(case, "cuda", seed=seed)
        with env_vars({}):
            auto = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
            graph = forward_from_graph(inp, replays=2)
        with env_vars({"FLASHGDN_CP_OVERLAP": "0"}):
            seq = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
        with cp_env("off"):
            off = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
        torch.cuda.synchronize()
        assert torch.equal(auto[0], graph[0]) and torch.equal(auto[1], graph[1]), \
            f"{case.name}: graph replay differs"
        return inp, auto, seq, off

    case = Case("device_schedule", [7168, 1024], 2, 8, gate="mixed")
    inp, (o, ht), (_, h_seq), (o_ref, h_ref) = run(case, 18)
    assert not torch.equal(ht[:, 0], h_seq[:, 0]), "the exact head ran no sub-segments"
    assert torch.equal(ht[:, 1], h_seq[:, 1]), "a warm-started head changed"
    ro, rh = reference(inp)
    check_split("device-chosen overlapped schedule", case, o, ht, o_ref, h_ref, ro, rh)

    case = Case("device_sequential", [12288] + [512] * 13, 2, 8, gate="mixed")
    _, (o, ht), (o_seq, h_seq), (_, h_off) = run(case, 19)
    assert not torch.equal(h_seq, h_off), "the device did not split the 12288-token sequence"
    assert torch.equal(o, o_seq) and torch.equal(ht, h_seq), "sequential choice differs"


# ---- the backward's reverse pass over dS, split like the forward (issue 4, part 3)

BWD_CASES = [CP_CASES[0], CP_CASES[1], CP_CASES[2], CP_CASES[3], CP_CASES[5]]


def _grads(case: Case, mode: str, seg: int = 0):
    from test_backward import run_grads
    with cp_env(mode, seg):
        names, ours, refs, _ = run_grads(case, "cuda", seed=31)
    torch.cuda.synchronize()
    return names, ours, refs


@pytest.mark.parametrize("seg", [2, 5])
@pytest.mark.parametrize("case", BWD_CASES, ids=lambda c: c.name)
def test_cp_backward_matches_unsplit_and_reference(case: Case, seg: int):
    """Every gradient with the reverse pass split into segments of `seg` chunks agrees with
    the unsplit pass within rounding and meets the reference tolerance; on g == 0 heads the
    per-head gradients (dv, dg, dbeta, dh0) are as accurate as without the split."""
    from test_backward import GRAD_TOL
    names, split, refs = _grads(case, "on", seg)
    _, unsplit, _ = _grads(case, "off")
    zero_heads = zero_gate_heads(case)
    for n, a, b, r in zip(names, split, unsplit, refs):
        e, e_off, d = rel_err(a, r), rel_err(b, r), rel_err(a, b)
        print(f"{case.name} seg={seg} d{n}: vs ref {e:.2e} (unsplit {e_off:.2e}), "
              f"vs unsplit {d:.2e}")
        assert e < GRAD_TOL, f"d{n}: {e:.3e} against the reference"
        assert d < 3e-3, f"d{n}: split differs from unsplit by {d:.3e}"
        head_dim = {"v": 2, "g": 2, "beta": 2, "initial_state": 1}.get(n)
        for h in zero_heads if head_dim is not None else []:
            eh = rel_err(a.select(head_dim, h), r.select(head_dim, h))
            eh_off = rel_err(b.select(head_dim, h), r.select(head_dim, h))
            assert eh < 1.25 * eh_off + 1e-4, \
                f"d{n} head {h} (g == 0): {eh:.3e} split vs {eh_off:.3e} unsplit"


@pytest.mark.parametrize("bw", ["32", "128"])
def test_more_segments_than_threads(bw: str):
    """seg_combine_kernel decides which segments start exact for up to 256 segments at
    once, one per thread, before its sequential walk: one-chunk segments give a sequence of
    524 segments (three batches of decisions, the last partial) next to a short one. Against
    the unsplit pass and the reference, the g == 0 head as exact as unsplit."""
    case = Case("many_segments", [33500, 700], 1, 2, gate="mixed")
    inp = make_inputs(case, "cuda", seed=13)
    with env_vars({"FLASHGDN_CP": "off", "FLASHGDN_FWD_BW": bw}):
        o_ref, h_ref = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    split = {"FLASHGDN_CP": "on", "FLASHGDN_CP_SEG": "1", "FLASHGDN_FWD_BW": bw}
    with env_vars(split):
        o, ht = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    ro, rh = reference(inp)
    check_split(f"524 segments BW {bw}", case, o, ht, o_ref, h_ref, ro, rh)  # head 0: g == 0


# Twelve split sequences between twenty that fit one segment (~8600 tokens, 2/8 heads,
# segments of two chunks: ~90 segments, ~70 of them in split sequences). Split plans of
# several packed sequences launch a few slots that walk the device's lists (SegParams::looped): at 8
# value heads on 132 SMs the combine has 4 sequence slots for the 12 split sequences, the
# 32-column phase 1 8 slots and phase 0 4, the 128-column phase 1 33 and phase 0 16, so
# slots walk several items and skip the unsplit sequences.
MANY_SPLIT = Case("many_split", [v for i in range(12) for v in (130 + 97 * i, 5 + 9 * i)]
                  + [60] * 8, 2, 8, gate="mixed")


@pytest.mark.parametrize("bw", ["32", "128"])
def test_slots_walk_listed_segments(bw: str):
    """Packed split plans: the state pass's slots walk the segments (phase 1 only those of
    split sequences) and seg_combine_kernel's slots the split sequences, several items a
    slot. Against the unsplit pass and the reference, the g == 0 heads as exact as
    unsplit."""
    inp = make_inputs(MANY_SPLIT, "cuda", seed=19)
    with env_vars({"FLASHGDN_CP": "off", "FLASHGDN_FWD_BW": bw}):
        o_ref, h_ref = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    with env_vars({"FLASHGDN_CP": "on", "FLASHGDN_CP_SEG": "2", "FLASHGDN_FWD_BW": bw}):
        o, ht = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    ro, rh = reference(inp)
    check_split(f"12 split sequences BW {bw}", MANY_SPLIT, o, ht, o_ref, h_ref, ro, rh)


# 70 short packed sequences (1-400 tokens): the sequence of a segment is found among 70,
# two rounds of the warp's 32-way search (locate_segment_warp)
MANY_SHORT = Case("many_short", [1 + (37 * i * i + 11 * i) % 400 for i in range(70)], 2, 8,
                  gate="mixed")


@pytest.mark.parametrize("tma", ["0", "1", "4", "5"])
@pytest.mark.parametrize("plan", ["many_short", "many_split", "one_long"])
def test_warp_lookup_bit_identical(plan: str, tma: str):
    """The 128-column passes find their segment by a whole warp (segment_block's kWarp: the
    plan's scalars in one round trip, a 32-way search over seg_offsets), and the TMA pass by
    one warp ahead of its first barrier for every role (lookup_segment_block); with
    FLASHGDN_DEBUG=4096 each role does the binary search after the barrier, as before. Same
    blocks, so o and the final state are the same bits, eagerly and from a CUDA graph, within
    the reference's tolerance: unsplit packed sequences (one segment each), packed split
    plans (the looped walk) and one split sequence (blocks of segments), through
    state_fwd_cols_kernel (FLASHGDN_COLS_TMA=0) and the TMA pass without (1) and with its WY
    warpgroup (4: P and T diag(beta), 5: P)."""
    case, env = {
        "many_short": (MANY_SHORT, {"FLASHGDN_CP": "off"}),
        "many_split": (MANY_SPLIT, {"FLASHGDN_CP": "on", "FLASHGDN_CP_SEG": "2"}),
        "one_long": (Case("one_long", [3000], 1, 4, gate="mixed"),
                     {"FLASHGDN_CP": "on", "FLASHGDN_CP_SEG": "5"}),
    }[plan]
    inp = make_inputs(case, "cuda", seed=23)
    env = {**env, "FLASHGDN_FWD_BW": "128", "FLASHGDN_COLS_TMA": tma,
           **({"FLASHGDN_TMA_WY_PHASES": "3"} if tma in ("4", "5") else {})}  # both phases
    o1, h1 = forward_bit_identical(inp, {**env, "FLASHGDN_DEBUG": "4096"}, env,
                                   f"warp lookup {plan} COLS_TMA={tma}")
    # run to run: kWy 2's WY warpgroup overwrote beta under a lagging warp's reads until
    # session 53 (its eager calls differed here about one in four)
    with env_vars(env):
        for _ in range(3):
            o2, h2 = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
            assert torch.equal(o2, o1) and torch.equal(h2, h1), "not reproducible"


def test_slots_walk_listed_segments_backward():
    """The same packed input through the backward (the recomputation's combine and the
    reverse pass's, last segment first): every gradient within rounding of the unsplit
    pass's and within the reference tolerance."""
    from test_backward import GRAD_TOL
    names, split, refs = _grads(MANY_SPLIT, "on", 2)
    _, unsplit, _ = _grads(MANY_SPLIT, "off")
    for n, a, b, r in zip(names, split, unsplit, refs):
        e, d = rel_err(a, r), rel_err(a, b)
        print(f"many_split d{n}: vs ref {e:.2e}, vs unsplit {d:.2e}")
        assert e < GRAD_TOL and d < 3e-3, f"d{n}: {e:.3e} vs ref, {d:.3e} vs unsplit"


def test_cp_backward_auto_engages():
    """Auto mode splits the reverse pass of a TP8-sized input as it splits the forward; the
    gradients agree with the unsplit pass within rounding (no float64 reference here: the
    split cases above compare with it)."""
    from test_backward import NAMES
    case = Case("auto_bwd", [8192], 2, 8, gate="mixed")
    inp = make_inputs(case, "cuda", seed=32)
    gen = torch.Generator().manual_seed(33)

    def grads(mode):
        leaves = {n: inp[n].clone().requires_grad_() for n in NAMES}
        with cp_env(mode):
            o, ht = flashgdn.chunk_gated_delta_rule(**leaves, cu_seqlens=inp["cu_seqlens"],
                                                    output_final_state=True)
            return torch.autograd.grad((o * do).sum() + (ht * dht).sum(), list(leaves.values()))

    do = torch.randn(inp["v"].shape, generator=gen).to(inp["v"].dtype).cuda()
    dht = torch.randn(inp["initial_state"].shape, generator=gen).cuda()
    split, unsplit = grads("auto"), grads("off")
    assert not torch.equal(split[-1], unsplit[-1]), "auto mode did not split the reverse pass"
    for n, a, b in zip(NAMES, split, unsplit):
        print(f"  d{n}: auto vs off {rel_err(a, b):.2e}")
        assert rel_err(a, b) < 3e-3, f"d{n}: {rel_err(a, b):.3e}"


def test_device_picks_column_block_for_packed_sequences():
    """Eight packed 1024-token sequences at 16/16 heads: the host, which cannot see the
    lengths, leaves the column block to the device (csrc/planner.h, device_col_block); with
    16 chunks per sequence it must pick 128 columns for the forward (state_fwd_cols_kernel:
    128 blocks fill the SMs) and, where the backward runs its passes at 16 / 32 columns
    (FLASHGDN_BWD_COLS=0), 32 for the recomputation and the reverse pass (FLASHGDN_FWD_BW
    is the forward's only), so the forward is bit-equal to a forced 128-column unsplit run
    and the gradients to a forced 32-column one. Without the override the backward of this
    input (16 heads x ~130 chunks: planner.h backward_cols since session 25) runs the
    128-column passes: gradients within rounding of the 32-column ones, not bit-equal."""
    from test_backward import NAMES
    case = Case("packed_short", [1024] * 8, 16, 16, gate="mixed")
    inp = make_inputs(case, "cuda", seed=34)
    gen = torch.Generator().manual_seed(35)
    do = torch.randn(inp["v"].shape, generator=gen).to(inp["v"].dtype).cuda()
    dht = torch.randn(inp["initial_state"].shape, generator=gen).cuda()

    def run(env):
        with env_vars(env):
            leaves = {n: inp[n].clone().requires_grad_() for n in NAMES}
            o, ht = flashgdn.chunk_gated_delta_rule(**leaves, cu_seqlens=inp["cu_seqlens"],
                                                    output_final_state=True)
            grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), list(leaves.values()))
            return [o.detach(), ht.detach(), *grads]

    narrow = {"FLASHGDN_BWD_COLS": "0"}
    auto = run({"FLASHGDN_CP": "auto", **narrow})
    bw128 = run({"FLASHGDN_CP": "off", "FLASHGDN_FWD_BW": "128", **narrow})
    bw32 = run({"FLASHGDN_CP": "off", "FLASHGDN_FWD_BW": "32", **narrow})
    bw16 = run({"FLASHGDN_CP": "off", "FLASHGDN_FWD_BW": "16", **narrow})
    rule = run({"FLASHGDN_CP": "auto"})
    names = ["o", "ht"] + [f"d{n}" for n in NAMES]
    for i, (name, a, w, b, c) in enumerate(zip(names, auto, bw128, bw32, bw16)):
        if i < 2:
            assert torch.equal(a, w), f"{name}: auto is not the 128-column forward"
            assert rel_err(w, b) < 2e-3, f"{name}: 128 and 32 columns differ"
        else:
            assert torch.equal(a, b), f"{name}: auto's backward is not the 32-column one"
            assert torch.equal(w, b), f"{name}: FLASHGDN_FWD_BW=128 reached the backward"
        assert rel_err(c, b) < 2e-3, f"{name}: 16 and 32 columns differ by {rel_err(c, b):.3e}"
    for name, r, b in zip(names[2:], rule[2:], bw32[2:]):
        assert rel_err(r, b) < 2e-3, f"{name}: 128-column backward differs by {rel_err(r, b):.3e}"
    assert any(not torch.equal(r, b) for r, b in zip(rule[2:], bw32[2:])), \
        "the backward did not take the 128-column passes"
    ro, rh = reference(inp)
    assert rel_err(auto[0], ro) < O_TOL and rel_err(auto[1], rh) < STATE_TOL


PING_CASES = [
    ("unsplit", CP_CASES[1], {"FLASHGDN_CP": "off"}),
    ("split", CP_CASES[5], {"FLASHGDN_CP": "on", "FLASHGDN_CP_SEG": "3"}),
    ("one_chunk_segments", CP_CASES[6], {"FLASHGDN_CP": "on", "FLASHGDN_CP_SEG": "1"}),
    ("overlap_sub", CP_CASES[6], {"FLASHGDN_CP": "on", "FLASHGDN_CP_SEG": "8",
                                  "FLASHGDN_CP_OVERLAP": "1", "FLASHGDN_CP_SUB": "4"}),
    # packed split plans: slots walk several segments a block (the stages' use count
    # carries over from one segment to the next)
    ("slots", MANY_SPLIT, {"FLASHGDN_CP": "on", "FLASHGDN_CP_SEG": "2"}),
    ("auto", Case("auto_long", [16384], 2, 8, gate="mixed"), {}),
]


@pytest.mark.parametrize("other", ["barrier", "three_stages"])
@pytest.mark.parametrize("label,case,switches", PING_CASES, ids=[c[0] for c in PING_CASES])
def test_ping_pong_bit_identical(label: str, case: Case, switches: dict, other: str):
    """The 128-column forward pass's ping-pong schedule (the default; state_fwd_cols.cuh
    kPing: no block barrier a chunk, one warpgroup issuing the copies, mbarriers per stage)
    does the arithmetic of the barrier-per-chunk schedule (FLASHGDN_COLS_PING=0) and of the
    opt-in three stages (FLASHGDN_COLS_STAGES=3: copies two chunks ahead, outputs staged in
    the V tile): o and the final state equal bit for bit,
    unsplit, split (phase 1's summaries too), with one-chunk segments, sub-segments beside
    the overlapped schedule, packed slots walking several segments, the planner's own
    choice at 2/8 x 16384; eagerly and from a CUDA graph."""
    inp = make_inputs(case, "cuda", seed=23)
    base = {"FLASHGDN_FWD_BW": "128", **switches} if switches else {}
    switch = {"FLASHGDN_COLS_PING": "0"} if other == "barrier" else {"FLASHGDN_COLS_STAGES": "3"}
    o0, h0, o1, h1 = forward_pair(inp, {**base, **switch}, base, label)
    assert torch.equal(o0, o1) and torch.equal(h0, h1), f"{label}: differs from {other}"
    ro, rh = reference(inp)
    print(f"ping-pong {label}: o {rel_err(o1, ro):.2e} state {rel_err(h1, rh):.2e}")
    assert rel_err(o1, ro) < O_TOL and rel_err(h1, rh) < STATE_TOL


@pytest.mark.parametrize("merge", ["2", "3"])
@pytest.mark.parametrize("case,seg", [
    (Case("merge_fixed", [8192], 4, 16, varlen=False, gate="mixed"), "8"),
    (Case("merge_odd", [5000, 5000], 1, 4, varlen=False, gate="mixed"), "5"),
    (Case("merge_one", [3000], 2, 8, gate="mixed"), "1"),
    (Case("merge_packed", [5000, 1500], 2, 8, gate="mixed"), "5"),
    (MANY_SPLIT, "2"),
], ids=lambda v: v.name if isinstance(v, Case) else None)
def test_phase0_merged_segments(case: Case, seg: str, merge: str):
    """Phase 0 in merged segments (FLASHGDN_CP_P0_MERGE: the block of every merge-th segment
    runs that many segments on, the chain keeps the plan's; packed sequences' looped slots
    walk groups of that many segments, a run of one sequence's a block): against the
    unsplit pass and the float64 reference, the g == 0 heads as exact as unsplit; a last
    merged segment that is partial (3 of 16 or 13 segments), one-chunk segments,
    equal-length sequences, groups across sequences' ends (two packed sequences, and
    MANY_SPLIT's 40 of one to 12 segments)."""
    inp = make_inputs(case, "cuda", seed=41)
    kernel = {"FLASHGDN_FWD_BW": "128"}
    check_split_env(f"{case.name} seg {seg} merge {merge}", case, inp,
                    {"FLASHGDN_CP": "on", "FLASHGDN_CP_SEG": seg, "FLASHGDN_CP_OVERLAP": "0",
                     "FLASHGDN_CP_P0_MERGE": merge, **kernel},
                    {"FLASHGDN_CP": "off", **kernel})


def test_device_plan_merged_phase0():
    """Packed sequences in Auto mode: the device's plan (plan_kernel) picks the segments and,
    for a sequential 128-column split whose blocks take two waves, the phase-0 merge
    (DeviceSegChoice::chosen[3]; at 4/16 heads and 24576 + 1536 tokens the host's model picks
    merge 2 for one sequence of 24576). Against merges turned off (FLASHGDN_CP_P0_MERGE=1),
    CP off and the float64 reference, the g == 0 heads as exact as unsplit. (Added in session
    34 after its last device call: first run on a GPU in the next session.)"""
    case = Case("device_merge", [24576, 1536], 4, 16, gate="mixed")
    inp = make_inputs(case, "cuda", seed=43)
    with cp_env("off"):
        o_ref, h_ref = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    with env_vars({"FLASHGDN_CP": "auto", "FLASHGDN_CP_P0_MERGE": "1"}):
        o_1, h_1 = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    with cp_env("auto"):
        o, ht = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
        o_g, h_g = forward_from_graph(inp, replays=2)
    torch.cuda.synchronize()
    assert torch.equal(o, o_g) and torch.equal(ht, h_g), "graph replay differs"
    ro, rh = reference(inp)
    check_split("device merge", case, o, ht, o_ref, h_ref, ro, rh)
    check_split("device plan, no merge", case, o_1, h_1, o_ref, h_ref, ro, rh)


@pytest.mark.parametrize("label,case,seg", [
    ("unsplit", Case("ping_bwd", [3000, 300], 1, 4, gate="mixed"), 0),
    ("split", Case("ping_bwd_split", [3000, 300], 1, 4, gate="mixed"), 2),
    ("slots", MANY_SPLIT, 2),
], ids=lambda v: v if isinstance(v, str) else None)
def test_ping_pong_bit_identical_backward(monkeypatch, label: str, case: Case, seg: int):
    """The backward on the 128-column passes (FLASHGDN_BWD_COLS=1) with its recomputation
    in state_fwd_cols_kernel (records of the state and U) on the ping-pong schedule (the
    default) against FLASHGDN_COLS_PING=0: every gradient equal bit for bit, unsplit, split
    and with packed slots walking several segments; and against the float64 reference
    (test_backward's tolerance)."""
    monkeypatch.setenv("FLASHGDN_BWD_COLS", "1")
    monkeypatch.setenv("FLASHGDN_CP", "on" if seg else "off")
    if seg:
        monkeypatch.setenv("FLASHGDN_CP_SEG", str(seg))
    grads_bit_identical(monkeypatch, case, "FLASHGDN_COLS_PING", "0", seed=29,
                        what=f"ping-pong backward {label}")


def grads_bit_identical(monkeypatch, case: Case, switch: str, value: str, seed: int,
                        what: str) -> None:
    """Every gradient with the environment variable `switch` at `value` and without it
    equal bit for bit, and within test_backward's tolerance of the float64 reference."""
    from test_backward import GRAD_TOL, run_grads
    monkeypatch.setenv(switch, value)
    names, before, _, _ = run_grads(case, "cuda", seed=seed)
    monkeypatch.delenv(switch)
    _, after, refs, _ = run_grads(case, "cuda", seed=seed)
    for n, a, b, r in zip(names, after, before, refs):
        assert torch.equal(a, b), f"{what}: d{n} differs from {switch}={value}"
        err = rel_err(a, r)
        print(f"{what}: d{n} {err:.2e}")
        assert err < GRAD_TOL, f"{what}: d{n} {err:.2e} >= {GRAD_TOL:.1e}"


WY_CASES = [
    # wy_heads 4 (one block a q/k head), odd lengths, an initial state, 25% g == 0 heads
    Case("wy_h4", [1000, 77, 2100], 2, 8, gate="mixed"),
    # wy_heads 4 with two blocks a q/k head (the fp16 copies from the first only)
    Case("wy_h4x2", [700, 130], 1, 8, gate="normal"),
    Case("wy_h3", [513, 64, 1], 2, 6, gate="very_negative"),  # wy_heads 3
    Case("wy_h2_fp16", [600, 45], 4, 8, gate="zero_heads", dtype=torch.float16),  # wy_heads 2
    Case("wy_auto_long", [16384], 4, 16, gate="mixed"),  # the planner's split plan
    # wy_heads 2 on bf16 inputs: wy_batched_kernel<In, 2> (4 blocks per SM) with the fp16 copies
    Case("wy_h2_bf16", [900, 200, 33], 3, 6, gate="mixed"),
]


@pytest.mark.parametrize("case", WY_CASES, ids=lambda c: c.name)
def test_wy_batched_bit_identical(case: Case):
    """wy_batched_kernel (the default where a wy block takes several value heads: every phase
    of the WY part over all the block's heads at once) does wy_kernel<In, true, true>'s
    arithmetic (FLASHGDN_WY_BATCHED=0): o and the final state equal bit for bit, eagerly and
    from a CUDA graph, with 2, 3 and 4 heads a block, two blocks a q/k head, bf16 and fp16
    (2 heads: wy_batched_kernel<In, 2>, 47 KB and 4 blocks per SM); wy_lean_kernel, the
    default at two and four heads a q/k head, switched off (FLASHGDN_WY_LEAN=0)."""
    inp = make_inputs(case, "cuda", seed=31)
    forward_bit_identical(inp, {"FLASHGDN_WY_BATCHED": "0", "FLASHGDN_WY_LEAN": "0"},
                          {"FLASHGDN_WY_LEAN": "0"}, f"wy batched {case.name}")


TRI16_CASES = [
    # the 128-column pass (16 heads), odd lengths, an initial state, 25% g == 0 heads
    (Case("tri_cols_varlen", [1000, 77, 2100], 4, 16, gate="mixed"), {}),
    (Case("tri_cols_fp16", [700, 130], 2, 8, gate="very_negative", dtype=torch.float16),
     {"FLASHGDN_FWD_BW": "128"}),
    # the narrow passes (state_fwd_f16_kernel at 16 and 32 columns), wy_kernel (one head a block)
    (Case("tri_f16_bw32", [513, 64, 1], 2, 2, gate="zero_heads"), {"FLASHGDN_FWD_BW": "32"}),
    (Case("tri_f16_bw16", [300, 45], 1, 1, gate="normal"), {"FLASHGDN_FWD_BW": "16"}),
    # the planner's split plan (segments, the walk, the overlapped launches)
    (Case("tri_cp_long", [16384], 4, 16, gate="mixed"), {}),
    (Case("tri_cp_corr", [4096], 1, 2, gate="mixed"), {"FLASHGDN_CP_CORR": "1"}),
]


@pytest.mark.parametrize("case,env", TRI16_CASES, ids=lambda c: c.name if isinstance(c, Case) else "")
def test_tri16_bit_identical(case: Case, env: dict):
    """T diag(beta) and P as their lower block triangle (FwdParams::tri16, the default: wy
    stores no block above the diagonal, the state passes copy none) against whole tiles
    (FLASHGDN_TRI16=0): o and the final state equal bit for bit; with the unstored blocks
    filled with NaN (FLASHGDN_DEBUG=16) too, eagerly and from a CUDA graph, so no product
    reads them; and within the float64 reference's tolerance (the copies' blocks left as
    they were are not read either)."""
    inp = make_inputs(case, "cuda", seed=41)
    forward_bit_identical(inp, {**env, "FLASHGDN_TRI16": "0"}, env, f"tri16 {case.name}",
                          check_reference=False)
    o2, h2 = forward_bit_identical(inp, env, {**env, "FLASHGDN_DEBUG": "16"},
                                   f"tri16 {case.name} with NaN blocks")
    assert torch.isfinite(o2).all() and torch.isfinite(h2).all(), f"{case.name}: NaN read"


OWG_CASES = [
    # the 128-column pass unsplit: odd lengths, an initial state, 25% g == 0 heads
    (Case("owg_varlen", [1000, 77, 2100], 4, 16, gate="mixed"), {"FLASHGDN_FWD_BW": "128"}),
    (Case("owg_fp16", [700, 130], 2, 8, gate="very_negative", dtype=torch.float16),
     {"FLASHGDN_FWD_BW": "128"}),
    # the planner's split plan (warm-ups without outputs, exact segments after the walk)
    (Case("owg_cp_long", [16384], 4, 16, gate="mixed"), {}),
    # packed sequences in looped slots (the hand-overs' counts carried across segments)
    (Case("owg_packed", [5000, 3000, 64, 1, 700], 2, 8, gate="mixed"),
     {"FLASHGDN_CP": "on", "FLASHGDN_CP_SEG": "6", "FLASHGDN_FWD_BW": "128"}),
]


@pytest.mark.parametrize("case,env", OWG_CASES, ids=lambda c: c.name if isinstance(c, Case) else "")
def test_owg_bit_identical(case: Case, env: dict):
    """state_fwd_cols_owg_kernel (FLASHGDN_COLS_OWG=1: the 128-column phase 0 with its
    outputs in a warpgroup of their own, from the chain's S^T and U^T handed over in shared
    memory) gives state_fwd_cols_kernel's o and final state bit for bit, eagerly and from a
    CUDA graph, unsplit, split and on packed sequences in looped slots."""
    inp = make_inputs(case, "cuda", seed=47)
    forward_bit_identical(inp, env, {**env, "FLASHGDN_COLS_OWG": "1"}, f"owg {case.name}")


KQ_CASES = [  # at most two value heads a q/k head (launch.cu kq_in_pass)
    # the 128-column pass unsplit: odd lengths, an initial state, 25% g == 0 heads
    (Case("kq_varlen", [1000, 77, 2100], 8, 16, gate="mixed"), {"FLASHGDN_FWD_BW": "128"}),
    # the planner's split plan (phase 1, warm-ups, the walk, exact segments), one value
    # head a q/k head
    (Case("kq_cp_long", [16384], 8, 8, gate="very_negative"), {}),
    # packed sequences in looped slots (the stages' use count carried across segments)
    (Case("kq_packed", [5000, 3000, 64, 1, 700], 4, 8, gate="mixed"),
     {"FLASHGDN_CP": "on", "FLASHGDN_CP_SEG": "6", "FLASHGDN_FWD_BW": "128"}),
]


@pytest.mark.parametrize("case,env", KQ_CASES, ids=lambda c: c.name if isinstance(c, Case) else "")
def test_kq_bf16_tiles(case: Case, env: dict):
    """bf16 inputs whose only fp16 readers are state_fwd_cols_kernel's ping-pong forward
    passes, at most two value heads a q/k head: the passes copy the bf16 k and q tiles and convert them in shared memory, and
    wy_kernel writes no fp16 copies (FwdParams::kq_bf16). Against FLASHGDN_KQ_COPIES=1 (the
    copies): o and the final state bit for bit, eagerly and from a CUDA graph, and the
    reference's tolerance. FLASHGDN_DEBUG=256 fills the copies' space with NaN and keeps
    wy_kernel from writing it, so a pass that still read the copies would show."""
    inp = make_inputs(case, "cuda", seed=59)
    assert inp["q"].dtype == torch.bfloat16
    forward_bit_identical(inp, {**env, "FLASHGDN_KQ_COPIES": "1"},
                          {**env, "FLASHGDN_DEBUG": "256"}, f"kq bf16 tiles {case.name}")


def test_kq_copies_kept_at_four_value_heads():
    """Four value heads a q/k head (4/16): the conversions would cost more than the copies
    save (launch.cu kq_in_pass), so the 128-column pass still reads wy_kernel's fp16 copies:
    with their space poisoned and unwritten (FLASHGDN_DEBUG=256) the output is not finite.
    The plain pass pinned (FLASHGDN_COLS_TMA=0): the default at 16 value heads forms P in
    state_fwd_tma_kernel and reads bf16 k and q by TMA, no copies (test_default_forward_kernel)."""
    case = Case("kq_four", [1000, 2100], 4, 16, gate="mixed")
    inp = make_inputs(case, "cuda", seed=61)
    with env_vars({"FLASHGDN_FWD_BW": "128", "FLASHGDN_DEBUG": "256", "FLASHGDN_COLS_TMA": "0"}):
        o, _ = flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True)
    torch.cuda.synchronize()
    assert not torch.isfinite(o).all()


LEAN_CASES = [  # FLASHGDN_WY_LEAN=<heads a block at most>
    # two value heads a q/k head (bf16 k, q converted in the 128-column pass): odd lengths,
    # an initial state, 25% g == 0 heads
    (Case("lean_h2_varlen", [1000, 77, 2100], 8, 16, gate="mixed"), {"FLASHGDN_WY_LEAN": "4"}),
    # four heads a block, fp16 inputs, very negative gates, the narrow passes
    (Case("lean_h4_fp16", [700, 130], 2, 8, gate="very_negative", dtype=torch.float16),
     {"FLASHGDN_WY_LEAN": "4"}),
    # two blocks a q/k head of four (the first writes the fp16 copies of bf16 k and q)
    (Case("lean_h4_in_twos", [513, 64, 1], 2, 8, gate="zero_heads"), {"FLASHGDN_WY_LEAN": "2"}),
    # three heads a block; one head a block; many short sequences
    (Case("lean_h3", [300, 45], 2, 6, gate="normal"), {"FLASHGDN_WY_LEAN": "4"}),
    (Case("lean_h1_short", [1 + (7 * i) % 23 for i in range(40)], 2, 2, cu_dtype=torch.int64),
     {"FLASHGDN_WY_LEAN": "1"}),
    # the planner's split plan (phase 1 reads the warm-up bound Lb)
    (Case("lean_cp_long", [16384], 4, 16, gate="mixed"), {"FLASHGDN_WY_LEAN": "4"}),
]


@pytest.mark.parametrize("case,env", LEAN_CASES, ids=lambda c: c.name if isinstance(c, Case) else "")
def test_wy_lean(case: Case, env: dict):
    """wy_lean_kernel (FLASHGDN_WY_LEAN: one warpgroup a block, the inverse by doubling in
    fp16 products) against wy_batched_kernel / wy_kernel (FLASHGDN_WY_LEAN=0): another
    inverse, so not the same bits, but within the float64 reference's tolerance and no less
    accurate (o and state errors at most 10% above, + 1e-4), eagerly and from a CUDA graph.
    Its blocks above the diagonal are not read (NaN there under FLASHGDN_DEBUG=16: the same
    bits), and whole tiles with zero blocks (FLASHGDN_TRI16=0) give the same bits too."""
    inp = make_inputs(case, "cuda", seed=67)
    o0, h0, o1, h1 = no_less_accurate(inp, {"FLASHGDN_WY_LEAN": "0"}, env,
                                      f"wy lean {case.name} (default: wy_batched)")
    assert not (torch.equal(o0, o1) and torch.equal(h0, h1)), "the lean kernel did not run"
    forward_bit_identical(inp, env, {**env, "FLASHGDN_DEBUG": "16"}, f"wy lean NaN {case.name}",
                          check_reference=False)
    forward_bit_identical(inp, env, {**env, "FLASHGDN_TRI16": "0"},
                          f"wy lean whole tiles {case.name}", check_reference=False)


@pytest.mark.parametrize("case,lean", [
    (Case("lean_default_h1", [700, 65], 2, 2, gate="mixed"), "1"),
    (Case("lean_default_h2", [700, 65], 2, 4, gate="mixed"), "2"),
    (Case("lean_default_h4", [700, 65], 2, 8, gate="mixed"), "2"),
    (Case("lean_default_h3", [700, 65], 2, 6, gate="mixed"), "3"),
], ids=lambda x: x.name if isinstance(x, Case) else x)
def test_wy_lean_default(case: Case, lean: str):
    """The default WY kernel of the plain forward (launch.cu wy_lean_heads): wy_lean_kernel
    with one value head a block at one head a q/k head, two at two and four, three at
    three: the same bits as the explicit switch."""
    inp = make_inputs(case, "cuda", seed=71)
    forward_bit_identical(inp, {"FLASHGDN_WY_LEAN": lean}, {}, f"wy lean default {case.name}",
                          check_reference=False)


@pytest.mark.parametrize("cols", ["0", "1"], ids=["bwd_narrow", "bwd_cols"])
@pytest.mark.parametrize("case", [WY_CASES[0], WY_CASES[2], WY_CASES[3]], ids=lambda c: c.name)
def test_wy_lean_t_backward(monkeypatch, case: Case, cols: str):
    """FLASHGDN_WY_LEAN_T=1: wy_lean_kernel also writes T (fp32 Tmat or fp16 T16) and fp32 P
    for the backward's recomputation (both kinds of sequential passes) and the kept forward.
    Every gradient within test_backward's tolerance of the float64 reference; the kept
    backward equal to the recomputing one bit for bit; the kept forward's o and final state
    within 1e-3 of the plain forward's (both from wy_lean_kernel's inverse; the passes may
    differ where FLASHGDN_BWD_COLS forces the kept one's)."""
    from test_backward import GRAD_TOL, run_grads
    from test_keep_for_backward import grads
    monkeypatch.setenv("FLASHGDN_BWD_COLS", cols)
    monkeypatch.setenv("FLASHGDN_WY_LEAN_T", "1")
    names, ours, refs, _ = run_grads(case, "cuda", seed=73)
    for n, a, r in zip(names, ours, refs):
        err = rel_err(a, r)
        print(f"wy lean T {case.name} cols {cols}: d{n} {err:.2e}")
        assert err < GRAD_TOL, f"d{n} {err:.2e} >= {GRAD_TOL:.1e}"
    _, o_k, ht_k, g_k, _ = grads(case, "cuda", True, seed=74)
    _, o_r, ht_r, g_r, _ = grads(case, "cuda", False, seed=74)
    assert rel_err(o_k, o_r.double()) < 1e-3 and rel_err(ht_k, ht_r.double()) < 1e-3
    for n, a, b in zip(names, g_k, g_r):
        assert torch.equal(a, b), f"d{n}: kept differs from recomputed"


@pytest.mark.parametrize("cols", [0, 1], ids=["bwd_default", "bwd_cols"])
@pytest.mark.parametrize("case", [WY_CASES[0], WY_CASES[2], WY_CASES[5]], ids=lambda c: c.name)
def test_wy_batched_bit_identical_backward(monkeypatch, case: Case, cols: int):
    """The backward's recomputation through wy_batched_kernel (T, fp32 P, Tv16 as the
    backward asks) against FLASHGDN_WY_BATCHED=0: every gradient equal bit for bit, and
    against the float64 reference (test_backward's tolerance)."""
    monkeypatch.setenv("FLASHGDN_BWD_COLS", str(cols))
    grads_bit_identical(monkeypatch, case, "FLASHGDN_WY_BATCHED", "0", seed=37,
                        what=f"wy batched backward {case.name}")


FUSED_CASES = [  # FLASHGDN_FUSED (the forward's WY part inside the 128-column pass)
    # two value heads a q/k head, odd lengths, an initial state, 25% g == 0 heads
    Case("fused_h2_varlen", [1000, 77, 2100], 8, 16, gate="mixed"),
    # fp16 inputs (no conversion in place), very negative gates, four heads a q/k head
    Case("fused_fp16", [700, 130], 2, 8, gate="very_negative", dtype=torch.float16),
    # many short sequences (partial chunks everywhere), int64 cu_seqlens
    Case("fused_short", [1 + (7 * i) % 23 for i in range(40)], 2, 2, cu_dtype=torch.int64),
    # g == 0 heads (the exact path), three heads a q/k head
    Case("fused_zero_heads", [513, 64, 1], 2, 6, gate="zero_heads"),
    # the planner's split plan: phase 1 (summaries, identity blocks) and phase 0
    Case("fused_cp_long", [16384], 4, 16, gate="mixed"),
    Case("fused_cp_two", [9000, 7000], 2, 4, gate="normal"),
]


@pytest.mark.parametrize("mode", ["1", "2", "3", "4"],
                         ids=["p_regs224", "p_regs216", "pt_regs216", "p_stages3"])
@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: c.name)
def test_fused_forward(case: Case, mode: str):
    """FLASHGDN_FUSED (gdn_fwd_fused_kernel: P, and with mode 3 T diag(beta), formed by an
    auxiliary warpgroup inside the 128-column pass; wy_lean_kernel without Q K^T before it,
    or with mode 3 wy_gates_kernel) against the default kernels at 128 columns: within the
    float64 reference's tolerance and no less accurate (o and state errors at most 10% above,
    + 1e-4), eagerly and from a CUDA graph; the expected kernels ran."""
    inp = make_inputs(case, "cuda", seed=79)
    base = {"FLASHGDN_FWD_BW": "128"}
    fused = {**base, "FLASHGDN_FUSED": mode}
    o0, h0, o1, h1 = no_less_accurate(inp, base, fused, f"fused {case.name}")
    print(f"fused {case.name}: same bits as the default: "
          f"{torch.equal(o0, o1) and torch.equal(h0, h1)}")
    with env_vars(fused):
        names = cuda_kernels_run(lambda: flashgdn.chunk_gated_delta_rule(**inp,
                                                                         output_final_state=True))
    assert any("gdn_fwd_fused_kernel" in n for n in names), sorted(names)
    before = "wy_gates_kernel" if mode == "3" else "wy_lean_kernel"
    assert any(before in n for n in names), sorted(names)
    assert not any("wy_batched_kernel" in n or "state_fwd_cols_kernel" in n for n in names)
    if mode == "3":
        assert not any("wy_lean_kernel" in n for n in names), sorted(names)


TMA_CASES = FUSED_CASES + [
    # packed sequences whose chunks start off the 64-token grid, with a partial last chunk
    # read by TMA into the next sequence's rows (zeroed by the kernel's selects)
    Case("tma_packed_offsets", [33, 190, 64, 1001, 7], 4, 8, gate="mixed"),
]


def tma_envs(split: str, variant: str):
    """(the default kernel's switches, state_fwd_tma_kernel's) for test_tma_forward."""
    base = {"FLASHGDN_FWD_BW": "128", "FLASHGDN_COLS_TMA": "0",
            **({"FLASHGDN_CP": "on", "FLASHGDN_CP_SEG": "2"} if split == "seg2" else {})}
    tma = {**base, "FLASHGDN_COLS_TMA": {"ssy": "3", "wy": "4", "wyp": "5", "wyp1": "5",
                                         "wypk": "5"}.get(variant, "1"),
           # kWy 3: K converted by the producer's warps while the WY warpgroup forms P
           **({"FLASHGDN_TMA_KCONV": "1"} if variant == "wypk" else {}),
           # kWy 1 in both phases, but for "wyp1" (phase 1 the plain pass: the default's way)
           "FLASHGDN_TMA_WY_PHASES": "1" if variant == "wyp1" else "3",
           **({"FLASHGDN_COLS_STAGES": "3"} if variant == "3" else {})}
    return base, tma


@pytest.mark.parametrize("variant", ["2", "3", "ssy", "wy", "wyp", "wyp1", "wypk"])
@pytest.mark.parametrize("split", ["auto", "seg2"])
@pytest.mark.parametrize("case", TMA_CASES, ids=lambda c: c.name)
def test_tma_forward(case: Case, split: str, variant: str):
    """FLASHGDN_COLS_TMA=1 (state_fwd_tma_kernel: TMA loads, two wgmma warpgroups) against the
    default 128-column kernel: within the float64 reference's tolerance and no less accurate
    (o and state errors at most 10% above, + 1e-4), bit-identical to it but for "ssy" and
    "wy", and a CUDA graph's replays equal to the eager call (the run-to-run defect of
    docs/perf-notes.md versions 42-43: the producer's uncommitted cp.async group). "seg2"
    forces a split into segments of two chunks (phase 1's summaries and identity blocks, the
    chain, warm-ups); "3": its three-stage ring (FLASHGDN_COLS_STAGES=3); "ssy":
    FLASHGDN_COLS_TMA=3, S^T Q^T from S^T staged in shared memory against e^G-scaled Q; "wy":
    FLASHGDN_COLS_TMA=4, the fused forward (P and T diag(beta) formed in the kernel, the
    latter by wy_inverse's doubling on wgmma; wy_gates_kernel before it instead of
    wy_lean_kernel); "wyp": FLASHGDN_COLS_TMA=5, only P formed in the kernel; "wyp1": that
    with phase 1 on the plain pass (FLASHGDN_TMA_WY_PHASES=1, the default's way); "wypk":
    "wyp" with K converted by the producer's warps 1-3 (FLASHGDN_TMA_KCONV=1, kWy 3; bf16
    cases run that instantiation, fp16 ones kWy 1).
    state_fwd_tma_kernel ran and state_fwd_cols_kernel did not."""
    inp = make_inputs(case, "cuda", seed=83)
    base, tma = tma_envs(split, variant)
    o0, h0, o1, h1 = no_less_accurate(inp, base, tma, f"tma {case.name} {split} {variant}")
    # the same products in the same order; ssy rounds e^G Q to fp16, wy forms T diag(beta) by
    # its own doubling on wgmma (another order of the same sums)
    if variant not in ("ssy", "wy"):
        assert torch.equal(o1, o0) and torch.equal(h1, h0), "differs from the default kernel"
    with env_vars(tma):
        names = cuda_kernels_run(lambda: flashgdn.chunk_gated_delta_rule(**inp,
                                                                         output_final_state=True))
    assert any("state_fwd_tma_kernel" in n for n in names), sorted(names)
    if variant != "wyp1":  # wyp1: phase 1 of a split plan on the plain pass
        assert not any("state_fwd_cols_kernel" in n for n in names), sorted(names)
    if variant == "wy":
        assert any("wy_gates_kernel" in n for n in names), sorted(names)
        assert not any("wy_lean_kernel" in n for n in names), sorted(names)
    if variant == "wypk" and case.dtype == torch.bfloat16:  # kWy 3 ran
        assert any("state_fwd_tma_kernel" in n and "3, false, 3" in n for n in names), \
            sorted(names)


@pytest.mark.parametrize("case, wy", [
    # 16 value heads, one sequence of 512 chunks: the sequential split (no saturated schedule
    # where kWy runs: ForwardCost::fused_wy), kWy 1
    (Case("default_h16_long", [32768], 16, 16, gate="mixed"), True),
    # 16 value heads, 256 chunks: the sequential split (ForwardCost::unfused_wy_us), kWy 1
    (Case("default_h16_seq", [16384], 4, 16, gate="mixed"), True),
    # 16 value heads, 128 chunks: the overlapped schedule (not saturated), the plain pass
    (Case("default_h16_overlap", [8192], 4, 16, gate="mixed"), False),
    # 32 value heads, 128 chunks: overlapped too, kWy 1 at 32 heads
    (Case("default_h32_overlap", [8192], 8, 32, gate="normal"), True),
    # 24 value heads, three a q/k head, g == 0 heads, odd lengths (unsplit: 59 chunks in all,
    # under kMinShortSegLongest, so no 128-column split is a candidate); fp16 inputs
    (Case("default_h24", [2500, 900, 5], 8, 24, gate="zero_heads"), True),
    (Case("default_h16_fp16", [2000, 64], 16, 16, gate="very_negative",
          dtype=torch.float16), True),
    # 8 value heads: the overlapped schedule the device may take (the plain pass), and since
    # session 57 kWy 1 elsewhere: unsplit (5 x 7 chunks), g == 0 heads, h0, odd lengths
    (Case("default_h8", [5000, 300], 2, 8, gate="mixed"), False),
    (Case("default_h8_unsplit", [1000, 700, 300, 64, 1], 2, 8, gate="zero_heads", h0=True),
     True),
], ids=lambda c: c.name if isinstance(c, Case) else None)
def test_default_forward_kernel(case: Case, wy: bool):
    """The default forward at 128 columns takes state_fwd_tma_kernel's kWy 1 (the WY
    warpgroup forming P) at any head count (from 16 value heads before session 57), but for
    the overlapped schedule below 32 (launch.cu cols_tma_wy), phase 1 of a split plan the
    plain pass (tma_wy_phase); else the plain 128-column pass: the expected kernels ran, and o and the final state equal
    FLASHGDN_COLS_TMA=0's (the plain pass) bit for bit, eagerly and from a CUDA graph, within
    the float64 reference's tolerance. (FLASHGDN_UNFUSED_WY_US pinned to its default: with
    FLASHGDN_COLS_TMA set the planner drops that term, which would change the plan.)"""
    inp = make_inputs(case, "cuda", seed=89)
    # (the 8192-token cases' plans before the planner's 16-chunk splits, which
    # test_reach_segments_default covers)
    base = {"FLASHGDN_FWD_BW": "128", "FLASHGDN_UNFUSED_WY_US": "2",
            "FLASHGDN_REACH_SEG": "0"}
    if 16 <= case.hv < 32:
        # FLASHGDN_COLS_TMA clears ForwardCost::fused_wy too, which brings the saturated
        # schedule back as a candidate: CP_SAT=0 keeps both runs on the default's plan
        base["FLASHGDN_CP_SAT"] = "0"
    forward_bit_identical(inp, {**base, "FLASHGDN_COLS_TMA": "0"}, base,
                          f"default kernel {case.name}")
    with env_vars(base):
        names = cuda_kernels_run(lambda: flashgdn.chunk_gated_delta_rule(**inp,
                                                                         output_final_state=True))
    assert any("state_fwd_tma_kernel" in n for n in names) == wy, sorted(names)
    # the plain pass: everything without kWy, phase 1 of a split plan with it
    split = len(case.lens) == 1 and case.lens[0] >= 8192
    assert any("state_fwd_cols_kernel" in n for n in names) == (not wy or split), sorted(names)


@pytest.mark.parametrize("case", [
    # one value head a q/k head, 16 heads: fp16 inputs, very negative gates, odd lengths
    Case("konly_h16_fp16", [2000, 64, 7], 16, 16, gate="very_negative", dtype=torch.float16),
    # 32 heads, g == 0 heads, an initial state, int64 cu_seqlens
    Case("konly_h32", [3000, 900, 5], 32, 32, gate="zero_heads", h0=True, cu_dtype=torch.int64),
    # a split plan (phase 1 on the plain pass, phase 0 on kWy 1)
    Case("konly_h16_split", [32768], 16, 16, gate="mixed"),
    # two value heads a block (|k|^2 in the A tile's padding, six blocks an SM): 8/16 fp16,
    # very negative gates, odd lengths; 16/32 with g == 0 heads, an initial state, int64
    # cu_seqlens; 4/16 (four value heads a q/k head, two a block) in a split plan
    Case("konly2_h16_fp16", [2000, 64, 7], 8, 16, gate="very_negative", dtype=torch.float16),
    Case("konly2_h32", [3000, 900, 5], 16, 32, gate="zero_heads", h0=True,
         cu_dtype=torch.int64),
    Case("konly2_g4_split", [32768], 4, 16, gate="mixed"),
], ids=lambda c: c.name)
def test_wy_lean_k_only(case: Case):
    """Where the fused forward forms P (kWy 1), wy_lean_kernel runs without q's tile (kQ =
    false; launch.cu wy_lean_k_only): at one value head a block 19 KB, eight blocks an SM; at
    two, |k|^2 kept in the A tile's padding, six. That kernel ran, and o and the final state
    equal FLASHGDN_WY_LEAN_KONLY=0's (the kernel with q's tile, the same arithmetic) bit for
    bit, eagerly and from a CUDA graph, within the float64 reference's tolerance."""
    inp = make_inputs(case, "cuda", seed=97)
    base = {"FLASHGDN_FWD_BW": "128"}
    forward_bit_identical(inp, {**base, "FLASHGDN_WY_LEAN_KONLY": "0"}, base,
                          f"wy_lean k only {case.name}")
    for env, k_only in ((base, True), ({**base, "FLASHGDN_WY_LEAN_KONLY": "0"}, False)):
        with env_vars(env):
            names = cuda_kernels_run(
                lambda: flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True))
        assert any("state_fwd_tma_kernel" in n for n in names), sorted(names)
        lean = [n for n in names if "wy_lean_kernel" in n]
        # the demangled name, e.g. void flashgdn::cuda::wy_lean_kernel<__half, 2, false, false>(...)
        heads = 1 if case.hqk == case.hv else 2
        assert lean and all((f",{heads},false,false>" in n.replace(" ", "")) == k_only
                            for n in lean), sorted(names)


@pytest.mark.parametrize("case", [
    # 16 heads x 64 chunks: three 128-column segments of 22 by default, unsplit from 128
    # (the rule before kMinShortSegLongest), five of 13 with the switches; mixed gates
    # (g == 0 heads: the exact chain), an initial state
    Case("short_h16", [4096], 16, 16, gate="mixed"),
    # 96 chunks at 4/16 heads (five segments of 20 by default, three of 32 from 128, six
    # of 16 with the switches), fp16 inputs, very negative gates
    Case("short_h16_96_fp16", [6144], 4, 16, gate="very_negative", dtype=torch.float16),
], ids=lambda c: c.name)
def test_short_segments_switch(case: Case):
    """FLASHGDN_CP_SHORT_LONGEST=64 with FLASHGDN_CP_SHORT_MIN=12 (ForwardCost::short_seg_longest
    / short_seg_min: 128-column segments down to 12 chunks for sequences of 64+ chunks): the
    plan splits (the chain's kernels ran; by default as well, kMinShortSegLongest; with
    FLASHGDN_CP_SHORT_LONGEST=128, the rule before it, not at 64 chunks), and its o and final
    state, eagerly and from a CUDA graph, are a split's against the float64 reference and the
    unsplit pass (check_split: g == 0 heads as exact)."""
    inp = make_inputs(case, "cuda", seed=101)
    short = {"FLASHGDN_CP_SHORT_LONGEST": "64", "FLASHGDN_CP_SHORT_MIN": "12"}
    check_split_env(f"short segments {case.name}", case, inp, short, {"FLASHGDN_CP": "off"})
    chain = ("seg_walk_kernel", "seg_combine_kernel", "seg_scan_kernel")
    old = {"FLASHGDN_CP_SHORT_LONGEST": "128"}
    for env, split in (({}, True), (short, True), (old, case.lens[0] > 4096)):
        with env_vars(env):
            names = cuda_kernels_run(
                lambda: flashgdn.chunk_gated_delta_rule(**inp, output_final_state=True))
        assert any(c in n for n in names for c in chain) == split, (env, sorted(names))


@pytest.mark.parametrize("case", [
    # two value heads a q/k head: bf16 k and q converted in shared memory (kq_bf16)
    Case("wgp_conv", [1000, 77, 2100], 8, 16, gate="mixed"),
    # four: wy's fp16 copies; fp16 inputs; 40 short sequences
    Case("wgp_copies", [700, 130], 2, 8, gate="very_negative"),
    Case("wgp_fp16", [513, 64, 1], 2, 4, gate="zero_heads", dtype=torch.float16),
    Case("wgp_short", [1 + (7 * i) % 23 for i in range(40)], 2, 2, cu_dtype=torch.int64),
    # split plans (phase 1's identity blocks, the chain, exact and warm-started segments)
    Case("wgp_cp_long", [16384], 4, 16, gate="mixed"),
    Case("wgp_cp_two", [9000, 7000], 2, 4, gate="normal"),
], ids=lambda c: c.name)
@pytest.mark.parametrize("mode", ["2", "3"], ids=["ping", "ping_order"])
def test_wgmma_ping_bit_identical(case: Case, mode: str):
    """FLASHGDN_COLS_WGMMA=2 (state_fwd_cols_wg_kernel in the ping-pong schedule, mbarriers
    and proxy fences instead of a block barrier a chunk; bf16 k, q converted in shared memory
    where a q/k head has at most two value heads) gives the barrier schedule's bits
    (FLASHGDN_COLS_WGMMA=1: the same products in the same order on the same operands),
    eagerly and from a CUDA graph, within the float64 reference's tolerance. Mode 3 (the two
    warpgroups' wgmma groups issued in alternation; written without a GPU) likewise."""
    inp = make_inputs(case, "cuda", seed=83)
    forward_bit_identical(inp, {"FLASHGDN_FWD_BW": "128", "FLASHGDN_COLS_WGMMA": "1"},
                          {"FLASHGDN_FWD_BW": "128", "FLASHGDN_COLS_WGMMA": mode},
                          f"wgmma ping-pong {mode} {case.name}")
