"""The Triton kernels compile for a Hopper GPU ahead of time, on a machine without one (``tests/triton_aot.py``):
Triton's interpreter, which the other tests run them in, accepts what its compiler may reject."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_triton_kernels_compile_for_a_gpu():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "tests.triton_aot"], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-4000:]
    compiled = result.stdout.splitlines()
    assert len(compiled) == 17 and all("bytes of shared memory" in line for line in compiled), result.stdout
