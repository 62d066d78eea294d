"""BatchNorm's batch statistics from a conv's per-channel sums (the forward kernel's epilogue adds
each output channel's sum and sum of squares into one fp32 [2, Co] tensor)."""
import torch


def batch_stats_from_sums(stats: torch.Tensor, count: int):
    """(mean, biased variance) per channel of `count` values from their sums, stats[0] = sum x and
    stats[1] = sum x^2: var = E[x^2] - mean^2, clamped at 0 (rounding can make it slightly negative;
    with large means the difference loses digits, which lesson 08 measures)."""
    # (each row divided on its own: a division of the [2, C] whole is a [2, C] buffer, which Inductor computes in
    # a kernel of its own ahead of the [C]-sized kernel that the rest of the statistics fuse into)
    mean, mean_square = stats[0] / count, stats[1] / count
    return mean, torch.addcmul(mean_square, mean, mean, value=-1).clamp_min(0.0)
