"""The layer's small kernels launched as programmatic dependents (relaycli.kernels.pdl), on any
machine: the kernels, compiled for sm_90, carry the grid-dependency instructions exactly
where their flags ask. Timing and results on the GPU: tests/test_kernels_merge.py,
tests/test_triton_layer_ops.py."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Only looked for, not imported: the interpreter tests must be the first to import Triton
# (they set TRITON_INTERPRET, which @triton.jit reads as modules load).
if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)
ROOT = Path(__file__).resolve().parents[1]


def test_pdl_flags_reach_the_compiled_kernels():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "helpers_aot.py")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    ops = ("add_rms_norm", "rope", "silu_mul")
    assert got == {"layer_ops": {op: [] for op in ops},
                   "layer_ops_pdl": {op: ["griddepcontrol.wait"] for op in ops}}, got
