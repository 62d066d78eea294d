"""benchmarks/host_time.py on a CPU: its paths name real layers, and its profile sorter puts the
functions a call runs where they belong."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import host_time  # noqa: E402


class Stats:
    """What where_time_goes reads of a pstats.Stats: {(file, line, name): (calls, calls, tottime, cumtime, callers)}."""
    def __init__(self, entries):
        self.stats = {key: (1, 1, tottime, tottime, {}) for key, tottime in entries.items()}


@pytest.mark.parametrize("key, category", [
    (("~", 0, "<built-in method launch>"), "Triton's launcher"),
    (("/site-packages/triton/backends/nvidia/driver.py", 500, "__call__"), "Triton's launcher"),
    (("/repo/conv_tutorial/core/tma.py", 170, "conv_tma_descriptors"), "descriptor encoding"),
    (("/repo/conv_tutorial/core/geometry.py", 160, "check_conv_call"), "argument checks"),
    (("/repo/conv_tutorial/backward.py", 54, "lesson06_reason"), "argument checks"),
    (("/repo/conv_tutorial/launch.py", 20, "plan_for"), "plans and keys"),
    (("/repo/conv_tutorial/launch.py", 300, "__call__"), "the package's launch path"),
    (("~", 0, "<built-in method torch.empty>"), "allocations"),
    (("~", 0, "<built-in method torch.zeros>"), "allocations"),
    (("/site-packages/torch/_ops.py", 1338, "__call__"), "torch.library dispatch"),
    (("~", 0, "<built-in method torch._ops.conv_tutorial.conv2d>"), "torch.library dispatch"),
    (("/repo/conv_tutorial/ops.py", 120, "_conv2d_with_epilogue"), "the package's other Python"),
    (("~", 0, "<method 'permute' of 'torch._C.TensorBase' objects>"), "torch, other"),
    (("/usr/lib/python3.11/functools.py", 1, "wrapper"), "other"),
])
def test_each_function_lands_in_its_category(key, category):
    assert host_time.where_time_goes(Stats({key: 2e-3}), calls=100) == {category: 20.0}


def test_shares_add_up_per_call_and_drop_what_rounds_to_nothing():
    stats = Stats({("~", 0, "<built-in method torch.empty>"): 1e-3, ("~", 0, "<built-in method torch.zeros>"): 3e-3,
                   ("/repo/conv_tutorial/ops.py", 1, "f"): 1e-9})
    assert host_time.where_time_goes(stats, calls=10) == {"allocations": 400.0}


def test_every_path_names_a_layer_of_resnet50():
    from layers import resnet50_layers
    labels = {layer.label for layer in resnet50_layers()}
    assert [label for _, label in host_time.PATHS if label not in labels] == []
    kinds = {path.split(",")[0].split(" ")[0] for path, _ in host_time.PATHS}
    assert kinds == {"forward", "dgrad", "wgrad", "fp8"}


def test_dry_run_lists_the_paths_without_a_gpu():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_time.py"), "--paths", "--dry-run"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert len([line for line in out.stdout.splitlines() if line.strip()]) == len(host_time.PATHS)
    assert "no such layer" not in out.stdout
