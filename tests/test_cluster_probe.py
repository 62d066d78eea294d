"""scripts/cluster_probe.py: what Gluon 3.9 compiles for thread-block clusters with TMA multicast on
sm_90 (ahead of time, no GPU), and what the probes compute on a Hopper GPU, checked against torch.
The facts RESULTS.md and lesson 05 state about clusters come from here."""
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import common  # noqa: E402
import cluster_probe  # noqa: E402


def _compile(name):
    outcome = cluster_probe.compile_probe(name)
    if outcome["error"] and "Cannot find ptxas" in outcome["error"]:
        pytest.skip("this Triton install has no assembler for sm_90")
    return outcome


def _multicast_loads(ptx, mode):
    return [line.strip() for line in ptx.splitlines()
            if "cp.async.bulk.tensor." in line and f".shared::cluster.global.{mode}" in line
            and "multicast::cluster" in line]


def test_weights_can_be_multicast_across_a_cluster():
    outcome = _compile("weights")
    assert outcome["error"] is None, outcome["error"]
    ptx = outcome["ptx"]
    assert ".reqnctapercluster 2" in ptx                      # a 2-CTA cluster
    assert "barrier.cluster.wait" in ptx                       # the barriers' init is made visible to both
    loads = [line for line in ptx.splitlines() if "cp.async.bulk.tensor.2d.shared::" in line]
    assert sum("multicast::cluster" in line for line in loads) == 1            # the weights, to both CTAs
    assert sum("2d.shared::cta.global" in line for line in loads) == 1         # each CTA's own pixels
    assert "wgmma.mma_async" in ptx


def test_im2col_multicast_assembles_with_the_offsets_before_the_cta_mask():
    """Triton 3.8 put the CTA mask before the im2col offsets and ptxas rejected the instruction
    ("Vector expected for argument 4"); 3.9 emits [mbarrier], {offsets}, mask, as the PTX ISA wants."""
    outcome = _compile("im2col")
    assert outcome["error"] is None, outcome["error"][-2000:]
    loads = _multicast_loads(outcome["ptx"], "im2col")
    assert len(loads) == 1, loads
    assert re.search(r"\], \{%rs\d+, %rs\d+\}, %rs\d+;$", loads[0]), loads[0]
    # Triton fences the barriers' initialisation for the cluster before the first multicast
    assert "fence.mbarrier_init.release.cluster" in outcome["ptx"]


def test_an_arrive_across_the_pair_comes_from_the_leader_alone():
    """`arrive(from_cta=0)` is a broadcast: only rank 0 arrives, remotely, on both CTAs' barriers.
    (When a Triton release lets the second CTA arrive on the leader's barrier, this fails: then a
    pipelined pair can be built, and RESULTS.md and cluster_probe.py must change.)"""
    outcome = _compile("pair_barrier")
    assert outcome["error"] is None, outcome["error"]
    ptx = outcome["ptx"]
    rank = re.search(r"mov\.u32\s+(%r\d+), %cluster_ctarank;", ptx)
    assert rank and re.search(rf"and\.b32\s+%r\d+, {re.escape(rank.group(1))}, 1;", ptx)   # rank 0 only
    assert len(re.findall(r"mbarrier\.arrive\.shared::cluster\.b64", ptx)) == 1


def test_a_split_im2col_box_is_offset_like_a_tiled_one():
    """Each CTA's half of a 256-pixel im2col box: Triton adds rank x 128 to the W coordinate (the
    second of {c, w, h, n}), which in im2col mode is not the pixel 128 places along the walk."""
    outcome = _compile("im2col_split")
    assert outcome["error"] is None, outcome["error"]
    ptx = outcome["ptx"]
    rank = re.search(r"mov\.u32\s+(%r\d+), %cluster_ctarank;", ptx)
    shifted = rank and re.search(rf"shl\.b32\s+(%r\d+), {re.escape(rank.group(1))}, 7;", ptx)
    masked = shifted and re.search(rf"and\.b32\s+(%r\d+), {re.escape(shifted.group(1))}, 128;", ptx)
    w = masked and re.search(rf"add\.s32\s+(%r\d+), {re.escape(masked.group(1))}, -1;", ptx)   # rank * 128 + (w = -1)
    assert w, "the second CTA's box is no longer moved 128 along W: update cluster_probe.py and RESULTS.md"
    load = re.search(r"cp\.async\.bulk\.tensor\.4d\.shared::cta\.global\.im2col\S* \[%r\d+\], "
                     r"\[%rd\d+, \{(%r\d+), (%r\d+), (%r\d+), (%r\d+)\}\]", ptx)
    assert load and load.group(2) == w.group(1), load and load.groups()


needs_hopper = pytest.mark.skipif(not common.is_hopper(), reason="runs a 2-CTA cluster on a Hopper GPU")


@needs_hopper
@pytest.mark.parametrize("tap", [(1, 1), (0, 0), (2, 1)])
def test_im2col_multicast_gives_both_ctas_the_right_pixels(tap):
    lines = cluster_probe.run_probe("im2col", tap=tap)
    assert all("128 of 128 rows match" in line for line in lines), lines


@needs_hopper
def test_weights_multicast_feeds_both_ctas_wgmma():
    lines = cluster_probe.run_probe("weights")
    assert all("128 of 128 rows match" in line for line in lines), lines


@needs_hopper
def test_the_leaders_arrive_reaches_both_ctas():
    assert cluster_probe.run_probe("pair_barrier") == [f"CTA {cta} saw the leader's arrive: True" for cta in (0, 1)]


def test_no_arrive_from_the_second_cta_assembles_for_hopper():
    """The arrive that would release a shared stage both ways (each CTA on both CTAs' barriers,
    `multicast_cta=1`) is `mbarrier.arrive.multicast::cluster`, which ptxas takes only for
    Blackwell and later. (When it assembles for sm_90a, a pipelined pair can be built: update
    cluster_probe.py, RESULTS.md and lesson 05.)"""
    outcome = _compile("pair_arrive_both_ways")
    assert outcome["error"] is not None, "the both-ways arrive now assembles for sm_90a"
    assert "mbarrier.arrive.multicast::cluster" in outcome["error"], outcome["error"][-2000:]
    assert "not supported on .target 'sm_90a'" in outcome["error"], outcome["error"][-2000:]
