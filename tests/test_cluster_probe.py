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


def test_a_barrier_across_the_pair_lives_in_the_leader_and_only_the_leader_waits():
    """The remote arrive the kernel would need exists; the barrier it reaches is waited on by the
    leader CTA alone. (When a Triton release makes every CTA wait on such a barrier, this fails:
    then RESULTS.md and cluster_probe.py must change.)"""
    outcome = _compile("pair_barrier")
    assert outcome["error"] is None, outcome["error"]
    ptx = outcome["ptx"]
    assert re.search(r"@%p\d+ mbarrier\.init\.shared::cta\.b64", ptx)            # predicated: the leader
    # the arrive goes to the leader's copy: a shared::cluster address with the CTA-rank bit cleared
    assert re.search(r"and\.b32\s+(%r\d+), %r\d+, -16777232;", ptx)
    assert "mbarrier.arrive.shared::cluster.b64" in ptx
    assert re.search(r"@!%p\d+ bra\.uni skipWait;", ptx)                          # the other CTA skips the wait


def test_a_split_im2col_box_is_offset_like_a_tiled_one():
    """Each CTA's half of a 256-pixel im2col box: Triton adds rank x 128 to the W coordinate (the
    second of {c, w, h, n}), which in im2col mode is not the pixel 128 places along the walk."""
    outcome = _compile("im2col_split")
    assert outcome["error"] is None, outcome["error"]
    ptx = outcome["ptx"]
    rank = re.search(r"and\.b32\s+(%r\d+), (%r\d+), 1;", ptx)
    assert rank and re.search(rf"mov\.u32\s+{re.escape(rank.group(2))}, %cluster_ctarank;", ptx)
    shifted = re.search(rf"shl\.b32\s+(%r\d+), {re.escape(rank.group(1))}, 7;", ptx)
    assert shifted
    w = re.search(rf"add\.s32\s+(%r\d+), {re.escape(shifted.group(1))}, -1;", ptx)   # rank * 128 + (w = -1)
    assert w
    load = re.search(r"cp\.async\.bulk\.tensor\.4d\.shared::cluster\.global\.im2col\S* \[%r\d+\], "
                     r"\[%rd\d+, \{(%r\d+), (%r\d+), (%r\d+), (%r\d+)\}\]", ptx)
    assert load and load.group(2) == w.group(1), load and load.groups()
