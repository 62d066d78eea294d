"""The host runtime of lesson 05's convolution: what turns a correct kernel into a fast call.

Lesson 05 ends its kernel with a plain launcher, `conv2d_fprop_launch`: check the inputs, build
three to five TMA descriptors, compute the grid, launch through Triton's generic launcher. That
is all a kernel needs to run, and it costs 150-250 us of host time per call, as much as a whole
ResNet-50 layer (measured on an H100 host, 2026-11-22). This module adds, for the same kernel:

- Plans (`ConvPlan`): everything that depends only on the problem's shape (geometry, TMA im2col
  settings, shared layouts, grid, the kernel's constexprs) is computed once per (shape, dtype,
  config, device). Building the shared layouts alone costs ~10 us each.
- Descriptor templates: the first call's descriptors are validated by Triton; later calls copy
  them and swap in the new tensors (`_with_base`), checking the one property that can differ
  (16-byte alignment). Re-validating costs ~30 us of Python per call. The plan keeps the
  templates without their tensors (`_tensorless`): it must not keep a call's input and output
  alive.
- A fast host path: a call looks its plan up by what it can see at a glance (shapes, dtypes,
  devices, hyper-parameters); a dictionary hit skips the full validation that the first call of
  that key passed, while contiguity and alignment are still checked on every call.
- A direct launch (`DirectLaunch`): after the first launch of a plan, which goes through
  Triton's generic launcher (it binds and re-derives the specialization of ~25 arguments per call,
  tens of microseconds) and compiles, the compiled kernel is called through the CUDA launch that
  Triton's launcher ends in: arguments expanded once, pointers passed as addresses, each TMA
  descriptor's tensor map encoded once per (descriptor, address) instead of on every launch.
  Measured on an H100 host (scripts/host_time.py): 54 us per launch through the generic launcher,
  20 us calling the compiled kernel, 10 us through DirectLaunch; a whole call of `conv2d` 25 us,
  cuDNN's 19 us.
- Config pruning (`prune_configs`): candidates that cannot fit the device (shared memory per
  program and per SM, tensor memory on Blackwell, accumulator registers on Hopper) or do not suit
  the shape (tiles much wider than Co, tails that neither save columns nor fill SMs) are
  dropped before anything is compiled.
- An autotuner (`autotune`): times each pruned candidate the way the benchmark does (do_bench,
  L2 flushed), with the call's epilogue, then the three fastest again in alternating rounds, and
  keeps the fastest for that shape and epilogue (`epilogue_tag`): in this process and in a JSON
  tuning file (`tuning_cache_path()`: $CONV_TUTORIAL_TUNING_CACHE or
  ~/.cache/conv_tutorial/tuning.json) that later processes read.
- A heuristic (`heuristic_config`): a config from the shape alone, for callers that must not
  spend a second timing candidates on a shape's first call (the PyTorch operator of conv_torch.py,
  unless autotuning is asked for): the config with the shortest expected time, from its
  throughput as measured over lesson 05's network suite, the share of useful work it does on
  this shape, and split-K's workspace traffic (scripts/fit_heuristic.py refits the numbers).
- Small channel counts (`FoldedConv`): a layer whose Ci is 8 or less (an RGB stem) is run as an
  R x 1 convolution over S*Ci folded channels, 7 k-steps instead of 49 for ResNet-50's stem.
- Split-K's second kernel (lesson 05, section 7) is launched directly too.
- e4m3 operands (lesson 05, section 9) take the same plans, with a bf16 or e4m3 output; their
  scales arrive folded into the epilogue's (conv_torch's fp8 operator folds them).

`measure_host_time` and `compare_launch_paths` measure what the runtime adds; lesson 05 prints
both. The kernel and its plain launcher live in lesson 05 (`conv_runtime.lesson05` is that module),
its configs in conv_config.py; this module wraps them and imports nothing that builds on it (the
PyTorch operator, conv_torch.py, imports this module, never the other way).
"""
import functools
import json
import os
import time
import warnings
from pathlib import Path

import common  # first: on a machine without a GPU it turns on the Triton interpreter

import torch
import triton
import triton.language as tl

from conv_config import (SHARED_MEMORY_PER_PROGRAM, KernelConfig, adapt_block_k, check_config, groups_fit, ring_bytes,
                         stores_by_row_blocks, tile_counts)

lesson05 = common.load_lesson("05-warp-specialized-conv")     # the kernel and its plain launcher
RUNTIME_DTYPES = lesson05.CONV_DTYPES + (common.FP8,)         # fp16, bf16, and e4m3 (lesson 05, section 9)


# %% Candidate configs and pruning ------------------------------------------------------------------

def _candidates():
    C = KernelConfig
    hopper = [
        C(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4),
        C(block_m=128, block_n=256, block_k=64, num_buffers=3, num_warps=8),
        C(block_m=256, block_n=128, block_k=64, num_buffers=3, num_warps=8),
        C(block_m=128, block_n=128, block_k=64, num_buffers=6, num_warps=8),
        C(block_m=128, block_n=64, block_k=64, num_buffers=6, num_warps=4),
        C(block_m=256, block_n=64, block_k=64, num_buffers=4, num_warps=8),
        C(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4, consumers=2),
        C(block_m=128, block_n=128, block_k=64, num_buffers=5, num_warps=4, consumers=2),
        C(block_m=128, block_n=64, block_k=64, num_buffers=6, num_warps=4, consumers=2),
        C(block_m=64, block_n=128, block_k=64, num_buffers=6, num_warps=4, consumers=2),
        C(block_m=128, block_n=64, block_k=64, num_buffers=4, num_warps=4, programs_per_sm=2),
        C(block_m=64, block_n=128, block_k=64, num_buffers=4, num_warps=4, programs_per_sm=2),
        # 160- and 96-wide tiles (Co = 320, 640, 96, 192, ...): a 32-column tail beside the main MMA
        C(block_m=256, block_n=128, block_k=32, num_buffers=5, num_warps=8, block_n_tail=32),
        C(block_m=128, block_n=128, block_k=64, num_buffers=5, num_warps=4, block_n_tail=32),
        C(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4, consumers=2, block_n_tail=32),
        C(block_m=128, block_n=64, block_k=64, num_buffers=6, num_warps=4, block_n_tail=32),
        # 32-deep K blocks, for channel counts that are not a multiple of 64 (Ci = 96, 160, 288: none
        # wasted; 80: 17% instead of 38%): half the bytes per stage, so twice the stages
        C(block_m=128, block_n=128, block_k=32, num_buffers=8, num_warps=4),
        C(block_m=128, block_n=256, block_k=32, num_buffers=6, num_warps=8),
        C(block_m=256, block_n=128, block_k=32, num_buffers=6, num_warps=8),
        C(block_m=128, block_n=128, block_k=32, num_buffers=8, num_warps=4, consumers=2),
        C(block_m=128, block_n=128, block_k=32, num_buffers=8, num_warps=4, block_n_tail=32),
        C(block_m=128, block_n=64, block_k=32, num_buffers=10, num_warps=4, block_n_tail=32),
        # 192-wide tiles (Co = 192, 384, 576: none wasted), 8 warps for the 192 x 128 accumulator
        C(block_m=128, block_n=128, block_k=32, num_buffers=6, num_warps=8, block_n_tail=64),
        C(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=8, block_n_tail=64),
        # split-K, for layers with fewer tiles than SMs (lesson 05, section 7)
        C(block_m=128, block_n=128, block_k=64, num_buffers=6, num_warps=8, split_k=2),
        C(block_m=128, block_n=128, block_k=64, num_buffers=6, num_warps=8, split_k=3),
        C(block_m=128, block_n=128, block_k=64, num_buffers=6, num_warps=8, split_k=4),
        # 8 slices: batch 1's 7x7 layers (ResNet-50's 512->512 3x3: 4 tiles, 72 k-steps)
        C(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4, split_k=8),
        C(block_m=128, block_n=256, block_k=64, num_buffers=3, num_warps=8, split_k=2),
        C(block_m=128, block_n=128, block_k=64, num_buffers=5, num_warps=4, block_n_tail=32, split_k=2),
        C(block_m=128, block_n=128, block_k=64, num_buffers=5, num_warps=4, block_n_tail=32, split_k=4),
        # 192-row tiles: a 64-row tail below the main MMA (ResNet-50's 7x7 layers at batch 128:
        # M = 6272 = 32.7 x 192, so Co=512 makes 33 x 4 = 132 tiles, one per SM of an H100)
        C(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4, block_m_tail=64),
        # stores by row blocks: a 5th stage fits
        C(block_m=128, block_n=128, block_k=64, num_buffers=5, num_warps=4, block_m_tail=64),
        C(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=8, block_m_tail=64),
        C(block_m=128, block_n=128, block_k=64, num_buffers=3, num_warps=4, consumers=2, block_m_tail=64),
    ]
    blackwell = [
        C(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4),
        C(block_m=128, block_n=256, block_k=64, num_buffers=3, num_warps=4),
        C(block_m=128, block_n=64, block_k=64, num_buffers=6, num_warps=4),
        C(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4, block_n_tail=32),
        C(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4, split_k=2),
        C(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4, split_k=4),
        C(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4, block_n_tail=32, split_k=2),
    ]
    return hopper, blackwell


HOPPER_CANDIDATES, BLACKWELL_CANDIDATES = _candidates()
CANDIDATES = {"sm_90": HOPPER_CANDIDATES, "sm_100": BLACKWELL_CANDIDATES}
SMEM_LIMIT_BYTES = {arch: SHARED_MEMORY_PER_PROGRAM for arch in ("sm_90", "sm_100")}
SMEM_PER_SM_BYTES = 233472                               # 228 KB per SM, 1 KB of it reserved per program


def shared_memory_bytes(config, element_size=2):
    """Shared memory a config needs: the ring's A and B stages, one staging tile per consumer, barriers."""
    c = KernelConfig(*config)
    ring = ring_bytes(c, element_size)
    staging_rows = c.block_m // 2 if stores_by_row_blocks(c) else c.tile_m
    staging = c.consumers * staging_rows * c.tile_n * element_size
    return ring + staging + 2 * c.num_buffers * 8 + 64


def wasted_columns(Co, tile_n):
    """Output columns computed past Co, summed over the row of tiles."""
    return triton.cdiv(Co, tile_n) * tile_n - Co


def wave_efficiency(units, num_sms):
    """The share of SM slots busy over the waves of `units` equal units of work."""
    return units / (triton.cdiv(units, num_sms) * num_sms)


def k_share(config, geometry):
    """The share of each filter tap's K blocks that holds channels, not the zeros TMA fills in past
    Ci: Ci = 80 in 64-deep blocks is 80 / 128; in 32-deep ones 80 / 96."""
    block_k = adapt_block_k(config, geometry.Ci_group).block_k      # the K block the launch will use
    return geometry.Ci_group / (triton.cdiv(geometry.Ci_group, block_k) * block_k)


def k_steps_of(config, geometry):
    """The K loop's length for this config (about: small Ci gets a smaller K block)."""
    return geometry.R * geometry.S * triton.cdiv(geometry.Ci_group, config.block_k)


def _tail_pays(config, geometry, num_sms):
    """A tile widened by a tail saves work where it computes fewer columns past Co (Co=320: 2 x 160
    instead of 3 x 128), or fills the SMs better at no extra columns (Co=1280 on a 16x16 map:
    16 x 8 = 128 tiles of 160 on 132 SMs instead of 160 tiles of 128, 1.2 waves)."""
    plain = config._replace(block_n_tail=0)
    wasted, wasted_plain = wasted_columns(geometry.Co, config.tile_n), wasted_columns(geometry.Co, plain.tile_n)
    if wasted != wasted_plain:
        return wasted < wasted_plain
    return useful_share(config, geometry, num_sms) > useful_share(plain, geometry, num_sms)


def prune_configs(candidates, geometry, arch, smem_limit=None, num_sms=132):
    """Keep the configs that fit the device and suit the shape (no compilation needed)."""
    smem_limit = smem_limit or SMEM_LIMIT_BYTES[arch]
    kept, runnable = [], []     # suited to the shape; able to run it at all (a grouped conv's last resort)
    for config in map(lambda c: KernelConfig(*c), candidates):
        try:
            check_config(config, arch)   # what the arch does not run (ping-pong, TMEM columns, row tails on
        except ValueError:               # Blackwell), a ring too deep for the whole tile's staging buffer
            continue
        smem = shared_memory_bytes(config)
        if smem > smem_limit or config.programs_per_sm * (smem + 1024) > SMEM_PER_SM_BYTES:
            continue
        acc_registers = config.tile_m * config.tile_n // (32 * config.num_warps)  # fp32 per thread
        if arch == "sm_90" and acc_registers > (192 if config.block_m_tail else 160):
            continue                            # (a 192 x 128 tile on 4 warps compiles without spills)
        if config.consumers > 1 and (config.num_warps != 4 or config.programs_per_sm > 1):
            continue                            # 2 consumer warpgroups + the loader's fill the RF
        if config.programs_per_sm > 1 and (config.num_warps != 4 or acc_registers > 64):
            continue                            # 2 x (4 + loader) warps at 128 registers fill the RF
        if geometry.groups > 1 and not groups_fit(config, geometry.Ci_group, geometry.Co_group):
            continue                            # a grouped conv's tiles in one group each (lesson 05, section 10)
        runnable.append(config)
        if config.tile_n > max(64, triton.next_power_of_2(geometry.Co)):  # mostly-empty tiles
            continue
        if config.block_k < 64 and k_share(config, geometry) <= k_share(config._replace(block_k=64), geometry) \
                and config.tile_m * config.tile_n < 256 * 160:
            continue                            # a narrow K block where it saves zeros (or smem: 256 x 160)
        if config.block_n_tail and not _tail_pays(config, geometry, num_sms):
            continue                            # a tail only where it saves work or fills SMs
        if config.split_k > 1:
            tiles = triton.cdiv(geometry.M, config.tile_m) * triton.cdiv(geometry.Co, config.tile_n)
            if wave_efficiency(tiles, num_sms) >= 0.8 or k_steps_of(config, geometry) < 3 * config.split_k:
                continue                        # split-K only where whole tiles leave SMs idle
        kept.append(config)
    # a grouped conv may fit only configs the shape rules would drop: it takes those
    return runnable if not kept and geometry.groups > 1 else kept


# %% Plans: shape-only work done once, descriptor templates, the direct launch --------------------

class DirectLaunch:
    """One compiled kernel, called straight through the CUDA launch that Triton's launcher ends
    in, with its TMA tensor maps remembered.

    Triton's launcher, on every launch: binds and type-checks the arguments, allocates scratch
    space if the kernel wants any, turns each descriptor into a CUtensorMap (Python reads the
    descriptor's fields, then the driver encodes 128 bytes), and asks the driver about each
    pointer argument. A plan knows all of that in advance except the tensors' addresses: its
    descriptors differ from call to call only in their base address, and a network's tensors come
    back at the same few addresses (PyTorch's caching allocator), so the encoded map is kept per
    (descriptor, address) and a repeat costs a dictionary lookup. The call passes the tensors
    themselves where the kernel takes descriptors (a new address is encoded from the plan's
    validated template), and plain integers (data_ptr()) for pointers, which the caller has
    checked. Kernels that need scratch space, and launches a profiler listens to, go through
    Triton's path instead."""

    MAX_TENSOR_MAPS = 256      # per plan and variant; then start over (a map is 128 bytes)

    def __init__(self, compiled, constexprs, templates=()):
        from triton.backends.nvidia.driver import make_tensordesc_arg
        compiled._init_handles()
        self.compiled, self.constexprs, self.encode = compiled, constexprs, make_tensordesc_arg
        driver = triton.runtime.driver.active
        self.current_device, self.current_stream = driver.get_current_device, driver.get_current_stream
        launcher = compiled.run
        metas = getattr(compiled.metadata, "tensordesc_meta", None) or []
        templates = [t for t in templates if t is not None]          # descriptors, in signature order
        signature = [str(kind) for kind in compiled.src.signature.values()]
        slots = [i for i, kind in enumerate(signature) if kind.startswith("tensordesc")]
        if len(metas) != len(templates) or len(templates) != len(slots):
            raise RuntimeError(f"{compiled.name}: {len(templates)} descriptors, {len(metas)} tensor-map "
                               f"layouts, {len(slots)} descriptor parameters")
        # argument position -> (its tensor-map layout, its validated template descriptor)
        self.descriptor_at = dict(zip(slots, zip(metas, templates)))
        self.descriptors_end = max(slots, default=-1) + 1
        self.tensor_maps = {}                  # (argument position, address) -> encoded
        self.lean = (launcher.global_scratch_size == 0 and launcher.profile_scratch_size == 0
                     and not getattr(launcher, "gsan_enabled", False))
        self.launch = driver.utils.launch
        self.launch_head = (compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl,
                            compiled.packed_metadata)
        self.launch_tail = (launcher.arg_annotations, launcher.kernel_signature)

    @classmethod
    def first_launch(cls, kernel, grid, args, kwargs, templates=()):
        """Launch `kernel` through Triton's generic launcher (it binds, specializes and compiles),
        and return a DirectLaunch of the compiled kernel for the calls after it."""
        compiled = kernel[grid](*args, **kwargs)
        return cls(compiled, tuple(kwargs[p.name] for p in kernel.params if p.is_constexpr), templates)

    def _tensor_map(self, tensor, position):
        key = (position, tensor.data_ptr())
        encoded = self.tensor_maps.get(key)
        if encoded is None:                    # a new address: encode from the validated template
            if len(self.tensor_maps) >= self.MAX_TENSOR_MAPS:
                self.tensor_maps.clear()
            meta, template = self.descriptor_at[position]
            encoded = self.tensor_maps[key] = self.encode(_with_base(template, tensor), meta, None)
        return encoded

    def __call__(self, grid, *args):
        """Launch on the current stream. `args`: the kernel's run-time arguments in signature order
        (constexprs left out), a tensor (or None) where the kernel takes a descriptor."""
        if not self.lean or _launch_hooks_set():
            # scratch space to allocate, or a profiler listening: Triton's path, real descriptors
            args = list(args)
            for position, (_, template) in self.descriptor_at.items():
                args[position] = _with_base(template, args[position])
            self.compiled[grid](*args, *self.constexprs)
            return
        expanded = []
        for position in range(self.descriptors_end):
            if position in self.descriptor_at:  # [tensor map, *shape, *strides], as Triton expands it
                expanded += self._tensor_map(args[position], position)
            else:
                expanded.append(args[position])
        expanded += args[self.descriptors_end:]
        expanded += self.constexprs
        stream = self.current_stream(self.current_device())
        self.launch(grid[0], grid[1], grid[2], stream, *self.launch_head, None, None, None, None, None,
                    *self.launch_tail, expanded)


class ConvPlan:
    """Everything about one (shape, dtype, config, device) that does not depend on the tensors."""

    def __init__(self, geometry, dtype, config, arch, num_sms, out_dtype=None):
        self.geometry, self.dtype, self.arch, self.num_sms = geometry, dtype, arch, num_sms
        self.out_dtype = out_dtype or dtype      # e4m3 operands: a bf16 or an e4m3 output
        self.config = KernelConfig(*config)
        check_config(self.config, arch)
        self.template = None      # the first call's ConvLaunch: validated descriptors, grid, constexprs
        self.launches = {}        # epilogue variant -> DirectLaunch of the conv kernel
        self.reduces = {}         # epilogue variant -> DirectLaunch of split-K's second kernel
        self.reduce_grid = self.reduce_scalars = None   # split-K's second kernel: fixed by the plan

    def launch_for(self, x_nhwc, w, bias, scale=None, residual=None):
        """The lesson's ConvLaunch for these tensors; after the first call, built from templates."""
        if self.template is None:
            launch = lesson05.prepare_launch(x_nhwc, w, bias, self.geometry, self.config,
                                           self.arch, self.num_sms, scale, residual, self.out_dtype)
            self.template = _tensorless(launch)
            return launch
        # Same shapes, strides, boxes and layouts: only the base pointers change. Copy the
        # validated descriptors and swap the tensors in.
        x_nhwc, w, _ = common.pad_channels_for_tma(x_nhwc, w)
        template = self.template
        out_2d = _new_like(template.out_2d, x_nhwc.device)
        w_2d = w.view(w.shape[0], -1)
        tensors = (x_nhwc, w_2d, w_2d, out_2d, out_2d)     # in, w, w_tail, out, out_tail
        descriptors = tuple(None if desc is None else _with_base(desc, tensor)
                            for desc, tensor in zip(template.args[:5], tensors))
        partial = _new_like(template.partial, x_nhwc.device)
        pointers = tuple(t if t is not None else out_2d for t in (bias, scale, residual, partial))
        return template._replace(args=descriptors + (pointers,) + template.args[6:], out_2d=out_2d,
                                 partial=partial)

    def run(self, x_nhwc, w, bias=None, scale=None, residual=None, activation="none"):
        # The specialization Triton compiled for: the epilogue, and whether each of its pointers
        # is 16-byte aligned (Triton specializes pointer alignment) and of which dtype. Everything
        # else is fixed by the plan.
        variant = (activation,) + tuple(None if t is None else (t.dtype, t.data_ptr() % 16 == 0)
                                        for t in (bias, scale, residual))
        direct = self.launches.get(variant)
        if direct is None:
            # First launch of this variant: the generic path (binds, specializes, compiles), then
            # a DirectLaunch of the compiled kernel for the calls after it.
            launch = self.launch_for(x_nhwc, w, bias, scale, residual)
            epilogue = lesson05.Epilogue(bias is not None, scale is not None, residual is not None, activation)
            kwargs = lesson05.kernel_constexprs(self.config, self.arch, epilogue)
            self.launches[variant] = DirectLaunch.first_launch(lesson05.conv2d_fprop_kernel, launch.grid,
                                                               launch.args, kwargs, self.template.args[:5])
        else:
            # Later launches: the tensors themselves where the kernel takes descriptors (their
            # tensor maps are remembered by address), addresses for the pointers, the run-time
            # scalars from the plan.
            x_nhwc, w, _ = common.pad_channels_for_tma(x_nhwc, w)
            _check_tma_aligned(x_nhwc)
            _check_tma_aligned(w)
            template = self.template
            out_2d = _new_like(template.out_2d, x_nhwc.device)
            partial = _new_like(template.partial, x_nhwc.device)
            # the tails' descriptors, where the plan has them (weights: a column tail; output: either)
            w_tail, out_tail = (None if desc is None else tensor
                                for desc, tensor in zip(template.args[2:5:2], (w, out_2d)))
            pointers = tuple(t.data_ptr() if t is not None else out_2d.data_ptr() for t in (bias, scale, residual))
            direct(template.grid, x_nhwc, w, w_tail, out_2d, out_tail,
                   (*pointers, (partial if partial is not None else out_2d).data_ptr()), template.args[6])
            reduce = self.reduces.get(variant) if partial is not None else None
            if reduce is not None:
                # split-K's second kernel: its grid and scalars are the plan's, only pointers change
                reduce(self.reduce_grid, partial.data_ptr(), out_2d.data_ptr(), pointers, *self.reduce_scalars)
            if partial is None or reduce is not None:
                return lesson05.output_nhwc(self.geometry, out_2d)
            launch = template._replace(out_2d=out_2d, partial=partial)
        if launch.partial is not None:          # split-K: the second kernel sums the slices
            grid, args, kwargs = lesson05.split_k_epilogue_launch(launch, bias, scale, residual, activation)
            self.reduces[variant] = DirectLaunch.first_launch(lesson05.split_k_epilogue_kernel, grid, args, kwargs)
            self.reduce_grid, self.reduce_scalars = grid, args[3:]
        return launch.result()


def _launch_hooks_set():
    """Whether a profiler (proton, or a user) listens to Triton's launches. Triton 3.8 keeps the
    hooks in a HookChain, which is never None; older versions, a callable or None."""
    hook = triton.knobs.runtime.launch_enter_hook
    return bool(hook.calls) if hasattr(hook, "calls") else hook is not None


def _check_tma_aligned(tensor):
    if tensor.data_ptr() % 16:
        raise ValueError(f"TMA needs 16-byte aligned tensors; this one starts at address "
                         f"{tensor.data_ptr():#x} (a view into another tensor?); pass .clone()")


def _tensorless(launch):
    """A plan's template of a ConvLaunch: its descriptors without their tensors, its output and
    workspace as shapes (meta tensors). A template holding the first call's tensors would keep
    them alive as long as the plan: an activation per layer of a network, and during
    autotuning one per candidate."""
    descriptors = tuple(None if desc is None else _with_base(desc, None) for desc in launch.args[:5])
    as_meta = lambda t: None if t is None else torch.empty(t.shape, dtype=t.dtype, device="meta")  # noqa: E731
    return launch._replace(args=descriptors + (None,) + launch.args[6:], out_2d=as_meta(launch.out_2d),
                           partial=as_meta(launch.partial))


def _new_like(template_tensor, device):
    """A new tensor of a template's shape and dtype on `device` (None for None)."""
    if template_tensor is None:
        return None
    return torch.empty(template_tensor.shape, dtype=template_tensor.dtype, device=device)


def _with_base(template, tensor):
    """A copy of a validated descriptor that points at `tensor` (same shape, strides and dtype),
    or at nothing (None: a template)."""
    if tensor is not None:
        _check_tma_aligned(tensor)
    descriptor = object.__new__(type(template))    # copy.copy, without its ~3 us of generality
    descriptor.__dict__.update(template.__dict__)
    descriptor.base = tensor
    return descriptor


# %% The entry point: fast path, plan cache, autotuning ------------------------------------------

_PLANS = {}          # (geometry, dtype, config, device) -> ConvPlan
_BEST_CONFIG = {}    # (geometry, dtype, device, epilogue tag) -> config chosen by the autotuner
_FAST_PLANS = {}     # call key -> (ConvPlan, FoldedConv or None)


@functools.lru_cache(maxsize=None)
def _device_facts_of(device_index):
    arch, num_sms = common.tma_mma_arch_and_sms("conv2d_fprop")
    props = torch.cuda.get_device_properties(device_index)
    smem = getattr(props, "shared_memory_per_block_optin", SMEM_LIMIT_BYTES[arch])
    return arch, num_sms, smem


def device_facts():
    """(arch, SM count, shared-memory limit) of the current GPU, looked up once per device."""
    if not common.HAS_CUDA:
        common.require_tma_mma_gpu("conv2d_fprop")
    return _device_facts_of(torch.cuda.current_device())


def plan_for(geometry, dtype, config, out_dtype=None):
    arch, num_sms, _ = device_facts()
    key = (geometry, dtype, config, torch.cuda.current_device(), out_dtype)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = ConvPlan(geometry, dtype, config, arch, num_sms, out_dtype)
    return plan


def _call_key(x_nhwc, w, bias, stride, padding, dilation, config, scale, residual, activation, out_dtype, groups):
    """A hashable key of what a call can see at a glance, or None (then the slow path runs)."""
    if not (isinstance(x_nhwc, torch.Tensor) and isinstance(w, torch.Tensor)
            and all(t is None or isinstance(t, torch.Tensor) for t in (bias, scale, residual))):
        return None
    key = (x_nhwc.shape, w.shape, x_nhwc.dtype, w.dtype, x_nhwc.device, w.device,
           *(None if t is None else (t.shape, t.dtype, t.device) for t in (bias, scale, residual)),
           stride, padding, dilation, config, activation, out_dtype, groups)
    try:
        hash(key)
    except TypeError:                    # list-valued stride/padding: no fast path
        return None
    return key


def conv2d(x_nhwc, w, bias=None, stride=1, padding=0, dilation=1, config=None, tune=True,
           scale=None, residual=None, activation="none", out_dtype=None, groups=1):
    """Lesson 05's convolution through the runtime. Same arguments and result as the plain
    launcher `conv2d_fprop_launch` (epilogue included: act(conv * scale + bias + residual)).
    e4m3 operands (lesson 05, section 9) come already scaled: `scale` carries their dequantizing
    factors, and `out_dtype` is bf16 (None) or e4m3 (any output scale folded into scale and bias).
    `config`: a KernelConfig (or its tuple) to use that config; None to choose one per shape: a
    tuned choice (this process's, or the tuning file's) if there is one, else autotune now when
    `tune`, else the heuristic (no timing). Channel counts so small that one tap's channels fill
    a fraction of a K step (a network's RGB stem) take the folded path (`FoldedConv`).
    groups > 1: w is [Co, R, S, Ci / groups], and a group's channel counts must fit a config's
    tiles (`grouped_conv_fits`; lesson 05, section 10)."""
    key = _call_key(x_nhwc, w, bias, stride, padding, dilation, config if config is not None else tune,
                    scale, residual, activation, out_dtype, groups)
    entry = _FAST_PLANS.get(key) if key is not None else None
    if entry is None or not (x_nhwc.is_contiguous() and w.is_contiguous()
                             and all(t is None or t.is_contiguous() for t in (bias, scale, residual))):
        # the slow path validates (and explains) everything
        geometry = common.check_conv_call(x_nhwc, w, bias, stride, padding, dilation, dtypes=RUNTIME_DTYPES,
                                          scale=scale, residual=residual, activation=activation, out_dtype=out_dtype,
                                          groups=groups)
        if groups > 1 and (x_nhwc.dtype == common.FP8 or (config is None and not grouped_conv_fits(
                geometry.Ci_group, geometry.Co_group, device_facts()[0]))):
            raise ValueError(f"{geometry.describe()}: the kernel runs a grouped conv in fp16 or bf16, with whole "
                             f"tiles per group: output channels per group a multiple of a tile's width (64, 96, "
                             f"128, ...), input channels per group of its K block (16, 32 or 64); got "
                             f"{geometry.Ci_group} -> {geometry.Co_group} per group in {x_nhwc.dtype}")
        fold = folded_geometry(geometry) if config is None and x_nhwc.dtype != common.FP8 else None
        run_geometry = fold.geometry if fold is not None else geometry
        if config is not None:
            chosen = KernelConfig(*config)
        elif tune:
            # timed with this call's epilogue: a residual's loads and registers change the ranking
            folded_x, folded_w = fold.apply(x_nhwc, w) if fold is not None else (x_nhwc, w)
            chosen = tuned_config(run_geometry, folded_x, folded_w, bias, scale=scale, residual=residual,
                                  activation=activation, out_dtype=out_dtype)
        else:
            chosen = known_or_heuristic_config(run_geometry, x_nhwc.dtype,
                                               epilogue_tag(scale, residual, activation))
        entry = (plan_for(run_geometry, x_nhwc.dtype, chosen, out_dtype), fold)
        if key is not None:
            _FAST_PLANS[key] = entry
    plan, fold = entry
    if fold is not None:
        x_nhwc, w = fold.apply(x_nhwc, w)
    return plan.run(x_nhwc, w, bias, scale, residual, activation)


@functools.lru_cache(maxsize=None)
def grouped_conv_fits(Ci_group, Co_group, arch=None):
    """Whether candidate configs of `arch` ("sm_90", "sm_100"; None: of both) run a grouped conv of
    these channels per group (fp16/bf16), each tile inside one group (lesson 05, section 10)."""
    return all(any(groups_fit(KernelConfig(*c), Ci_group, Co_group) for c in CANDIDATES[a])
               for a in ([arch] if arch else CANDIDATES))


def current_arch():
    """"sm_90" or "sm_100" where this machine has the kernel's GPU, else None (once per device)."""
    return _arch_of_device(torch.cuda.current_device() if common.HAS_CUDA else None)


@functools.lru_cache(maxsize=None)
def _arch_of_device(device_index):
    if device_index is None or not common.is_tma_mma_capability(torch.cuda.get_device_capability(device_index)):
        return None
    return _device_facts_of(device_index)[0]


def residual_fits_in_registers(config, arch="sm_90"):
    """Whether a config's build with a residual epilogue keeps its tile in registers (Hopper; on
    Blackwell the accumulator lives in tensor memory). The consumer holds TILE_M x TILE_N fp32
    accumulators spread over its threads, and beside them the residual of the rows it stores at
    once, bf16 (half a register per value): the whole tile, or where the tile is stored by row
    blocks (lesson 05, section 6) half the main rows. One 4-warp consumer may use up to 256
    registers per thread, and fits 192 of these; 8-warp consumers and ping-pong warpgroups get
    232-240, and fit 160 (tests check this against the stack frame of every candidate's build)."""
    if arch != "sm_90":
        return True
    accumulators = config.tile_m * config.tile_n // (32 * config.num_warps)
    stored_rows = config.block_m // 2 if stores_by_row_blocks(config) else config.tile_m
    residual = accumulators * stored_rows // (2 * config.tile_m)
    budget = 192 if (config.num_warps == 4 and config.consumers == 1) else 160
    return accumulators + residual <= budget


def fitted_to_epilogue(config, has_residual, arch="sm_90"):
    """How to run, given the epilogue, a config chosen without it (the heuristic's, or a plain
    conv's tuned choice); the autotuner times its candidates this way too when the call has a
    residual. A residual tile adds registers, and a row tail on 4-warp consumers has no room for
    them: its build spills (232 bytes per thread; ResNet-50's 14x14 256->1024 1x1 + residual took
    0.086 ms), so it moves to one 8-warp consumer, the same tile with half the registers per
    thread (0.070 ms). Other builds that spill a little are kept: letting the heuristic pick one
    with room instead measured slower (ResNet-50's 56x56 64->256 1x1 + residual: 0.241 ms against
    0.215 for the tuned 128x256 tile, which spills 176 bytes)."""
    if has_residual and config.block_m_tail and not residual_fits_in_registers(config, arch):
        return config._replace(num_warps=8, consumers=1, num_buffers=4)
    return config


# %% Small channel counts: fold the filter's columns into the channels ---------------------------
# A stem layer (Ci=3, 7x7, stride 2) gives the kernel 49 taps of 3 channels, padded to 8 for TMA
# and to 16 for the MMA: 49 k-steps that are 81% zeros, each a 128-pixel x 32-byte TMA box. Here
# the S columns of the filter are folded into the channels instead: x_fold[n, h, ox, s*Ci + c] =
# x[n, h, ox*stride_w + s*dil_w - pad_w, c] (zero outside), a copy of S*Ci/stride_w times the input's
# size, and the conv becomes R x 1 with stride (stride_h, 1) over S*Ci channels: 7 k-steps of
# 21 channels (padded to 24, a 32-deep K step) for the stem. Only the rows of the filter remain
# as taps, read through the same im2col TMA as every other layer. The fold is one small Triton
# kernel (`fold_columns_kernel`); three torch copies doing the same took more than half the
# stem's time.

FOLD_MAX_CHANNELS = 8       # a padded Ci of 8 or less: one tap fills at most half of a 16-deep K step


@triton.jit
def fold_columns_kernel(x_ptr, out_ptr, rows, W, out_w, Ci, stride_w, pad_w, dil_w, channels,
                        channels_padded, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """out[row, ox, s*Ci + c] = x[row, ox*stride_w + s*dil_w - pad_w, c] (0 outside, and in the
    padding channels), row = n*H + h: one pass that reads each input pixel from cache S/stride_w
    times and writes the folded tensor once."""
    pixels = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)      # (row, ox), linearized
    folded = tl.arange(0, BLOCK_C)                                    # s*Ci + c
    row, ox = pixels // out_w, pixels % out_w
    s, c = folded // Ci, folded % Ci
    ix = ox[:, None] * stride_w + s[None, :] * dil_w - pad_w
    in_range = pixels[:, None] < rows * out_w
    valid = in_range & (folded[None, :] < channels) & (ix >= 0) & (ix < W)
    source = (row[:, None].to(tl.int64) * W + ix) * Ci + c[None, :]
    values = tl.load(x_ptr + source, mask=valid, other=0.0)
    target = pixels[:, None].to(tl.int64) * channels_padded + folded[None, :]
    tl.store(out_ptr + target, values, mask=in_range & (folded[None, :] < channels_padded))


class FoldedConv:
    """The R x 1 convolution over folded channels that computes a small-Ci convolution."""

    def __init__(self, geometry):
        g = self.original = geometry
        self.channels = g.S * g.Ci
        self.channels_padded = -(-self.channels // 8) * 8       # 16-byte pixels for TMA
        self.geometry = common.conv_geometry(
            (g.N, g.H, g.out_w, self.channels_padded), (g.Co, g.R, 1, self.channels_padded),
            (g.stride[0], 1), (g.padding[0], 0), (g.dilation[0], 1))

    def apply(self, x_nhwc, w):
        """(x_fold [N, H, out_w, channels_padded], w_fold [Co, R, 1, channels_padded])."""
        g = self.original
        x_fold = x_nhwc.new_empty(g.N, g.H, g.out_w, self.channels_padded)
        rows, block_p = g.N * g.H, 64
        fold_columns_kernel[(triton.cdiv(rows * g.out_w, block_p),)](
            x_nhwc, x_fold, rows, g.W, g.out_w, g.Ci, g.stride[1], g.padding[1], g.dilation[1],
            self.channels, self.channels_padded, BLOCK_P=block_p,
            BLOCK_C=triton.next_power_of_2(self.channels_padded))
        w_fold = w.new_zeros(g.Co, g.R, 1, self.channels_padded)      # small: Co x R x S*Ci
        w_fold[..., :self.channels] = w.reshape(g.Co, g.R, 1, self.channels)
        return x_fold, w_fold


def folded_geometry(geometry):
    """A FoldedConv for a convolution whose channels are too few for a K step, else None."""
    if geometry.Ci > FOLD_MAX_CHANNELS or geometry.S == 1 or geometry.S * geometry.Ci > 256 or geometry.groups > 1:
        return None
    return FoldedConv(geometry)


# %% Choosing a config: the heuristic, the autotuner, and the tuning file ----------------------

# Each Hopper config's throughput on a layer it fills (TFLOPS with every SM busy in every wave and
# no columns, rows or channels past the layer): the median over the 84 layers of lesson 05's
# network suite (ResNet-50, the SD UNet, Inception v3) of its measured TFLOPS divided by its share
# of useful work (`useful_share`). Split-K adds its workspace's round trip (SPLIT_K x M x Co fp32
# values, written and read), at the effective bandwidth fitted the same way. Measured on an H100
# with Triton 3.9, 2026-11-24, from the autotuner's timings in the suite's run
# (scripts/fit_heuristic.py refits both from the suite's logs). Checked leave-one-out (each layer's
# config picked from the table fitted without it): 0.966x of that layer's fastest config, geometric
# mean, worst 0.79x (IncV3 17x17 192->192 3x3 s2); the table fitted on ResNet-50 and the UNet alone
# scored 0.950x on the same 84 layers.
HOPPER_CONFIG_TFLOPS = {   # split_k left at 1: split-K's cost is modelled apart
    KernelConfig(block_m=128, block_n=128, block_k=64, num_buffers=5, num_warps=4, block_n_tail=32): 679,
    KernelConfig(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4, consumers=2, block_n_tail=32): 653,
    KernelConfig(block_m=256, block_n=128, block_k=32, num_buffers=5, num_warps=8, block_n_tail=32): 613,
    KernelConfig(block_m=128, block_n=256, block_k=64, num_buffers=3, num_warps=8): 527,
    KernelConfig(block_m=256, block_n=128, block_k=64, num_buffers=3, num_warps=8): 520,
    KernelConfig(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=8, block_n_tail=64): 502,
    KernelConfig(block_m=256, block_n=128, block_k=32, num_buffers=6, num_warps=8): 501,
    KernelConfig(block_m=128, block_n=256, block_k=32, num_buffers=6, num_warps=8): 500,
    KernelConfig(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4, block_m_tail=64): 481,
    KernelConfig(block_m=128, block_n=128, block_k=64, num_buffers=5, num_warps=4, block_m_tail=64): 477,
    KernelConfig(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=8, block_m_tail=64): 474,
    KernelConfig(block_m=128, block_n=128, block_k=32, num_buffers=6, num_warps=8, block_n_tail=64): 473,
    KernelConfig(block_m=128, block_n=128, block_k=64, num_buffers=3, num_warps=4, consumers=2, block_m_tail=64): 471,
    KernelConfig(block_m=128, block_n=128, block_k=64, num_buffers=6, num_warps=8): 468,
    KernelConfig(block_m=128, block_n=128, block_k=64, num_buffers=5, num_warps=4, consumers=2): 467,
    KernelConfig(block_m=128, block_n=128, block_k=32, num_buffers=8, num_warps=4, block_n_tail=32): 463,
    KernelConfig(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4): 456,
    KernelConfig(block_m=128, block_n=128, block_k=64, num_buffers=4, num_warps=4, consumers=2): 453,
    KernelConfig(block_m=64, block_n=128, block_k=64, num_buffers=4, num_warps=4, programs_per_sm=2): 405,
    KernelConfig(block_m=256, block_n=64, block_k=64, num_buffers=4, num_warps=8): 390,
    KernelConfig(block_m=128, block_n=64, block_k=64, num_buffers=4, num_warps=4, programs_per_sm=2): 373,
    KernelConfig(block_m=128, block_n=128, block_k=32, num_buffers=8, num_warps=4): 368,
    KernelConfig(block_m=128, block_n=128, block_k=32, num_buffers=8, num_warps=4, consumers=2): 367,
    KernelConfig(block_m=128, block_n=64, block_k=64, num_buffers=6, num_warps=4, consumers=2): 359,
    KernelConfig(block_m=128, block_n=64, block_k=32, num_buffers=10, num_warps=4, block_n_tail=32): 359,
    KernelConfig(block_m=128, block_n=64, block_k=64, num_buffers=6, num_warps=4): 352,
    KernelConfig(block_m=64, block_n=128, block_k=64, num_buffers=6, num_warps=4, consumers=2): 339,
    KernelConfig(block_m=128, block_n=64, block_k=64, num_buffers=6, num_warps=4, block_n_tail=32): 320,
}
SPLIT_K_WORKSPACE_BYTES_PER_S = 2.05e12   # fitted with the table (mostly L2: the slices meet there)
# What split-K costs however little its workspace moves: the second kernel's start behind the first.
# Measured apart, on ResNet-50's batch-1 layers (H100, 2026-11-24: 2-8 slices of 4-7 tiles took
# 3-4.5 us longer than their share of the unsplit time), and not part of the check above; without
# it the heuristic split layers with a few short tiles, such as 14x14 1024->256 1x1 at batch 1
# (9.5 us instead of 5.8 with whole 128x64 tiles).
SPLIT_K_SECONDS = 3.5e-6


def split_tiles(config, geometry, num_sms):
    """(programs, tiles, tiles split by split-K), as the lesson's launch counts them (tile_counts)."""
    programs, tiles, whole = tile_counts(config, geometry.M, geometry.Co, num_sms)
    return programs, tiles, tiles - whole


def useful_share(config, geometry, num_sms):
    """The share of the work a config does that is useful: columns past Co, rows past M and
    channels past Ci (k_share) are wasted, and so are the SM slots idle in the last wave (of tiles,
    or of split-K's slices)."""
    programs, tiles, split = split_tiles(config, geometry, num_sms)
    useful = geometry.M * geometry.Co / (tiles * config.tile_m * config.tile_n)
    # time in tile-lengths: the waves of whole tiles, then the slices' waves, 1/split_k long each
    time = triton.cdiv(tiles - split, programs) + triton.cdiv(split * config.split_k, programs) / config.split_k
    return useful * k_share(config, geometry) * tiles / (num_sms * config.programs_per_sm * time)


def split_k_workspace_bytes(config, geometry, num_sms):
    """Bytes split-K moves through its fp32 workspace: each slice of a split tile, written and read."""
    return 2 * config.split_k * split_tiles(config, geometry, num_sms)[2] * config.tile_m * config.tile_n * 4


def config_tflops(config, arch):
    """A config's throughput on a layer it fills, split-K aside: measured (HOPPER_CONFIG_TFLOPS),
    or where there is no measurement (Blackwell; new candidates) estimated from the bytes a tile
    moves per FLOP: a BLOCK_M x TILE_N tile reads BLOCK_M + TILE_N rows per k-step for
    BLOCK_M * TILE_N products."""
    measured = HOPPER_CONFIG_TFLOPS.get(config._replace(split_k=1)) if arch == "sm_90" else None
    if measured is None:
        reuse = config.tile_m * config.tile_n / (config.tile_m + config.tile_n)
        measured = 700 * reuse / (reuse + 30)
    return measured


def expected_seconds(config, geometry, arch, num_sms):
    """The heuristic's model of a config's time on a layer: its FLOPs at the config's throughput
    times its useful share, plus split-K's cost: its second kernel's start and its workspace's
    round trip."""
    seconds = geometry.flops / (config_tflops(config, arch) * 1e12 * useful_share(config, geometry, num_sms))
    if config.split_k > 1 and split_tiles(config, geometry, num_sms)[2]:
        seconds += SPLIT_K_SECONDS + split_k_workspace_bytes(config, geometry, num_sms) / SPLIT_K_WORKSPACE_BYTES_PER_S
    return seconds


def heuristic_config(geometry, arch, num_sms, smem_limit=None):
    """A config from the shape alone, in microseconds: the pruned candidate with the shortest
    expected time (`expected_seconds`); the deeper ring breaks ties."""
    candidates = prune_configs(CANDIDATES[arch], geometry, arch, smem_limit, num_sms)
    if not candidates:
        raise RuntimeError(f"no kernel config fits {geometry.describe()} on this GPU")
    return min(candidates, key=lambda c: (round(expected_seconds(c, geometry, arch, num_sms) * 1e7),
                                          -c.num_buffers))


def epilogue_tag(scale=None, residual=None, activation="none"):
    """What an epilogue adds to the conv, as the tuner keys it: "" for a plain conv (a bias alone
    counts as plain: one add per column, nothing measurable), else e.g. "scale+residual+relu".
    Choices are tuned per tag: with a residual the epilogue loads a tile as large as the output
    and holds it in registers, and the fastest config can change (ResNet-50's 28x28 128->512 1x1
    + residual: 0.147 ms with the plain conv's choice; RESULTS.md)."""
    parts = (["scale"] if scale is not None else []) + (["residual"] if residual is not None else []) \
        + ([activation] if activation != "none" else [])
    return "+".join(parts)


def known_or_heuristic_config(geometry, dtype, tag=""):
    """The tuned choice for this shape and epilogue if one is known (this process or the tuning
    file); else the plain conv's tuned choice, fitted to the epilogue; else the heuristic's, fitted.
    Never times anything."""
    remembered = _remembered_config(geometry, dtype, tag)
    if remembered is not None:
        return remembered
    remembered = _remembered_config(geometry, dtype) if tag else None
    if remembered is None:
        arch, num_sms, smem = device_facts()
        remembered = heuristic_config(geometry, arch, num_sms, smem)
    return fitted_to_epilogue(remembered, "residual" in tag.split("+"), device_facts()[0])


def _remembered_config(geometry, dtype, tag=""):
    """The tuned choice for this shape and epilogue from this process or, failing that, the
    tuning file; None."""
    key = (geometry, dtype, torch.cuda.current_device(), tag)
    if key not in _BEST_CONFIG:
        saved = _load_tuning_file().get(_tuning_file_key(geometry, dtype, tag))
        if saved is not None:
            _BEST_CONFIG[key] = KernelConfig(*saved["config"])
    return _BEST_CONFIG.get(key)


def tuned_config(geometry, x_nhwc, w, bias, verbose=False, retune=False, scale=None, residual=None,
                 activation="none", out_dtype=None):
    """The autotuner's choice for this shape, dtype and epilogue (`epilogue_tag`): from this
    process, the tuning file, or (first time, or `retune`) timed now, with the epilogue, and saved
    to the tuning file."""
    tag = epilogue_tag(scale, residual, activation)
    key = (geometry, x_nhwc.dtype, torch.cuda.current_device(), tag)
    if retune or _remembered_config(geometry, x_nhwc.dtype, tag) is None:
        best, tflops = autotune(geometry, x_nhwc, w, bias, verbose, scale, residual, activation, out_dtype)
        _BEST_CONFIG[key] = best
        _save_tuning(geometry, x_nhwc.dtype, best, tflops, tag)
    return _BEST_CONFIG[key]


_AUTOTUNE = os.environ.get("CONV_TUTORIAL_AUTOTUNE", "0") == "1"


def set_autotune(enabled: bool):
    """Whether the PyTorch operator (conv_torch) times the candidates of a new shape (True) or
    takes the heuristic's config (False, the default; $CONV_TUTORIAL_AUTOTUNE=1 sets it)."""
    global _AUTOTUNE
    _AUTOTUNE = bool(enabled)


def autotune_enabled() -> bool:
    return _AUTOTUNE


def tuning_cache_path() -> Path:
    """Where tuned choices are kept: $CONV_TUTORIAL_TUNING_CACHE, or ~/.cache/conv_tutorial/tuning.json."""
    return Path(os.environ.get("CONV_TUTORIAL_TUNING_CACHE")
                or Path.home() / ".cache" / "conv_tutorial" / "tuning.json")


def _tuning_file_key(geometry, dtype, tag=""):
    """One GPU model, one Triton, one shape, dtype and epilogue: a choice made elsewhere is not
    trusted."""
    return (f"{torch.cuda.get_device_name()} | triton {triton.__version__} | {geometry.describe()} | "
            f"{str(dtype).replace('torch.', '')}" + (f" | epilogue {tag}" if tag else ""))


_TUNING_FILE = None    # its contents, read once per process


def _load_tuning_file():
    global _TUNING_FILE
    if _TUNING_FILE is None:
        try:
            _TUNING_FILE = json.loads(tuning_cache_path().read_text())
        except (OSError, ValueError):
            _TUNING_FILE = {}
    return _TUNING_FILE


def _save_tuning(geometry, dtype, config, tflops, tag=""):
    entries = _load_tuning_file()
    entries[_tuning_file_key(geometry, dtype, tag)] = {"config": list(config), "tflops": round(tflops, 1)}
    path = tuning_cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(entries, indent=1, sort_keys=True))
        os.replace(partial, path)           # atomic: a reader never sees half a file
    except OSError as error:
        warnings.warn(f"could not save the tuning file {path}: {error}")


def autotune(geometry, x_nhwc, w, bias, verbose=False, scale=None, residual=None, activation="none",
             out_dtype=None):
    """Time the pruned candidates on the real tensors, with the call's epilogue; return (best
    config, its TFLOPS).

    A first pass times each candidate briefly; the three fastest are then timed again in three
    alternating rounds of longer runs, and the median round decides. (Timing each candidate once
    for ~20 ms let clock and cache noise pick different configs in different processes.) Each
    timing is the 20th percentile of do_bench's calls, not the median: on a layer of 30-50 us the
    host's ~40 us per call is hidden only just, and a stall of the host process (which can only
    add time) then made the median of a fast config look 3-5x slow, and picked a slow one."""
    arch, num_sms, smem = device_facts()
    candidates = prune_configs(CANDIDATES[arch], geometry, arch, smem, num_sms)
    # with a residual, each candidate as the runtime would run it (row tails move to 8 warps)
    candidates = list(dict.fromkeys(fitted_to_epilogue(c, residual is not None, arch) for c in candidates))
    epilogue = dict(scale=scale, residual=residual, activation=activation)
    timed = lambda plan: lambda: plan.run(x_nhwc, w, bias, **epilogue)  # noqa: E731
    if not candidates:
        raise RuntimeError(f"no kernel config fits {geometry.describe()} on this GPU")
    timings, errors = {}, []
    for config in candidates:
        plan = plan_for(geometry, x_nhwc.dtype, config, out_dtype)
        try:
            plan.run(x_nhwc, w, bias, **epilogue)   # compile before timing
            # Timed as the benchmark times (do_bench: L2 flushed before each call, as a layer in a
            # network finds its weights: evicted since the last pass). The host time per call
            # (~35 us) hides behind do_bench's cache flush, so this ranks the kernels.
            timings[config] = triton.testing.do_bench(timed(plan), warmup=5, rep=20, quantiles=[0.2])
        except Exception as error:  # a config the compiler or the launch refuses: skip it
            errors.append(f"{config}: {type(error).__name__}: {error}")
            if verbose:
                print(f"   config {config} skipped: {type(error).__name__}: {str(error)[:100]}")
    if not timings:
        raise RuntimeError(f"every kernel config failed for {geometry.describe()}; first error: "
                           f"{errors[0] if errors else '?'}")
    finalists = sorted(timings, key=timings.get)[:3]
    rounds = {config: [] for config in finalists}
    for _ in range(3):
        for config in finalists:
            plan = plan_for(geometry, x_nhwc.dtype, config, out_dtype)
            rounds[config].append(triton.testing.do_bench(timed(plan), warmup=10, rep=60,
                                                          quantiles=[0.2]))   # one quantile: a float
    medians = {config: sorted(ms)[1] for config, ms in rounds.items()}
    best = min(medians, key=medians.get)
    if verbose:
        for config, ms in sorted(timings.items(), key=lambda item: item[1]):
            final = f"   final median {geometry.flops / medians[config] / 1e9:7.1f}" if config in medians else ""
            print(f"   {str(config):<40} {geometry.flops / ms / 1e9:7.1f} TFLOPS{final}"
                  + ("   <- chosen" if config == best else ""))
    return best, geometry.flops / medians[best] / 1e9


# %% What the runtime adds, measured ---------------------------------------------------------------

def host_us_per_call(call, calls=200):
    """Host time of one call in us: Python + launch, without waiting for the GPU."""
    call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    host_us = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host_us


def compare_launch_paths(plan, x_nhwc, w, calls=200):
    """Host us per launch of one plan: Triton's generic launcher; the compiled kernel called
    directly (its tensor maps encoded on every launch); the plan's DirectLaunch (maps remembered)."""
    plan.run(x_nhwc, w)
    launch = plan.launch_for(x_nhwc, w, None)
    kwargs = lesson05.kernel_constexprs(plan.config, plan.arch)
    direct = plan.launches[("none", None, None, None)]
    w_tail, out_tail = (None if desc is None else desc.base for desc in (launch.args[2], launch.args[4]))
    raw_args = (launch.args[0].base, launch.args[1].base, w_tail, launch.out_2d, out_tail) + launch.args[5:]
    return {
        "generic": host_us_per_call(lambda: lesson05.conv2d_fprop_kernel[launch.grid](*launch.args, **kwargs), calls),
        "compiled": host_us_per_call(lambda: direct.compiled[launch.grid](*launch.args, *direct.constexprs), calls),
        "direct": host_us_per_call(lambda: direct(launch.grid, *raw_args), calls),
    }


def measure_host_time(x_nhwc, w, stride, padding, config):
    """Host us per call: lesson 05's plain launcher against the runtime, and of the launch alone,
    Triton's launcher, the compiled kernel called directly, and DirectLaunch."""
    geometry = common.conv_geometry(x_nhwc.shape, w.shape, stride, padding)
    launches = compare_launch_paths(plan_for(geometry, x_nhwc.dtype, config), x_nhwc, w)
    return {
        "plain_launcher_us": host_us_per_call(
            lambda: lesson05.conv2d_fprop_launch(x_nhwc, w, None, stride, padding, config=config), calls=50),
        "runtime_us": host_us_per_call(lambda: conv2d(x_nhwc, w, None, stride, padding, config=config)),
        "generic_launch_us": launches["generic"], "compiled_launch_us": launches["compiled"],
        "direct_launch_us": launches["direct"],
    }


def print_host_time(config, dtype=torch.bfloat16):
    """Lesson 05's demo of what the runtime saves: measure_host_time on one layer, printed."""
    x_nhwc, w = common.random_conv_inputs(32, 28, 28, 128, 128, 3, 3, dtype)
    us = measure_host_time(x_nhwc, w, 1, 1, config)
    print(f"\nhost time per call on this machine (N=32, 28x28, 128->128, 3x3): plain launcher "
          f"{us['plain_launcher_us']:.0f} us, runtime {us['runtime_us']:.0f} us; of which the launch: "
          f"Triton's launcher {us['generic_launch_us']:.0f} us, the compiled kernel called directly "
          f"{us['compiled_launch_us']:.0f} us, the runtime's DirectLaunch {us['direct_launch_us']:.0f} us")
