"""scripts/cluster_probe.py: what Gluon 3.8 compiles for thread-block clusters with TMA multicast on
sm_90 (ahead of time, no GPU). The facts RESULTS.md states about clusters come from here."""
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import cluster_probe  # noqa: E402


def _compile(name):
    outcome = cluster_probe.compile_probe(name)
    if outcome["error"] and "Cannot find ptxas" in outcome["error"]:
        pytest.skip("this Triton install has no assembler for sm_90")
    return outcome


def test_weights_can_be_multicast_across_a_cluster():
    outcome = _compile("weights")
    assert outcome["error"] is None, outcome["error"]
    ptx = outcome["ptx"]
    assert ".reqnctapercluster 2" in ptx                      # a 2-CTA cluster
    assert "barrier.cluster.wait" in ptx                       # the barriers' init is made visible to both
    loads = [line for line in ptx.splitlines() if "cp.async.bulk.tensor.2d.shared::cluster.global" in line]
    assert sum("multicast::cluster" in line for line in loads) == 1   # the weights: one multicast load
    assert sum("multicast::cluster" not in line for line in loads) == 1   # each CTA's own pixels
    assert "wgmma.mma_async" in ptx


def test_im2col_multicast_does_not_assemble_with_this_triton():
    """Triton 3.8 puts the CTA mask before the im2col offsets; ptxas rejects the instruction. When a
    Triton release fixes it this test fails: then the pixels can be multicast too, and RESULTS.md's
    finding about clusters must change."""
    outcome = _compile("im2col")
    assert outcome["error"] is not None, "im2col multicast now compiles: update RESULTS.md and cluster_probe.py"
    assert "Vector expected for argument 4" in outcome["error"], outcome["error"][-2000:]
    rejected = outcome["rejected"]
    assert rejected is not None and "im2col" in rejected and "multicast::cluster" in rejected
    # ... [mbarrier], mask, {offsets}: the mask first, the offsets last
    assert re.search(r"\], %\w+, \{%\w+, %\w+\};$", rejected), rejected
