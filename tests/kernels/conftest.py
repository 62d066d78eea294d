"""What the kernels' tests share: a child process in which Triton builds real kernels."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run_without_interpreter(code, unset=(), timeout=600):
    """Run `code` in a child Python process that imports this package, with TRITON_INTERPRET (and the
    variables in `unset`) left out of its environment: Triton builds real kernels there, as on a GPU; no
    GPU needed. Returns the finished process (its returncode, stdout, stderr)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", *unset)}
    return subprocess.run([sys.executable, "-c", code], env=dict(env, PYTHONPATH=os.pathsep.join(
                              [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])),
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.fixture
def run_without_interpreter():
    return _run_without_interpreter
