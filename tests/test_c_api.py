"""Builds the C API's GoogleTest suite (tests/cpp, CPU backend only) and runs it with ctest."""
from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("ctest") is None,
                    reason="cmake/ctest not installed: C API GoogleTest suite SKIPPED")
def test_c_api_googletest(tmp_path):
    build = tmp_path / "build"
    configure = subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(build), "-DFLASHGDN_CUDA=OFF", "-DFLASHGDN_TESTS=ON",
         "-DFLASHGDN_SHARED=OFF", "-DCMAKE_BUILD_TYPE=Release"],
        capture_output=True, text=True)
    if configure.returncode != 0 and "GTest" in configure.stderr + configure.stdout:
        pytest.skip("GoogleTest (libgtest-dev) not installed: C API GoogleTest suite SKIPPED")
    assert configure.returncode == 0, configure.stdout + configure.stderr
    built = subprocess.run(["cmake", "--build", str(build), "--parallel", "2"],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stdout + built.stderr
    ran = subprocess.run(["ctest", "--output-on-failure"], cwd=build, capture_output=True,
                         text=True)
    print(ran.stdout)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "100% tests passed" in ran.stdout
