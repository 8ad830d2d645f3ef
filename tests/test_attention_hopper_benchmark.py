"""benchmarks/attention_hopper.py's kernels (issue 24's Hopper routes) against the fp32 reference, on the CPU."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # every route in fp32 under the Triton interpreter (the exact reference): about 20 s
def test_every_hopper_route_agrees_with_the_reference_under_the_interpreter():
    completed = subprocess.run([sys.executable, str(REPO / "benchmarks" / "attention_hopper.py"), "--interpret-check",
                                "--interpret-dtypes", "float32"],
                               check=False, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
    checked = [line for line in completed.stdout.splitlines() if "rel_error" in line]
    # six variants x five biases (no_bias, t5, t5_far, t5_bank, t5_bank16), each "ok"
    assert len(checked) == 30 and all(" ok " in line for line in checked)
