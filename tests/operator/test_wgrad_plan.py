"""The operator's wgrad plan (conv_tutorial/wgrad.py): built once per shape, its descriptors re-based on
each call's tensors, its kernel arguments in the kernel's order, lesson 07's split and grid, lesson 07's
errors for bad calls.

On a CPU, a stand-in takes the place of the compiled kernels (`StandInLaunch`, patched over DirectLaunch):
it computes what each kernel computes from exactly what the plan hands it (descriptors, pointers as
addresses, the shape tuple), so a wrong tensor, address, slice or scalar shows up as a wrong dW, compared
with torch.nn.grad. The split-K sum is the package's Triton kernel itself, in the interpreter (on a GPU
machine, compiled, on copies). On a Hopper or
Blackwell GPU: the plan's dW against torch's and against lesson 07's plain launcher, bit for bit."""
import ctypes
import inspect
import re
import warnings

import common

import pytest
import torch

import conv_tutorial
from conv_tutorial import backward, launch, runtime, wgrad
from conv_tutorial.kernels import gradients, wgrad as wgrad_kernels

needs_gpu = pytest.mark.skipif(not common.has_tma_mma_gpu(), reason=common.GLUON_SKIP_REASON)
lesson07 = common.load_lesson("07-conv-wgrad")    # its CPU models: wgrad_reference, the inputs, BAD_CALLS


def at_address(address, dtype, numel):
    """The CPU tensor of `numel` values of `dtype` at a host address: how the stand-in follows a pointer."""
    return torch.frombuffer((ctypes.c_char * (numel * dtype.itemsize)).from_address(address), dtype=dtype, count=numel)


def run_parameters(jit_function):
    """A kernel's run-time parameters (constexprs left out), by inspect, in its signature's order."""
    return [name for name, p in inspect.signature(jit_function.fn).parameters.items()
            if "constexpr" not in str(p.annotation) and name not in ("BLOCK",)]


class StandInLaunch:
    """launch.DirectLaunch's place on a CPU. `first_launch` gets Triton's real launch (validated
    descriptors, tensors); a call after it gets what the plan hands DirectLaunch (tensors where the
    kernel takes descriptors, which DirectLaunch re-bases its templates on, as here; addresses for
    pointers). Both compute the kernel's result from what they were handed."""
    made = []

    def __init__(self, kernel_fn, constexprs, templates):
        self.kernel_fn, self.constexprs, self.templates, self.calls = kernel_fn, constexprs, templates, []

    @classmethod
    def first_launch(cls, kernel_fn, grid, args, kwargs, templates=()):
        made = cls(kernel_fn, kwargs, [t for t in templates if t is not None])
        made.first = (grid, args)
        made.out_dtype = args[1 if kernel_fn is wgrad_kernels.wgrad_split_k_sum_kernel else 2].dtype
        made.compute(grid, args)
        cls.made.append(made)
        return made

    def __call__(self, grid, *args):
        rebased = [launch._with_base(template, args[i]) for i, template in enumerate(self.templates)]
        self.calls.append((grid, args, rebased))
        self.compute(grid, rebased + list(args[len(rebased):]))

    def compute(self, grid, args):
        if self.kernel_fn is wgrad_kernels.conv2d_wgrad_kernel:
            self.wgrad(*args, out_dtype=self.out_dtype)
        else:                         # the split-K sum: the package's kernel, in the interpreter
            partial, dw, Co, Ci_group, taps, _, _, _, split_tiles, split_k = args
            if isinstance(partial, int):
                tile = self.constexprs["BLOCK_M"] * self.constexprs["BLOCK_N"]
                partial = at_address(partial, torch.float32, split_k * split_tiles * tile)
                dw = at_address(dw, self.out_dtype, Co * taps * Ci_group)
            if common.interpreter_mode():
                wgrad_kernels.wgrad_split_k_sum_kernel[grid](partial, dw, *args[2:], **self.constexprs)
            else:            # a GPU machine: the compiled kernel on copies of the CPU tensors
                on_gpu = dw.cuda()
                wgrad_kernels.wgrad_split_k_sum_kernel[grid](partial.cuda(), on_gpu, *args[2:], **self.constexprs)
                dw.copy_(on_gpu.cpu())

    @staticmethod
    def wgrad(dy_desc, x_desc, dw, partial, shape, out_dtype):
        """What the kernel leaves: each whole tile of dW (tiles before whole_tiles) in dw, and each
        slice's partial tile in the workspace (the tiles and k-steps lesson 07's wgrad_work_unit gives
        them), from the descriptors' tensors: lesson 07's wgrad_reference on a dY whose other pixels
        are zeroed."""
        for desc in (dy_desc, x_desc):        # TMA reads the descriptor's shape from its base address
            assert list(desc.base.shape) == list(desc.shape) and desc.base.is_contiguous()
        groups = shape.Co // shape.Co_group
        x = x_desc.base[..., :groups * shape.Ci_group]
        g = common.conv_geometry(x.shape, (shape.Co, shape.taps // shape.S, shape.S, shape.Ci_group),
                                 (shape.stride_h, shape.stride_w), (shape.pad_h, shape.pad_w),
                                 (shape.dil_h, shape.dil_w), groups)
        dy_2d, (block_k, block_m), block_n = dy_desc.base[:, :shape.Co].float(), dy_desc.block_shape, x_desc.block_shape[1]
        tiles = shape.num_pid_m * shape.num_pid_n
        split_tiles = tiles - shape.whole_tiles
        if isinstance(dw, int):
            dw = at_address(dw, out_dtype, shape.Co * shape.taps * shape.Ci_group)
            if split_tiles:
                partial = at_address(partial, torch.float32, shape.split_k * split_tiles * block_m * block_n)
        dw = dw.view(shape.Co, shape.taps, shape.Ci_group)

        def tile_of(result, tile):       # a tile of a dW-shaped result, zero-padded to block_m x block_n
            co0, tap, c0 = wgrad_kernels.wgrad_tile_origin.fn(tile, shape.num_pid_m, shape.ci_blocks, block_m, block_n)
            padded = torch.zeros(block_m, block_n)
            part = result[co0:co0 + block_m, tap, c0:c0 + block_n]
            padded[:part.shape[0], :part.shape[1]] = part
            return padded, (co0, tap, c0, part.shape)

        whole = lesson07.wgrad_reference(x, dy_2d.view(g.output_shape_nhwc), g).view(g.Co, shape.taps, -1)
        for tile in range(shape.whole_tiles):
            _, (co0, tap, c0, (rows, cols)) = tile_of(whole, tile)
            dw[co0:co0 + rows, tap, c0:c0 + cols] = whole[co0:co0 + rows, tap, c0:c0 + cols].to(dw.dtype)
        if split_tiles:
            partial = partial.view(shape.split_k, split_tiles, block_m, block_n)
        for split in range(shape.split_k if split_tiles else 0):
            k_begin, k_end = split * shape.k_blocks // shape.split_k, (split + 1) * shape.k_blocks // shape.split_k
            in_slice = torch.zeros_like(dy_2d)
            in_slice[k_begin * block_k:k_end * block_k] = dy_2d[k_begin * block_k:k_end * block_k]
            sliced = lesson07.wgrad_reference(x, in_slice.view(g.output_shape_nhwc), g).view(g.Co, shape.taps, -1)
            for index in range(split_tiles):
                partial[split, index] = tile_of(sliced, shape.whole_tiles + index)[0]


def fold_on_gpu_copies(grid, args, kwargs, allocated=()):
    """runtime._FOLD_COLUMNS's place for CPU tensors where Triton compiles for a GPU: the kernel on GPU copies."""
    on_gpu = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    runtime.fold_columns_kernel[grid](*on_gpu, **kwargs)
    for given, copy in zip(args, on_gpu):
        if isinstance(given, torch.Tensor):
            given.copy_(copy.cpu())


@pytest.fixture
def stand_ins(monkeypatch):
    """The plan on a CPU: StandInLaunch for DirectLaunch, an H100's facts for the device's, the package's
    check_backward_call with every check but the last (the device) kept, empty plan caches."""
    StandInLaunch.made = []
    monkeypatch.setattr(wgrad, "DirectLaunch", StandInLaunch)
    monkeypatch.setattr(wgrad, "device_facts", lambda: ("sm_90", 132, 232448))
    monkeypatch.setattr(wgrad, "_PLANS", {})
    monkeypatch.setattr(wgrad, "_FAST_PLANS", {})
    if not common.interpreter_mode():      # a GPU machine: the column fold's kernel, compiled, on copies
        monkeypatch.setattr(runtime, "_FOLD_COLUMNS", fold_on_gpu_copies)
    checked = gradients.check_backward_call

    def checked_but_on_a_cpu(tensors, x_shape, w_shape, stride, padding, dilation, groups):
        try:
            return checked(tensors, x_shape, w_shape, stride, padding, dilation, groups)
        except ValueError as error:
            if "CUDA GPU" not in str(error):
                raise
            return common.conv_geometry(tuple(x_shape), tuple(w_shape), stride, padding, dilation, groups)
    monkeypatch.setattr(gradients, "check_backward_call", checked_but_on_a_cpu)
    return StandInLaunch


def small_integer_inputs(N, H, W, Ci, Co, R, S, stride, padding, dilation, dtype=torch.float16, seed=0, groups=1):
    """x, w, dY of small integers: every product and sum below is exact in fp32 and in fp16 (|dW| < 2048)."""
    x, w, dy, g = lesson07.backward_inputs(N, H, W, Ci, Co, R, S, stride, padding, dilation, torch.float32, seed,
                                           device_name="cpu", groups=groups)
    x, dy = ((t * 2).round().clamp(-2, 2).to(dtype) for t in (x, dy))
    return x, w, dy, g


def expected_dw(x, w, dy, g):
    return lesson07.reference_gradients(x.float(), w.float(), dy.float(), g)[1]


# (N, H, W, Ci, Co, R, S, stride, padding, dilation): Ci=3 (its columns folded: 9 channels of 16), Co=20
# (dY padded), stride 2, 1x1, non-square, per-axis dilation, a stem (its stride folded into the channels),
# columns folded with a column stride and dilation, and into 120 channels (no padding: dW a view); the
# sixth has 64 k-steps of 128 pixels: 11 slices
SHAPES = [(1, 9, 8, 3, 20, 3, 3, 1, 1, 1), (2, 9, 11, 8, 16, 3, 3, 2, 1, 1), (2, 6, 7, 16, 24, 1, 1, 2, 0, 1),
          (1, 10, 9, 8, 8, 3, 2, (1, 2), (2, 1), (2, 1)), (1, 13, 12, 3, 8, 7, 7, 2, 3, 1),
          (2, 64, 64, 8, 16, 3, 3, 1, 1, 1), (1, 9, 12, 3, 20, 3, 3, (1, 2), (1, 2), (1, 2)),
          (1, 6, 7, 40, 256, 3, 3, 1, 1, 1)]
COLUMNS_FOLDED = [(3, 3, 3), (40, 3, 3)]        # (Ci, R, S) of the SHAPES whose columns the plan folds


def launches_made():
    """The launches the plans made so far: the kernel, and the sum where some tile is split."""
    return sum(1 + (plan.sum is not None) for plan in wgrad._PLANS.values())


@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dilation", SHAPES)
def test_two_calls_of_one_shape_give_their_own_dw(stand_ins, N, H, W, Ci, Co, R, S, stride, padding, dilation):
    for seed in (0, 1):          # the first call (Triton's launch), then the direct one, on other tensors
        x, w, dy, g = small_integer_inputs(N, H, W, Ci, Co, R, S, stride, padding, dilation, seed=seed)
        dw = wgrad.conv2d_weight_grad(x, dy, w.shape, stride, padding, dilation)
        assert dw.shape == w.shape and dw.dtype == x.dtype and dw.is_contiguous()
        assert torch.equal(dw.float(), expected_dw(x, w, dy, g))       # integers: exact
    # one plan: its first launches, then one direct call each
    assert [len(made.calls) for made in stand_ins.made] == [1] * launches_made()


def test_whole_and_split_tiles_through_the_plan(stand_ins, monkeypatch):
    # on 4 SMs, 9 tiles: 8 run whole (two waves), the last in 4 slices of 25 k-steps
    monkeypatch.setattr(wgrad, "device_facts", lambda: ("sm_90", 4, 232448))
    for seed in (0, 1):
        x, w, dy, g = small_integer_inputs(2, 40, 40, 8, 16, 3, 3, 1, 1, 1, seed=seed)
        dw = wgrad.conv2d_weight_grad(x, dy, w.shape, 1, 1)
        assert torch.equal(dw.float(), expected_dw(x, w, dy, g))
    plan, = wgrad._PLANS.values()
    assert (plan.template.shape.whole_tiles, plan.template.shape.split_tiles, plan.template.shape.split_k) == (8, 1, 4)
    assert [len(made.calls) for made in stand_ins.made] == [1, 1]


def test_a_grouped_conv_runs_through_the_plan(stand_ins):
    # two groups of 8 -> 64 channels: each tile's boxes start at its group's first channel of x
    for seed in (0, 1):
        x, w, dy, g = small_integer_inputs(2, 9, 8, 16, 128, 3, 3, 2, 1, 1, seed=seed, groups=2)
        dw = wgrad.conv2d_weight_grad(x, dy, w.shape, 2, 1, 1, groups=2)
        assert dw.shape == w.shape == (128, 3, 3, 8)
        assert torch.equal(dw.float(), expected_dw(x, w, dy, g))
    plan, = wgrad._PLANS.values()
    assert plan.template.shape.Co_group == 64 and plan.template.shape.Ci_group == 8


def test_the_plan_is_built_once_per_shape(stand_ins):
    x, w, dy, _ = small_integer_inputs(2, 9, 11, 8, 16, 3, 3, 2, 1, 1)
    for stride in (2, 2, (2, 2), [2, 2]):     # a list: no fast key, the same plan by its geometry
        wgrad.conv2d_weight_grad(x.clone(), dy.clone(), w.shape, stride, 1)
    assert len(wgrad._PLANS) == 1 and len(stand_ins.made) == launches_made() and len(stand_ins.made[0].calls) == 3
    x2, w2, dy2, _ = small_integer_inputs(2, 9, 11, 8, 24, 3, 3, 2, 1, 1)
    wgrad.conv2d_weight_grad(x2, dy2, w2.shape, 2, 1)
    assert len(wgrad._PLANS) == 2 and len(stand_ins.made) == launches_made()


def columns_folded(x, g):
    """By torch, independently of runtime.FoldedConv: x_fold [N, H, out_w, S*Ci padded to 8] with
    x_fold[n, h, ox, s*Ci + c] = x[n, h, ox*stride_w + s*dil_w - pad_w, c] (zeros outside x and past S*Ci),
    and the conv that reads it, R x 1 over S*Ci channels, stride (stride_h, 1)."""
    N, H, W, Ci = x.shape
    channels = -(-g.S * Ci // 8) * 8
    folded = x.new_zeros(N, H, g.out_w, channels)
    for s in range(g.S):
        columns = torch.arange(g.out_w) * g.stride[1] + s * g.dilation[1] - g.padding[1]
        inside = (columns >= 0) & (columns < W)
        folded[:, :, inside, s * Ci:(s + 1) * Ci] = x[:, :, columns[inside]]
    return folded, common.conv_geometry((N, H, g.out_w, channels), (g.Co, g.R, 1, channels), (g.stride[0], 1),
                                        (g.padding[0], 0), (g.dilation[0], 1))


@pytest.mark.parametrize("Ci, Co, S", [(8, 16, 3), (3, 20, 1), (3, 20, 3)])
def test_a_later_call_rebases_the_descriptors_on_its_tensors(stand_ins, Ci, Co, S):
    wgrad.conv2d_weight_grad(*small_integer_inputs(2, 7, 6, Ci, Co, 3, S, 1, 1, 1)[::2], (Co, 3, S, Ci), 1, 1)
    x, w, dy, g = small_integer_inputs(2, 7, 6, Ci, Co, 3, S, 1, 1, 1, seed=5)
    wgrad.conv2d_weight_grad(x, dy, w.shape, 1, 1)
    plan, = wgrad._PLANS.values()
    assert (plan.column_fold is not None) == ((Ci, S) == (3, 3))    # 9 taps of a 16-channel box -> 3 of 16
    x_run, g_run = columns_folded(x, g) if plan.column_fold is not None else (x, g)
    kernel = next(made for made in stand_ins.made if made.kernel_fn is wgrad_kernels.conv2d_wgrad_kernel)
    (_, _, (dy_desc, x_desc)), = kernel.calls
    fresh = wgrad_kernels.prepare_wgrad(x_run, dy, g_run, None, "sm_90", 132)   # what Triton validates for these tensors
    for rebased, built in ((dy_desc, fresh.dy_desc), (x_desc, fresh.x_desc)):
        assert {k: v for k, v in vars(rebased).items() if k != "base"} == {k: v for k, v in vars(built).items()
                                                                          if k != "base"}
        assert torch.equal(rebased.base, built.base)
    if Ci == 8:      # 16-byte rows already: the descriptors point at the call's own tensors, no copy
        assert x_desc.base.data_ptr() == x.data_ptr() and dy_desc.base.data_ptr() == dy.data_ptr()
    elif S == 1:     # Ci=3 and Co=20 in fp16: padded copies, zeros past the real channels
        assert x_desc.base.shape[-1] == 8 and dy_desc.base.shape[-1] == 24
        assert torch.equal(x_desc.base[..., :Ci], x) and not x_desc.base[..., Ci:].any()
    else:            # folded: 9 channels of 16, zeros past them
        assert x_desc.base.shape[-1] == 16 and torch.equal(x_desc.base, x_run)


def test_kernel_arguments_follow_the_kernels_signatures(stand_ins):
    x, w, dy, g = small_integer_inputs(2, 64, 64, 8, 16, 3, 3, 1, 1, 1)      # 11 slices
    wgrad.conv2d_weight_grad(x, dy, w.shape, 1, 1)
    x, w, dy, g = small_integer_inputs(2, 64, 64, 8, 16, 3, 3, 1, 1, 1, seed=3)
    dw = wgrad.conv2d_weight_grad(x, dy, w.shape, 1, 1)
    kernel_launch, sum_launch = stand_ins.made
    ((_, args, _),), ((_, sum_args, _),) = kernel_launch.calls, sum_launch.calls
    by_name = dict(zip(run_parameters(wgrad_kernels.conv2d_wgrad_kernel), args, strict=True))
    assert list(by_name) == ["dy_desc", "x_desc", "dw_ptr", "partial_ptr", "shape"]
    assert by_name["dy_desc"].data_ptr() == dy.data_ptr() and by_name["x_desc"].data_ptr() == x.data_ptr()
    assert by_name["shape"] == wgrad_kernels.prepare_wgrad(x, dy, g, None, "sm_90", 132).shape
    kernel_constexprs = [p.name for p in wgrad_kernels.conv2d_wgrad_kernel.params if p.is_constexpr]
    assert set(kernel_constexprs) <= set(kernel_launch.constexprs)
    sum_names = ["partial_ptr", "dw_ptr", "Co", "Ci_group", "taps", "num_pid_m", "ci_blocks", "whole_tiles",
                 "split_tiles", "split_k"]
    sum_by_name = dict(zip(sum_names, sum_args, strict=True))
    assert list(inspect.signature(wgrad_kernels.wgrad_split_k_sum_kernel.fn).parameters)[:10] == sum_names
    assert sum_by_name["partial_ptr"] == by_name["partial_ptr"] and by_name["dw_ptr"] == sum_by_name["dw_ptr"] == dw.data_ptr()
    shape = by_name["shape"]
    assert {name: sum_by_name[name] for name in sum_names[2:]} == {name: getattr(shape, name) for name in sum_names[2:]}
    assert (shape.whole_tiles, shape.split_k) == (0, 11)


@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dilation", SHAPES)
def test_split_and_grid_are_prepare_wgrads(stand_ins, N, H, W, Ci, Co, R, S, stride, padding, dilation):
    x, w, dy, g = small_integer_inputs(N, H, W, Ci, Co, R, S, stride, padding, dilation)
    for _ in range(2):
        wgrad.conv2d_weight_grad(x, dy, w.shape, stride, padding, dilation)
    problem = wgrad_kernels.wgrad_problem(g, x.element_size())      # the stem's: lesson 07's launcher folds it too
    assert (problem.geometry != g) == (Ci == 3 and R == 7)
    plan, = wgrad._PLANS.values()
    assert (plan.column_fold is not None) == ((Ci, R, S) in COLUMNS_FOLDED)
    if plan.column_fold is not None:
        x, g = columns_folded(x, g)
    else:
        x, g = wgrad_kernels.wgrad_input(x, problem), problem.geometry
    lesson = wgrad_kernels.prepare_wgrad(x, dy, g, None, "sm_90", 132)
    assert (plan.template.grid, plan.template.shape, plan.template.config) == (lesson.grid, lesson.shape, lesson.config)
    kernel_launch, *sum_launch = stand_ins.made
    assert kernel_launch.first[0] == kernel_launch.calls[0][0] == lesson.grid
    assert len(sum_launch) == (lesson.partial is not None) == (lesson.shape.split_k > 1)
    if sum_launch:
        sum_grid = wgrad_kernels.sum_partials_launch(lesson, w.new_empty(g.Co, g.R * g.S * g.Ci))[0]
        assert sum_launch[0].first[0] == sum_launch[0].calls[0][0] == sum_grid
    assert (lesson.shape.split_k > 1) == ((N, H) == (2, 64))      # the case with slices is one


@pytest.mark.parametrize("Ci, Co, finish", [(3, 24, True), (40, 256, False)])
def test_a_column_folded_call_records_a_replay(stand_ins, monkeypatch, Ci, Co, finish):
    """A call whose columns the plan folds records the fold's launch (with its folded x a workspace), the kernel's
    launch and, where the folded channels are padded (9 of 16), dW copied out by a finish step; the recording
    gives a replay (a copy it did not record, or an address outside the call's tensors, would leave none)."""
    class RecordedLaunch:       # the fold's DirectLaunch, as a recording holds it
        lean = True
    run_fold = fold_on_gpu_copies if not common.interpreter_mode() else (
        lambda grid, args, kwargs, allocated=(): runtime.fold_columns_kernel[grid](*args, **kwargs))

    def fold_recorded(grid, args, kwargs, allocated=()):       # what launch.SmallLaunches records after its first launch
        run_fold(grid, args, kwargs)
        for t in allocated:
            launch.record_scratch(t)
        places = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        launch.record_step(("launch", RecordedLaunch(), grid,
                            tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args), places),
                           tuple(args[i] for i in places))
    monkeypatch.setattr(runtime, "_FOLD_COLUMNS", fold_recorded)
    monkeypatch.setattr(StandInLaunch, "lean", True, raising=False)
    x, w, dy, g = small_integer_inputs(1, 6, 7, Ci, Co, 3, 3, 1, 1, 1)
    wgrad.conv2d_weight_grad(x, dy, w.shape, 1, 1)         # the plan and its first launches
    x, w, dy, g = small_integer_inputs(1, 6, 7, Ci, Co, 3, 3, 1, 1, 1, seed=3)
    with launch.recording() as recording:
        dw = wgrad.conv2d_weight_grad(x, dy, w.shape, 1, 1)
    plan, = wgrad._PLANS.values()
    assert plan.column_fold is not None and plan.dw_is_kernels is not finish
    assert torch.equal(dw.float(), expected_dw(x, w, dy, g)) and dw.is_contiguous()
    kinds = [step[0] for step in recording.steps]
    assert kinds[:2] == ["scratch", "launch"] and recording.steps[1][1].__class__ is RecordedLaunch
    assert kinds.count("finish") == finish and "derive" not in kinds and not recording.broken
    grad_weight = dw.permute(0, 3, 1, 2)             # as backward.py returns it: channels_last, NCHW-shaped
    assert launch.Replay.of(recording, {"grad_output": dy, "input": x}, {"grad_weight": (grad_weight, False)}) is not None


@pytest.mark.parametrize("changes, error, message", lesson07.BAD_CALLS)
def test_bad_calls_get_lesson_07s_errors(changes, error, message):
    x, w, dy, _ = lesson07.backward_inputs(1, 8, 8, 8, 16, 3, 3, 1, 1, 1, torch.bfloat16, device_name="cpu")
    valid = dict(x_nhwc=x, dy_nhwc=dy, w_shape=w.shape, padding=1)
    with pytest.raises(error, match=re.escape(message)):
        wgrad.conv2d_weight_grad(**{**valid, **changes(x, w, dy)})


def test_a_planned_shape_still_refuses_what_is_not_contiguous(stand_ins):
    x, w, dy, _ = small_integer_inputs(1, 8, 8, 8, 16, 3, 3, 1, 1, 1)
    wgrad.conv2d_weight_grad(x, dy, w.shape, 1, 1)                    # planned and in the fast key
    transposed = dy.transpose(1, 2).contiguous().transpose(1, 2)      # the same shape, other strides
    with pytest.raises(ValueError, match="dy_nhwc must be contiguous"):
        wgrad.conv2d_weight_grad(x, transposed, w.shape, 1, 1)
    with pytest.raises(TypeError, match="groups must be an int"):
        wgrad.conv2d_weight_grad(x, dy, w.shape, 1, 1, groups=True)


def test_the_operators_backward_runs_the_plan(stand_ins, monkeypatch):
    """conv_tutorial.set_backward("lesson06") on a CPU with the stand-ins: dW through the plan (dgrad's
    phases with torch's conv for each phase's kernel), an NCHW-shaped channels_last gradient."""
    monkeypatch.setattr(backward, "lesson06_reason", lambda *args: None)
    monkeypatch.setattr(backward, "_fprop", lambda dy, w_phase, padding, dilation, groups=1: torch.nn.functional.conv2d(
        dy.permute(0, 3, 1, 2), w_phase.permute(0, 3, 1, 2), None, 1, padding, dilation, groups).permute(0, 2, 3, 1))
    before = backward.backward_backend()
    conv_tutorial.set_backward("lesson06")
    try:
        x_nhwc, w_nhwc, _, _ = small_integer_inputs(2, 9, 11, 8, 16, 3, 3, 2, 1, 1)
        x = x_nhwc.permute(0, 3, 1, 2)
        w = w_nhwc.to(torch.float16).permute(0, 3, 1, 2).requires_grad_()
        for _ in range(2):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")      # the forward falls back to torch on a CPU
                out = torch.ops.conv_tutorial.conv2d(x, w, None, [2, 2], [1, 1], [1, 1], 1)
            dw, = torch.autograd.grad(out.float().square().sum(), (w,))
            x64, w64 = x.double(), w.detach().double().requires_grad_()
            want, = torch.autograd.grad(torch.nn.functional.conv2d(x64, w64, None, 2, 1).square().sum(), (w64,))
            assert dw.is_contiguous(memory_format=torch.channels_last) and dw.shape == w.shape
            # dY = 2 * out, rounded to fp16 (11 bits) before the sum: that rounding, not the plan, sets the tolerance
            torch.testing.assert_close(dw.double(), want, rtol=2e-3, atol=2e-3 * want.abs().max().item())
    finally:
        conv_tutorial.set_backward(before)
    assert len(wgrad._PLANS) == 1 and [len(made.calls) for made in stand_ins.made] == [1] * launches_made()


# --- GPU: the plan against torch and against lesson 07's plain launcher --------------------------------------

GPU_SHAPES = [    # N, H, W, Ci, Co, R, S, stride, padding, dilation
    (2, 20, 18, 3, 64, 7, 7, 2, 3, 1),            # the stem: Ci = 3
    (2, 15, 17, 32, 48, 3, 3, 2, 1, 1),           # stride 2, Co = 48 (not a multiple of the tile)
    (4, 14, 14, 64, 256, 1, 1, 1, 0, 1),          # 1x1
    (2, 13, 11, 24, 200, 3, 5, (2, 1), (1, 2), (1, 2)),  # non-square, per-axis stride and dilation, Co = 200
    (2, 16, 16, 40, 36, 3, 3, 1, 2, 2),           # dilation 2, Co = 36 (dY's rows padded)
    (8, 28, 28, 128, 128, 3, 3, 1, 1, 1),         # 6272 pixels: several slices
    (128, 7, 7, 512, 512, 3, 3, 1, 1, 1),         # 144 tiles: on 132 SMs 132 whole, 12 in 7 slices
    (2, 12, 13, 3, 24, 3, 3, 1, 1, 1),            # columns folded: 9 channels of 16, dW copied out
    (1, 9, 12, 3, 20, 3, 3, (1, 2), (1, 2), (1, 2)),    # columns folded, with a column stride and dilation
    (2, 10, 9, 144, 288, 3, 3, 1, 1, 1),          # columns folded: 432 channels, dW a view of the kernel's
]
GPU_COLUMNS_FOLDED = [(2, 12, 13, 3), (1, 9, 12, 3), (2, 10, 9, 144)]    # (N, H, W, Ci) of the three above


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dilation", GPU_SHAPES)
def test_plan_matches_torch_and_the_plain_launcher(N, H, W, Ci, Co, R, S, stride, padding, dilation, dtype):
    for seed in (0, 1, 2):         # the first call, then two direct ones on new tensors
        x, w, dy, g = lesson07.backward_inputs(N, H, W, Ci, Co, R, S, stride, padding, dilation, dtype, seed)
        dw = wgrad.conv2d_weight_grad(x, dy, w.shape, stride, padding, dilation)
        # common.assert_close_to_reference's tolerance: each dW element a sum of K = g.M products
        common.assert_close_to_reference(dw, lesson07.reference_gradients(x, w, dy, g)[1], dtype=dtype, K=g.M)
        assert dw.is_contiguous()
        # the same kernel, split and sum as the plain launcher (on x with its columns folded, where the plan
        # folds them): the same bits
        folded = (N, H, W, Ci) in GPU_COLUMNS_FOLDED
        assert (wgrad.plan_for(g, dtype, x.device).column_fold is not None) == folded
        if not folded:
            assert torch.equal(dw, lesson07.conv2d_wgrad_launch(x, dy, w.shape, stride, padding, dilation))
        else:
            x_fold, g_fold = columns_folded(x.cpu(), g)
            dw_fold = lesson07.conv2d_wgrad_launch(x_fold.to(x.device), dy, (Co, R, 1, g_fold.Ci), g_fold.stride,
                                                   g_fold.padding, g_fold.dilation)
            assert torch.equal(dw, dw_fold[..., :S * Ci].reshape(Co, R, S, Ci))


@needs_gpu
def test_plan_on_a_second_stream_and_in_a_cuda_graph():
    x, w, dy, g = lesson07.backward_inputs(4, 14, 14, 64, 64, 3, 3, 1, 1, 1, torch.bfloat16)
    expected = wgrad.conv2d_weight_grad(x, dy, w.shape, 1, 1)         # the first call compiles
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        on_stream = wgrad.conv2d_weight_grad(x, dy, w.shape, 1, 1)
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(on_stream, expected)
    graph, static_x, static_dy = torch.cuda.CUDAGraph(), x.clone(), dy.clone()
    with torch.cuda.graph(graph):
        static_dw = wgrad.conv2d_weight_grad(static_x, static_dy, w.shape, 1, 1)
    x2, _, dy2, _ = lesson07.backward_inputs(4, 14, 14, 64, 64, 3, 3, 1, 1, 1, torch.bfloat16, seed=7)
    static_x.copy_(x2)
    static_dy.copy_(dy2)
    graph.replay()
    assert torch.equal(static_dw, wgrad.conv2d_weight_grad(x2, dy2, w.shape, 1, 1))


def test_stand_in_notices_a_wrong_tensor(stand_ins, monkeypatch):
    """The tests above can fail: a plan that kept the first call's dY (as a stale template would)
    gives the first call's dW for the second call's tensors, and the comparison catches it."""
    x, w, dy, g = small_integer_inputs(2, 9, 11, 8, 16, 3, 3, 2, 1, 1)
    wgrad.conv2d_weight_grad(x, dy, w.shape, 2, 1)
    plan, = wgrad._PLANS.values()
    real_kernel = plan.kernel
    plan.kernel = lambda grid, dy_2d, *rest: real_kernel(grid, dy.reshape(dy_2d.shape), *rest)   # the stale dY
    x2, _, dy2, _ = small_integer_inputs(2, 9, 11, 8, 16, 3, 3, 2, 1, 1, seed=4)
    assert not torch.equal(wgrad.conv2d_weight_grad(x2, dy2, w.shape, 2, 1).float(), expected_dw(x2, w, dy2, g))


# --- The package's host rules for the wgrad kernel (configs, split, x's load, groups), moved here from the ----------
# --- lesson that teaches the kernel (lesson 07 points to them) -------------------------------------------------------

def test_negative_programs_or_slices_are_refused():
    x, _, dy, g = lesson07.backward_inputs(1, 6, 6, 8, 16, 3, 3, 1, 1, 1, torch.float32, device_name="cpu")
    for bad in (dict(programs=-1), dict(split_k=-2)):
        with pytest.raises(ValueError, match="programs and split_k must be >= 0"):
            wgrad_kernels.prepare_wgrad(x, dy, g, wgrad_kernels.WgradConfig(16, 8, 8, **bad), "sm_90", 132)


@pytest.mark.parametrize("N, H, Ci, Co, R, stride, block_m", [
    (128, 7, 512, 2048, 1, 1, 64),     # 64 tiles of 128 rows, split in 2; 128 of 64 rows: 97% of a wave, whole
    (128, 7, 2048, 512, 1, 1, 64),
    (128, 8, 2048, 448, 1, 1, 64),     # 64 -> 112 tiles (85%)
    (128, 8, 2048, 384, 1, 1, 64),     # 48 -> 96 tiles (73%): x read tiled, the 96 whole in one wave
    (128, 17, 256, 320, 3, 2, 128),    # 54 -> 90 tiles (68%), x through im2col: 128-row tiles
    (128, 17, 192, 320, 3, 2, 64),     # the same at 192 channels: least_padded_config's 64 x 64 (135 tiles) first
    (128, 14, 1024, 256, 1, 1, 64),    # 16 tiles in 8 slices -> 32 in 4: 128 units, one wave
    (128, 56, 256, 256, 1, 1, 64),     # 4 tiles in 33 slices -> 8 in 16
    (128, 7, 1024, 2048, 1, 1, 128),   # 128 tiles whole; 64-row tiles would need two waves
    (128, 14, 1024, 2048, 1, 2, 128),  # 128 tiles already: a wave whole
    (128, 56, 64, 64, 3, 1, 64),       # 64 output channels: 64 rows anyway
    (128, 56, 64, 256, 1, 1, 128),     # 128 x 64 tiles (64 channels): already 128-pixel k-steps
])
def test_64_row_tiles_where_they_fill_a_wave(N, H, Ci, Co, R, stride, block_m):
    g = common.conv_geometry((N, H, H, Ci), (Co, R, R, Ci), stride, R // 2)
    config = wgrad_kernels.default_wgrad_config(g, Ci, 132)
    assert config.block_m == block_m and config.num_buffers == 4
    wgrad_kernels.check_wgrad_config(config, "sm_90")
    wgrad_kernels.check_wgrad_config(config, "sm_100")


@pytest.mark.parametrize("Ci, Co, tile", [
    (160, 160, (64, 64)),     # columns 2 x 128 = 256 or 3 x 64 = 192 (/0.9: 213); rows alike: 213^2 < 0.9 x 256^2
    (64, 192, (64, 64)),      # rows 2 x 128 = 256 or 3 x 64 = 192 (/0.9: 213); 64 columns either way
    (192, 384, (128, 64)),    # rows whole in 128s; columns 256 or 192 (/0.9: 213), 83% of 256
    (128, 192, (64, 128)),    # columns whole; rows 256 or 213
    (32, 192, (64, 32)),      # 32 columns (a box of 32); rows 256 or 213
    (256, 320, (128, 128)),   # rows 384 or 320 (/0.9: 356), 93% of 384: not under 90%, the widest
    (96, 96, (128, 128)),     # 128 columns or 3 x 32 (/0.5: 192); rows 128 or 2 x 64 (/0.9: 142)
    (2048, 448, (128, 128)),  # rows 512 or 448 (/0.9: 498)
    (3, 32, (64, 16)),        # wgrad_config's own: 32 rows in one 64-row tile, a 16-channel box
])
def test_narrower_tiles_where_the_channels_pad_the_widest(Ci, Co, tile):
    """least_padded_config by hand: Co and Ci rounded up to whole tiles, over the tile's rate (rows 1.0 or
    0.9 for 128 or 64, columns 1.0, 0.9, 0.5 for 128, 64, 32), taken where under 90% of wgrad_config's;
    128-pixel k-steps for 128 x 64 elements or fewer. Every tile it gives passes check_wgrad_config's model on
    both architectures (the 64 x 64 tile's builds: tests/kernels/test_host_model.py)."""
    Ci_padded = -(-Ci // 8) * 8
    config = wgrad_kernels.least_padded_config(Co, Ci_padded)
    assert (config.block_m, config.block_n) == tile
    assert config.block_k == (128 if tile[0] * tile[1] <= 128 * 64 else 64) and config.num_buffers == 4
    wgrad_kernels.check_wgrad_config(config, "sm_90")
    wgrad_kernels.check_wgrad_config(config, "sm_100")
    g = common.conv_geometry((128, 17, 17, Ci), (Co, 3, 3, Ci), 1, 1)
    if tile != tuple(wgrad_kernels.wgrad_config(Co, Ci_padded)[:2]):     # the plan's tile: the narrower one
        assert wgrad_kernels.default_wgrad_config(g, Ci_padded, 132) == config


def test_narrower_tiles_keep_a_grouped_convs_rows_in_one_group():
    """960 output channels a group: 128-row tiles would cross a group's edge (960 = 7 x 128 + 64), so only
    64-row ones are weighed, though 128 rows would pad less here (1024/1.0 against 960/0.9 = 1067: the
    rule alone would take them). 160 channels a group: 3 x 64 columns (192/0.9 = 213) against 2 x 128 (256)."""
    config = wgrad_kernels.least_padded_config(1920, 320, groups=2)
    assert (config.block_m, config.block_n, config.block_k) == (64, 64, 128)
    whole = wgrad_kernels.least_padded_config(2048, 320, groups=2)       # 1024 a group: 128-row tiles fit
    assert (whole.block_m, whole.block_n) == (128, 64)


@pytest.mark.parametrize("R, stride, padding, tiled", [(1, 1, 0, True), (1, 2, 0, False), (1, 1, 1, False),
                                                      (3, 1, 1, False), ((1, 3), 1, 0, False)])
def test_x_read_tiled_only_where_pixel_p_reads_pixel_p(R, stride, padding, tiled):
    R, S = (R, R) if isinstance(R, int) else R
    x, _, dy, g = lesson07.backward_inputs(2, 6, 5, 16, 8, R, S, stride, padding, 1, torch.float32, device_name="cpu")
    assert wgrad_kernels.x_reads_tiled(g) == tiled
    launch = wgrad_kernels.prepare_wgrad(x, dy, g, wgrad_kernels.WgradConfig(16, 16, 8, num_buffers=2), "sm_90", 132)
    assert (type(launch.x_desc).__name__ == "TensorDescriptor") == tiled


def test_split_choices():
    choose_split, wgrad_split = wgrad_kernels.choose_split, wgrad_kernels.wgrad_split
    assert choose_split(9, 3136, 132, block_k=128) == 14   # 126 units: one wave, 95% of the SMs
    assert wgrad_split(9, 14, 132) == (126, 0, 9)           # every tile split
    assert choose_split(4, 1, 132) == 1                     # one k-step: nothing to split
    assert choose_split(144, 98, 132) == 7                  # a wave of whole tiles, then 12 in 7 slices
    assert wgrad_split(144, 7, 132) == (132, 132, 12)
    assert choose_split(264, 1000, 132) == 1                # two full waves already
    assert wgrad_split(264, 1, 132) == (132, 264, 0)
    assert choose_split(216, 512, 132) == 3                 # 84 tiles past the wave: 3 slices each, two short waves
    assert choose_split(200, 4, 132) == 1                   # 4 k-steps: nothing to gain


@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, folds", [
    (128, 14, 14, 144, 288, 3, 3, 1, 1, True),     # GoogLeNet: 9 x 256 columns -> 3 x 512
    (128, 7, 7, 160, 320, 3, 3, 1, 1, True),       # GoogLeNet: 9 x 256 -> 3 x 512
    (128, 73, 73, 80, 192, 3, 3, 1, 0, True),      # Inception v3: 9 x 128 -> 3 x 256, for a copy of 4x x's size
    (128, 224, 224, 3, 64, 3, 3, 1, 1, True),      # VGG's first conv: 9 x 16 -> 3 x 16
    (128, 56, 56, 64, 64, 3, 3, 1, 1, False),      # 9 x 64 -> 3 x 256: more columns
    (128, 28, 28, 128, 128, 3, 3, 1, 1, False),    # 9 x 128 -> 3 x 384: as many
    (128, 8, 8, 448, 384, 3, 3, 1, 1, False),      # 9 x 512 -> 3 x 1408: 8% fewer, less than the copy costs
    (128, 17, 17, 160, 160, 1, 7, 1, (0, 3), False),   # 7 x 256 -> 1152: 36% fewer, for a copy of 7x x's size
    (128, 14, 14, 256, 256, 1, 1, 1, 0, False),    # 1x1: no columns to fold
])
def test_columns_fold_where_the_mma_columns_saved_outweigh_the_copy(N, H, W, Ci, Co, R, S, stride, padding, folds):
    g = common.conv_geometry((N, H, W, Ci), (Co, R, S, Ci), stride, padding, 1)
    assert (wgrad.column_fold(g) is not None) == folds
    if Ci % 2 == 0:      # grouped convs keep their taps
        grouped = common.conv_geometry((N, H, W, Ci), (Co, R, S, Ci // 2), stride, padding, 1, groups=2)
        assert wgrad.column_fold(grouped) is None
