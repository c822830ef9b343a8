"""bench/precision_study.py's chunked forward (the formulas of docs/algorithm.md in float64,
operands rounded per design) must be the operator: with float64 operands it equals the
token-by-token reference, and each rounding lands where its mantissa says. CPU only."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from conftest import rel_err

_PATH = os.path.join(os.path.dirname(__file__), "..", "bench", "precision_study.py")
_spec = importlib.util.spec_from_file_location("precision_study", _PATH)
study = importlib.util.module_from_spec(_spec)
sys.modules["precision_study"] = study  # dataclasses look their module up there
_spec.loader.exec_module(study)


def _run(design, tokens: int = 200, heads: int = 2, gates: str = "hard", qk_norm: bool = True,
         v_scale: float = 1.0):
    x = study.make_inputs(tokens, heads, gates, seed=3, qk_norm=qk_norm, v_scale=v_scale)
    ro, rs = study.recurrent_gated_delta_rule_ref(
        x["q"][None], x["k"][None], x["v"][None], x["g"][None], x["beta"][None], 128 ** -0.5)
    outs, states = [], []
    for h in range(heads):
        o, s = study.chunked_forward(x["q"][:, h], x["k"][:, h], x["v"][:, h], x["g"][:, h],
                                     x["beta"][:, h], 128 ** -0.5, design, {})
        outs.append(o)
        states.append(s)
    return rel_err(torch.stack(outs, 1), ro[0]), rel_err(torch.stack(states), rs[0])


def test_rounding_formats():
    x = torch.tensor([1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 1.0 + 2.0 ** -10, 3.0e38],
                     dtype=torch.float64)
    t = study.rnd(x, "tf32")
    assert t[0] == 1.0 and t[1] == 1.0 + 2.0 ** -9  # ties to even
    assert t[2] == 1.0 + 2.0 ** -10  # 10 mantissa bits kept
    assert torch.equal(study.rnd(x[:3], "f16"), t[:3])  # fp16: the same 10 bits
    assert study.rnd(x, "bf16")[2] == 1.0  # bf16: 7 bits
    assert study.rnd(x, "f16")[3] == float("inf") and study.rnd(x, "bf16")[3] < float("inf")


@pytest.mark.parametrize("qk_norm", [True, False])
def test_float64_design_is_the_operator(qk_norm: bool):
    exact = study.Design("f64", *(["f64"] * 6), t="f64")
    eo, es = _run(exact, qk_norm=qk_norm)
    assert eo < 1e-6 and es < 1e-6, (eo, es)  # only the fp32 rounding of each product


def test_designs_order_by_mantissa():
    by = {d.name: _run(d) for d in study.DESIGNS}
    today, fla_like = by[study.DESIGNS[0].name], by[study.DESIGNS[4].name]
    fp16 = by[study.DESIGNS[5].name]
    assert today[0] < 2e-3 and today[1] < 2e-3
    assert fla_like[0] > 2 * today[0]  # bf16's 7-bit mantissa costs over twice the error
    assert abs(fp16[0] - today[0]) < 0.2 * today[0]  # fp16 and tf32: the same 10 bits


def _shipped(name: str):
    return next(d for d in study.DESIGNS if d.name.startswith(name))


FP16_PASSES = ["W/U0-free, fp16", "shipped: fp16"]  # the default pass, f16wu


@pytest.mark.parametrize("design", FP16_PASSES)
@pytest.mark.parametrize("v_scale", [1e-3, 1.0, 1e4])
def test_fp16_pass_accurate_within_its_range(v_scale: float, design: str):
    """The fp16-operand passes (the default and f16wu) are as accurate as the tf32 pass while
    |v| stays inside fp16's comfortable range (README, Accuracy)."""
    f16 = _run(_shipped(design), v_scale=v_scale)
    tf32 = _run(_shipped("shipped: tf32"), v_scale=v_scale)
    assert f16[0] < 1.05 * tf32[0] + 1e-6 and f16[1] < 1.05 * tf32[1] + 1e-6
    assert f16[0] < 2e-3 and f16[1] < 2e-3


@pytest.mark.parametrize("design", FP16_PASSES)
@pytest.mark.parametrize("v_scale", [1e-6, 3e4])
def test_fp16_pass_range_limits_and_tf32_fallback(v_scale: float, design: str):
    """Outside that range the fp16 copies of U and S underflow (|v| ~ 1e-6: subnormals) or
    overflow (|v| ~ 3e4), which is why FLASHGDN_FWD_PASS=tf32 exists: its U0 and operands
    keep fp32's exponent and stay accurate there."""
    tf32 = _run(_shipped("shipped: tf32"), v_scale=v_scale)
    assert tf32[0] < 2e-3 and tf32[1] < 2e-3
    try:
        f16 = _run(_shipped(design), v_scale=v_scale)
    except AssertionError as exc:  # rel_err refuses non-finite results: the overflow case
        assert "non-finite" in str(exc) and v_scale > 1
    else:
        assert f16[0] > 1e-2 and v_scale < 1  # the underflow case: a large error


@pytest.mark.parametrize("gates", ["bench", "hard"])
def test_wy_free_reformulation(gates: str):
    """The plan's next forward (docs/perf-notes.md): T = Dec . T_raw with the gate-free
    inverse T_raw, U = (Dec . T_raw . beta) (V - diag(e^G) K S), W and U0 never formed. With
    fp16 operands it is as accurate as the shipped fp16 pass; in bf16 (FlashQLA's operand
    type) it lands at FLA's error level, over twice ours."""
    shipped = _run(_shipped("shipped: fp16"), gates=gates)
    free16 = _run(_shipped("W/U0-free, fp16"), gates=gates)
    free_bf16 = _run(_shipped("W/U0-free, bf16"), gates=gates)
    assert free16[0] < 1.05 * shipped[0] and free16[1] < 1.05 * shipped[1]
    assert free_bf16[0] > 2 * free16[0] and free_bf16[1] > 2 * free16[1]
