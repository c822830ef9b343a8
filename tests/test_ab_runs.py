"""bench/ab_runs.py's pieces (CPU only): the variant syntax, the best of rounds per row and
variant, and the ratio summary against the first variant."""
from __future__ import annotations

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import ab_runs as ab  # noqa: E402


def test_parse_variant():
    v = ab.parse_variant("off:wheel=.wheelbuild,FLASHGDN_BWD_EXACT_REACH=0,FLASHGDN_CP=")
    assert (v.name, v.wheel, v.env) == ("off", ".wheelbuild",
                                        {"FLASHGDN_BWD_EXACT_REACH": "0", "FLASHGDN_CP": ""})
    assert ab.parse_variant("default") == ab.Variant("default")
    for bad in ("", ":wheel=x", "a=b", "x:novalue", "x:=1"):
        with pytest.raises(ValueError):
            ab.parse_variant(bad)


def test_wheel_file(tmp_path):
    with pytest.raises(ValueError, match="found 0"):
        ab.wheel_file(str(tmp_path))
    (tmp_path / "a-0.1-py3-none-any.whl").write_text("")
    assert ab.wheel_file(str(tmp_path)).endswith("a-0.1-py3-none-any.whl")
    (tmp_path / "b-0.1-py3-none-any.whl").write_text("")
    with pytest.raises(ValueError, match="found 2"):
        ab.wheel_file(str(tmp_path))
    assert ab.wheel_file("x/y.whl") == "x/y.whl"


def _run(rows):
    return {"rows": [{"h_qk": q, "h_v": v, "seq_label": s,
                      "results": {"flashgdn": {"ms": ms, "fwd_ms": f}}}
                     for q, v, s, ms, f in rows]}


def test_best_of_rounds_and_summary():
    runs = [("old", _run([(2, 8, "1x8192", 1.00, 0.2), (4, 16, "1x4096", 2.0, None)])),
            ("new", _run([(2, 8, "1x8192", 0.90, 0.3), (4, 16, "1x4096", float("nan"), None)])),
            ("old", _run([(2, 8, "1x8192", 0.80, 0.1), (4, 16, "1x4096", 2.2, None)])),
            ("new", _run([(2, 8, "1x8192", 0.95, 0.4), (4, 16, "1x4096", 2.4, None)]))]
    rows = ab.best_of_rounds(runs)
    assert rows["2/8 1x8192"] == {"old": [0.80, 0.1], "new": [0.90, 0.3]}  # the lowest ms
    assert rows["4/16 1x4096"]["old"][0] == 2.0 and math.isnan(rows["4/16 1x4096"]["old"][1])
    assert rows["4/16 1x4096"]["new"][0] == 2.4  # the NaN round is skipped
    lines = ab.summary(rows, ["old", "new"])
    assert "1.125" in lines[1] and "1.200" in lines[2]  # 0.90 / 0.80, 2.4 / 2.0
    g = math.sqrt(1.125 * 1.2)
    assert lines[-1] == f"new / old: geometric mean {g:.4f} over 2 rows, 1.125 .. 1.200"


def test_backward_alone():
    rows = {"2/8 1x8192": {"old": [1.0, 0.25], "new": [0.9, 0.3]},
            "4/16 1x4096": {"old": [2.0, float("nan")], "new": [1.5, 0.5]}}
    alone = ab.backward_alone(rows)
    assert alone["2/8 1x8192"]["old"] == [0.75, 0.25]
    assert alone["2/8 1x8192"]["new"][0] == pytest.approx(0.6)
    assert alone["4/16 1x4096"] == {"new": [1.0, 0.5]}  # no forward time: left out
    lines = ab.summary(alone, ["old", "new"])
    assert "0.800" in lines[1]  # 0.6 / 0.75
