"""Repeat calls of the operators (conv_tutorial/hostpath.py, launch.py's Replay): the first calls of a key
take the full path and are recorded; later calls replay the recorded launches on new tensors. On a CPU:
the recording's address arithmetic with stand-in launches. On a GPU: every path (forward, its epilogue,
the folded stem, split-K, the channel statistics, dgrad in one conv, in phases with zeros and side by side,
the ReLU gate, wgrad with and without split-K) called again and again on new tensors, each result against
torch's, and the replay declining where it must (an unaligned input, a profiler listening)."""
import common

import pytest
import torch

import conv_tutorial
import conv_tutorial.ops  # noqa: F401  (registers the operators)
import conv_tutorial.training  # noqa: F401  (registers conv2d_channel_stats)
from conv_tutorial import backward, hostpath, launch, native

needs_gpu = pytest.mark.skipif(not common.has_tma_mma_gpu(), reason=common.GLUON_SKIP_REASON)


class StandIn:
    """A launch that writes what it was given into a log: which addresses, in which order."""
    lean = True

    def __init__(self, log):
        self.log = log

    def __call__(self, grid, *args):
        self.log.append((grid, args))

    def launch_lean(self, grid, args):
        self.log.append((grid, tuple(args)))


def test_a_replay_moves_every_address_with_its_tensor():
    log = []
    direct = StandIn(log)
    x, out = torch.empty(64, dtype=torch.uint8), torch.empty(32, dtype=torch.uint8)
    scratch = torch.empty(16, dtype=torch.float32)
    with launch.recording() as steps:
        launch.record_scratch(scratch)
        launch.record_step(("launch", direct, (3,), (x.data_ptr() + 16, scratch.data_ptr(), 7, out.data_ptr()),
                            (0, 1, 3)))
    replay = launch.Replay.of(steps, {"x": x}, {"out": (out, False)})
    assert replay is not None
    x2 = torch.empty(64, dtype=torch.uint8)
    (out2,) = replay("cpu", {"x": x2})
    (grid, (at_x, at_scratch, seven, at_out)), = log
    assert (grid, at_x, seven, at_out) == ((3,), x2.data_ptr() + 16, 7, out2.data_ptr())
    assert isinstance(at_scratch, int)          # a workspace of the replay's own, allocated on each call
    assert out2.shape == out.shape and out2.data_ptr() != x2.data_ptr()


def test_a_replay_remakes_a_derived_input_and_a_finished_result():
    """wgrad's stem: x folded by torch before the launch ("derive"), dW unfolded by torch from the kernel's
    workspace after it ("finish"): the replay reruns both on the new call's tensors, the launch reads the new
    derived tensor and writes a workspace of its own, and the result is the finish's output, viewed as the
    recorded call returned it."""
    log, made, finished = [], [], []

    def derive(nhwc):
        made.append((nhwc * 2).contiguous())
        return made[-1]

    def finish(workspace):
        finished.append((workspace, workspace.view(3, 8).t().contiguous()))
        return finished[-1][1]

    x = torch.randn(2, 3, 2, 2).contiguous(memory_format=torch.channels_last)
    with launch.recording() as steps:
        derived = derive(x.permute(0, 2, 3, 1))
        launch.record_step(("derive", derive, x.data_ptr(), (derived.data_ptr(), derived.nbytes)), (derived,))
        workspace = torch.empty(24)
        launch.record_scratch(workspace)
        launch.record_step(("launch", StandIn(log), (1,), (derived.data_ptr(), workspace.data_ptr()), (0, 1)))
        out = finish(workspace)
        launch.record_step(("finish", finish, workspace.data_ptr(), (out.data_ptr(), out.nbytes)), (out,))
    returned = out.t()                          # (the call returns a view of what torch computed)
    replay = launch.Replay.of(steps, {"x": x}, {"out": (returned, False)})
    assert replay is not None
    log.clear()
    x2 = torch.randn(2, 3, 2, 2).contiguous(memory_format=torch.channels_last)
    (got,) = replay("cpu", {"x": x2})
    (_, (at_derived, at_workspace)), = log
    assert torch.equal(made[-1], x2.permute(0, 2, 3, 1) * 2) and at_derived == made[-1].data_ptr()
    workspace2, out2 = finished[-1]
    assert at_workspace == workspace2.data_ptr() != workspace.data_ptr()
    assert got.data_ptr() == out2.data_ptr() and got.shape == returned.shape and got.stride() == returned.stride()


def test_a_replayed_conv_launches_its_kernel_and_split_ks_sum_in_their_argument_order():
    """A "conv" step (a ForwardReplay's launch, here with stand-ins for its two kernels) replayed: the conv
    kernel takes x, w (twice: its tail descriptor), the new output, the epilogue's pointers with the absent
    ones pointing at the output and a split-K workspace of the replay's own last, then the plan's shape;
    split-K's sum takes that workspace, the output and the same pointers, then the plan's scalars."""
    log = []
    conv = object.__new__(launch.ForwardReplay)
    conv.direct, conv.reduce, conv.grid, conv.reduce_grid = StandIn(log), StandIn(log), (7,), (5,)
    conv.shape, conv.reduce_scalars, conv.w_tail, conv.out_tail, conv.dense = (1, 2, 3), (11, 12), True, False, True
    conv.out_shape, conv.out_dtype, conv.partial = (4, 8), torch.float32, ((2, 4, 8), torch.float32)
    x, w, b = torch.empty(64, dtype=torch.uint8), torch.empty(32), torch.empty(16)
    out = torch.empty(4, 8)
    with launch.recording() as steps:
        launch._record(conv, x, w, (b.data_ptr(), None, None), None, None, out)
    replay = launch.Replay.of(steps, {"x": x, "w": w, "b": b}, {"out": (out, False)})
    assert replay is not None
    x2, w2, b2 = torch.empty_like(x), torch.empty_like(w), torch.empty_like(b)
    (out2,) = replay("cpu", {"x": x2, "w": w2, "b": b2})
    assert not replay.packed and out2.shape == (4, 8)
    (conv_grid, conv_args), (sum_grid, sum_args) = log
    o = out2.data_ptr()
    workspace = conv_args[5][3]
    assert conv_grid == (7,) and conv_args == (x2.data_ptr(), w2.data_ptr(), w2.data_ptr(), o, None,
                                               (b2.data_ptr(), o, o, workspace), (1, 2, 3), None, None)
    assert workspace not in (o, x2.data_ptr(), w2.data_ptr(), b2.data_ptr())
    assert sum_grid == (5,) and sum_args == (workspace, o, (b2.data_ptr(), o, o), 11, 12)


def test_no_replay_where_a_finish_step_reads_an_input():
    x = torch.empty(16, dtype=torch.uint8)
    out = x.clone()
    with launch.recording() as steps:
        launch.record_step(("launch", StandIn([]), (1,), (x.data_ptr(),), (0,)))
        launch.record_step(("finish", torch.clone, x.data_ptr(), (out.data_ptr(), out.nbytes)), (out,))
    assert launch.Replay.of(steps, {"x": x}, {"out": (out, False)}) is None


def test_no_replay_where_an_address_lies_outside_the_call():
    other = torch.empty(16, dtype=torch.uint8)        # a copy the call made, say: not an input, not a result
    x = torch.empty(16, dtype=torch.uint8)
    with launch.recording() as steps:
        launch.record_step(("launch", StandIn([]), (1,), (other.data_ptr(),), (0,)))
    assert launch.Replay.of(steps, {"x": x}, {}) is None


def test_no_replay_where_the_call_broke_its_recording():
    x = torch.empty(16, dtype=torch.uint8)
    with launch.recording() as steps:
        launch.record_step(("launch", StandIn([]), (1,), (x.data_ptr(),), (0,)))
        launch.record_breaks()                      # a first launch, a copy, torch's sums
    assert launch.Replay.of(steps, {"x": x}, {}) is None


def test_a_recording_inside_another_breaks_the_outer_one():
    with launch.recording() as outer:
        with launch.recording() as inner:
            pass
    assert outer.broken and not inner.broken


def test_a_replay_declines_an_unaligned_input():
    x = torch.empty(64, dtype=torch.uint8)
    with launch.recording() as steps:
        launch.record_step(("launch", StandIn([]), (1,), (x.data_ptr(),), (0,)))
    replay = launch.Replay.of(steps, {"x": x}, {})
    assert replay("cpu", {"x": x[1:]}) is None


def test_no_replay_where_inputs_share_memory():
    """A call whose residual is its input: an address in both would be taken from the first source, and every
    later call of the key would read its input in the residual's place. Such a recording makes no replay."""
    x = torch.empty(64, dtype=torch.uint8)
    with launch.recording() as steps:
        launch.record_step(("launch", StandIn([]), (1,), (x.data_ptr(), x.data_ptr()), (0, 1)))
    assert launch.Replay.of(steps, {"input": x, "residual": x}, {}) is None
    assert launch.Replay.of(steps, {"input": x, "residual": x[16:]}, {}) is None       # overlapping views too
    assert launch.Replay.of(steps, {"input": x[:32], "residual": x[32:]}, {}) is not None   # side by side: fine


def test_a_key_is_recorded_then_replayed_and_its_fallback_breaks_an_outer_recording(monkeypatch):
    log, full_path_calls = [], []
    direct = StandIn(log)
    x = torch.empty(64, dtype=torch.uint8)

    def full_path():
        full_path_calls.append(1)
        out = torch.empty(32, dtype=torch.uint8)
        launch.record_step(("launch", direct, (1,), (x.data_ptr(), out.data_ptr()), (0, 1)), (out,))
        direct((1,), x.data_ptr(), out.data_ptr())
        return out
    monkeypatch.setattr(hostpath, "_REPLAYS", {})
    key = ("a key",)
    for _ in range(3):
        hostpath.call("test::op", key, "cpu", {"x": x}, full_path, ("out",))
    assert len(full_path_calls) == 1 and len(log) == 3           # recorded once, replayed twice
    monkeypatch.setattr(launch, "_launch_hooks_set", lambda: True)  # the replay declines: the full path, and
    with launch.recording() as outer:                                # a recording around it is broken
        hostpath.call("test::op", key, "cpu", {"x": x}, full_path, ("out",))
    assert len(full_path_calls) == 2 and outer.broken


# %% On a GPU: every path, called again and again --------------------------------------------------

def _cl(t):
    return t.to(memory_format=torch.channels_last)


def _replay_of(op_name):
    # the replays kept for an operator (hostpath's table), whatever their keys' other parts
    return [r for k, r in hostpath._REPLAYS.items() if op_name in k and isinstance(r, launch.Replay)]


def _packed(op_name):
    # whether every replay of the operator that has run launches through packed launches (packed.py)
    replays = [r for r in _replay_of(op_name) if r.program is not None]
    return bool(replays) and all(r.packed for r in replays)


FORWARD_LAYERS = [   # (N, Ci, H, W, Co, R, stride, padding): plain, 1x1, strided, the stem (folded), split-K
    (4, 64, 14, 14, 64, 3, 1, 1), (2, 256, 28, 28, 64, 1, 1, 0), (2, 64, 29, 31, 128, 3, 2, 1),
    (2, 3, 64, 64, 64, 7, 2, 3), (4, 1024, 7, 7, 256, 1, 1, 0)]


@needs_gpu
@pytest.mark.parametrize("layer", FORWARD_LAYERS, ids=str)
@pytest.mark.parametrize("epilogue", ["plain", "bias-residual-relu"])
def test_forward_replays_match_torch_on_new_tensors(layer, epilogue):
    N, Ci, H, W, Co, R, stride, padding = layer
    torch.manual_seed(0)
    hostpath.clear()
    for call in range(5):
        x = _cl(torch.randn(N, Ci, H, W, device="cuda", dtype=torch.bfloat16))
        w = _cl(torch.randn(Co, Ci, R, R, device="cuda", dtype=torch.bfloat16) / (Ci * R * R) ** 0.5)
        b = torch.randn(Co, device="cuda", dtype=torch.bfloat16) if epilogue != "plain" else None
        ref = torch.nn.functional.conv2d(x.float(), w.float(), None if b is None else b.float(), stride, padding)
        residual = _cl(torch.randn_like(ref).to(torch.bfloat16)) if epilogue != "plain" else None
        out = torch.ops.conv_tutorial.conv2d(x, w, b, [stride] * 2, [padding] * 2, [1, 1], 1,
                                             residual=residual, activation="none" if epilogue == "plain" else "relu")
        if residual is not None:
            ref = torch.relu(ref + residual.float())
        assert out.is_contiguous(memory_format=torch.channels_last) and out.shape == ref.shape
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2, msg=f"call {call}")
    assert _replay_of("conv2d"), "the forward kept no replay"
    assert _packed("conv2d"), "the forward's replays launch through Python"


@needs_gpu
def test_packed_launches_encode_new_addresses_as_triton_does():
    """A packed launch encodes a tensor map for an address it has not seen by calling Triton's encoding
    function straight (packed.map_encoder): on this Triton it takes that path for every descriptor of the
    forward's launches (not the Python fallback), and gives Triton's own 128 bytes at real addresses."""
    import functools
    from conv_tutorial import packed
    hostpath.clear()
    x = _cl(torch.randn(2, 64, 14, 14, device="cuda", dtype=torch.bfloat16))
    w = _cl(torch.randn(128, 64, 3, 3, device="cuda", dtype=torch.bfloat16))
    for _ in range(3):
        torch.ops.conv_tutorial.conv2d(x, w, None, [1, 1], [1, 1], [1, 1], 1)
    directs = [r.direct for plan in launch._PLANS.values() for r in plan.replays.values()]
    assert directs
    addresses = [t.data_ptr() for t in (x, w, torch.empty(4096, device="cuda"))]
    for direct in directs:
        for position in direct.descriptor_at:
            encode = packed.map_encoder(direct, position)
            assert not isinstance(encode, functools.partial), "a new address takes the Python path"
            for address in addresses:
                assert packed.module().map_bytes(encode(address)) == \
                    packed.module().map_bytes(direct.tensor_map_at(position, address))


@needs_gpu
def test_channel_stats_replays_start_from_zero():
    torch.manual_seed(0)
    hostpath.clear()
    for call in range(4):
        x = _cl(torch.randn(4, 64, 14, 14, device="cuda", dtype=torch.bfloat16))
        w = _cl(torch.randn(128, 64, 3, 3, device="cuda", dtype=torch.bfloat16) / 24)
        out, stats = torch.ops.conv_tutorial.conv2d_channel_stats(x, w, None, [1, 1], [1, 1], [1, 1], 1)
        ref = torch.nn.functional.conv2d(x.float(), w.float(), None, 1, 1)
        torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
        want = torch.stack((out.float().sum((0, 2, 3)), out.float().square().sum((0, 2, 3))))
        torch.testing.assert_close(stats, want, atol=0.5, rtol=1e-2, msg=f"call {call}")
    assert _replay_of("conv2d_channel_stats") and _packed("conv2d_channel_stats")


DGRAD_LAYERS = [   # (N, Ci, H, W, Co, R, stride, padding): stride 1; 3x3 stride 2 side by side; 1x1 stride 2
    (4, 64, 14, 14, 64, 3, 1, 1), (2, 128, 28, 28, 128, 3, 2, 1), (2, 256, 28, 28, 512, 1, 2, 0),
    (2, 64, 15, 17, 64, 3, 2, 1)]


@pytest.fixture
def lesson06_backend():
    before = backward.backward_backend()
    conv_tutorial.set_backward("lesson06")
    yield
    conv_tutorial.set_backward(before)


@needs_gpu
@pytest.mark.parametrize("layer", DGRAD_LAYERS, ids=str)
@pytest.mark.parametrize("relu_gated", [False, True])
def test_gradient_replays_match_torch_on_new_tensors(layer, relu_gated, lesson06_backend):
    N, Ci, H, W, Co, R, stride, padding = layer
    torch.manual_seed(0)
    hostpath.clear()
    input_grad = torch.ops.conv_tutorial.conv2d_input_grad_relu if relu_gated else \
        torch.ops.conv_tutorial.conv2d_input_grad
    for call in range(5):
        x = _cl(torch.randn(N, Ci, H, W, device="cuda", dtype=torch.bfloat16))
        w = _cl(torch.randn(Co, Ci, R, R, device="cuda", dtype=torch.bfloat16) / (Ci * R * R) ** 0.5)
        out_shape = torch.nn.functional.conv2d(x[:1, :, :, :].float(), w.float(), None, stride, padding).shape[1:]
        dy = _cl(torch.randn(N, *out_shape, device="cuda", dtype=torch.bfloat16))
        args = (dy, x, w, [stride] * 2, [padding] * 2, [1, 1], 1)
        dx = input_grad(*args)
        dw = torch.ops.conv_tutorial.conv2d_weight_grad(*args)
        want_dx, want_dw = torch.ops.aten.convolution_backward(dy.float(), x.float(), w.float(), None, [stride] * 2,
                                                               [padding] * 2, [1, 1], False, [0, 0], 1,
                                                               [True, True, False])[:2]
        if relu_gated:
            want_dx = torch.where(x > 0, want_dx, 0)
        torch.testing.assert_close(dx.float(), want_dx, atol=5e-2, rtol=3e-2, msg=f"dX, call {call}")
        torch.testing.assert_close(dw.float(), want_dw, atol=0.5, rtol=3e-2, msg=f"dW, call {call}")
    assert _replay_of("conv2d_weight_grad") and _packed("conv2d_weight_grad")
    # dX replays, except where a strided dX takes torch's ReLU gate after the kernels (a copy: its full path)
    assert bool(_replay_of("conv2d_input_grad")) == (not relu_gated or stride == 1)
    assert not _replay_of("conv2d_input_grad") or _packed("conv2d_input_grad")


@needs_gpu
def test_the_stems_weight_grad_replays_its_fold(lesson06_backend):
    """ResNet-50's stem (3 channels, 7x7, stride 2): wgrad folds x and unfolds dW by torch around the kernel;
    its calls replay both ("derive" and "finish" steps) and match torch's dW on new tensors, call after call."""
    torch.manual_seed(0)
    hostpath.clear()
    for call in range(5):
        x = _cl(torch.randn(4, 3, 64, 64, device="cuda", dtype=torch.bfloat16))
        w = _cl(torch.randn(64, 3, 7, 7, device="cuda", dtype=torch.bfloat16) / 12)
        dy = _cl(torch.randn(4, 64, 32, 32, device="cuda", dtype=torch.bfloat16))
        dw = torch.ops.conv_tutorial.conv2d_weight_grad(dy, x, w, [2, 2], [3, 3], [1, 1], 1)
        want = torch.ops.aten.convolution_backward(dy.float(), x.float(), w.float(), None, [2, 2], [3, 3], [1, 1],
                                                   False, [0, 0], 1, [False, True, False])[1]
        assert dw.shape == want.shape and dw.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(dw.float(), want, atol=0.5, rtol=3e-2, msg=f"dW, call {call}")
    assert _replay_of("conv2d_weight_grad") and _packed("conv2d_weight_grad")


@needs_gpu
@pytest.mark.parametrize("packed_launches", [True, False], ids=["packed", "python"])
def test_packed_and_python_launches_give_the_same_bits(packed_launches, lesson06_backend):
    """Every path (the forward with its epilogue, the folded stem, split-K; dX in one conv, in phases with
    zeros, side by side; dW with and without split-K) replayed on the same tensors with packed launches
    and with the Python launch path: the same bits, calls after calls. (The "python" case is the control:
    the Python path against itself, that the paths give the same bits at all.)"""
    from conv_tutorial import packed
    torch.manual_seed(0)
    layers = FORWARD_LAYERS + DGRAD_LAYERS
    inputs = []
    for N, Ci, H, W, Co, R, stride, padding in layers:
        x = _cl(torch.randn(N, Ci, H, W, device="cuda", dtype=torch.bfloat16))
        w = _cl(torch.randn(Co, Ci, R, R, device="cuda", dtype=torch.bfloat16) / (Ci * R * R) ** 0.5)
        b = torch.randn(Co, device="cuda", dtype=torch.bfloat16)
        y = torch.nn.functional.conv2d(x, w, None, stride, padding)
        inputs.append((x, w, b, _cl(torch.randn_like(y)), _cl(torch.randn_like(y)), [stride] * 2, [padding] * 2))

    def run():
        hostpath.clear()
        outs, kept = [], []
        for call in range(4):
            for *tensors, stride, padding in inputs:
                x, w, b, residual, dy = (t.clone() for t in tensors)      # (new addresses on every call)
                args = (stride, padding, [1, 1], 1)
                outs.append(torch.ops.conv_tutorial.conv2d(x, w, b, *args, residual=residual, activation="relu"))
                outs.append(torch.ops.conv_tutorial.conv2d_input_grad(dy, x, w, *args))
                outs.append(torch.ops.conv_tutorial.conv2d_weight_grad(dy, x, w, *args))
                kept.append((x, w, b, residual, dy))     # (kept alive: no address handed back within a run)
        return outs, [r.packed for r in hostpath._REPLAYS.values() if isinstance(r, launch.Replay)]

    before = packed.set_enabled(packed_launches)
    try:
        got, programs = run()
    finally:
        packed.set_enabled(before)
    packed.set_enabled(False)
    try:
        want, _ = run()
    finally:
        packed.set_enabled(before)
    assert programs and all(p == packed_launches for p in programs if p is not None)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"result {i} (layer {i // 3 % len(layers)}, call {i // (3 * len(layers))})"


@needs_gpu
def test_native_calls_give_the_python_paths_bits(lesson06_backend):
    """Every path's repeat calls (the forward, with the channel sums too; dX at stride 1, strided, with zeros;
    dW with and without split-K) served by the operators' C++ kernels (native.py) on new tensors: the same
    bits as the Python path, and the C++ kernels did serve them (the forward's folded stem too; wgrad's
    derived input for the stem keeps the Python path)."""
    assert native.ensure(), "the native kernels could not be built here"
    torch.manual_seed(0)
    inputs = []
    for N, Ci, H, W, Co, R, stride, padding in FORWARD_LAYERS + DGRAD_LAYERS:
        x = _cl(torch.randn(N, Ci, H, W, device="cuda", dtype=torch.bfloat16))
        w = _cl(torch.randn(Co, Ci, R, R, device="cuda", dtype=torch.bfloat16) / (Ci * R * R) ** 0.5)
        b = torch.randn(Co, device="cuda", dtype=torch.bfloat16)
        y = torch.nn.functional.conv2d(x, w, None, stride, padding)
        inputs.append((x, w, b, _cl(torch.randn_like(y)), _cl(torch.randn_like(y)), [stride] * 2, [padding] * 2))
    ops = ("conv2d", "conv2d_channel_stats", "conv2d_input_grad", "conv2d_weight_grad")

    def run(enabled):
        previous = native.set_enabled(enabled)
        hostpath.clear()
        outs, kept = [], []
        try:
            for call in range(4):
                for *tensors, stride, padding in inputs:
                    x, w, b, residual, dy = (t.clone() for t in tensors)      # (new addresses on every call)
                    args = (stride, padding, [1, 1], 1)
                    outs.append(torch.ops.conv_tutorial.conv2d(x, w, b, *args, residual=residual, activation="relu"))
                    out, stats = torch.ops.conv_tutorial.conv2d_channel_stats(x, w, None, *args)
                    outs += [out, ("sums", stats)]      # (added up by atomics, in no fixed order)
                    outs.append(torch.ops.conv_tutorial.conv2d_input_grad(dy, x, w, *args))
                    outs.append(torch.ops.conv_tutorial.conv2d_weight_grad(dy, x, w, *args))
                    kept.append((x, w, b, residual, dy))
        finally:
            native.set_enabled(previous)
        return outs

    before = native.counts()
    got = run(True)
    served = {op: native.counts()[f"conv_tutorial::{op}"][0] - before.get(f"conv_tutorial::{op}", (0,))[0]
              for op in ops}
    want = run(False)
    for i, (a, b) in enumerate(zip(got, want)):
        if isinstance(a, tuple):
            torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-3, msg=f"result {i}")
        else:
            assert torch.equal(a, b), f"result {i}"
    layers = len(FORWARD_LAYERS + DGRAD_LAYERS)
    assert all(served[op] >= layers for op in ops), f"calls served natively, of {4 * layers} per operator: {served}"
    # the folded stem's forward (its fold two launches of the replay's program) is served too, and right
    (x, w, *_), stride, padding = inputs[3][:5], inputs[3][5], inputs[3][6]
    assert x.shape[1] == 3, "FORWARD_LAYERS[3] is the stem"
    before = native.counts()["conv_tutorial::conv2d"][0]
    want = torch.nn.functional.conv2d(x.float(), w.float(), None, stride, padding)
    # six calls: a new variant's first call compiles, the next records, one replays in Python and hands over
    for call in range(6):
        out = torch.ops.conv_tutorial.conv2d(x.clone(), w.clone(), None, stride, padding, [1, 1], 1)
        torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=3e-2, msg=f"the stem, call {call}")
    assert native.counts()["conv_tutorial::conv2d"][0] - before >= 3


@needs_gpu
def test_a_replayed_key_still_explains_an_unaligned_input():
    hostpath.clear()
    x = _cl(torch.randn(2, 64, 14, 14, device="cuda", dtype=torch.bfloat16))
    w = _cl(torch.randn(64, 64, 3, 3, device="cuda", dtype=torch.bfloat16))
    for _ in range(3):
        torch.ops.conv_tutorial.conv2d(x, w, None, [1, 1], [1, 1], [1, 1], 1)
    assert _replay_of("conv2d")
    storage = torch.empty(x.numel() + 1, device="cuda", dtype=torch.bfloat16)
    unaligned = storage[1:].view(2, 14, 14, 64).permute(0, 3, 1, 2)      # same shape and strides, 2 bytes off
    unaligned.copy_(x)
    with pytest.raises(ValueError, match="16-byte aligned"):
        torch.ops.conv_tutorial.conv2d(unaligned, w, None, [1, 1], [1, 1], [1, 1], 1)


@needs_gpu
def test_a_profiler_listening_gets_the_full_path(monkeypatch):
    """With a launch hook set (a profiler listens to Triton's launches), replays decline: every launch goes
    through Triton's launcher, where the hook sees it."""
    hostpath.clear()
    x = _cl(torch.randn(2, 64, 14, 14, device="cuda", dtype=torch.bfloat16))
    w = _cl(torch.randn(64, 64, 3, 3, device="cuda", dtype=torch.bfloat16))
    for _ in range(3):
        torch.ops.conv_tutorial.conv2d(x, w, None, [1, 1], [1, 1], [1, 1], 1)
    (replay,) = _replay_of("conv2d")
    monkeypatch.setattr(launch, "_launch_hooks_set", lambda: True)
    assert replay(x.device, {"input": x, "weight": w, "bias": None, "scale": None, "residual": None}) is None
    out = torch.ops.conv_tutorial.conv2d(x, w, None, [1, 1], [1, 1], [1, 1], 1)
    torch.testing.assert_close(out.float(), torch.nn.functional.conv2d(x.float(), w.float(), None, 1, 1),
                               atol=3e-2, rtol=3e-2)


@needs_gpu
def test_a_call_whose_residual_is_its_input_does_not_bind_later_calls():
    """Recorded with residual=input, a later call of the same key with another residual must add that one."""
    torch.manual_seed(0)
    hostpath.clear()
    x = _cl(torch.randn(2, 64, 14, 14, device="cuda", dtype=torch.bfloat16))
    w = _cl(torch.randn(64, 64, 3, 3, device="cuda", dtype=torch.bfloat16) / 24)
    for _ in range(3):
        torch.ops.conv_tutorial.conv2d(x, w, None, [1, 1], [1, 1], [1, 1], 1, residual=x)
    other = _cl(torch.randn_like(x))
    out = torch.ops.conv_tutorial.conv2d(x, w, None, [1, 1], [1, 1], [1, 1], 1, residual=other)
    want = torch.nn.functional.conv2d(x.float(), w.float(), None, 1, 1) + other.float()
    torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=3e-2)


@needs_gpu
def test_every_result_of_interleaved_calls_kept_alive_stays_right(lesson06_backend):
    """Two layers' forward and gradients called in turn, every input and result kept alive (each call gets new
    addresses, none reused), then every result checked against torch at the end: no replay wrote where it
    should not."""
    torch.manual_seed(0)
    hostpath.clear()
    layers = [(2, 64, 14, 14, 64, 3, 1, 1), (2, 128, 28, 28, 128, 3, 2, 1)]
    kept = []
    for call in range(6):
        for N, Ci, H, W, Co, R, stride, padding in layers:
            x = _cl(torch.randn(N, Ci, H, W, device="cuda", dtype=torch.bfloat16))
            w = _cl(torch.randn(Co, Ci, R, R, device="cuda", dtype=torch.bfloat16) / (Ci * R * R) ** 0.5)
            args = ([stride] * 2, [padding] * 2, [1, 1], 1)
            y = torch.ops.conv_tutorial.conv2d(x, w, None, *args)
            dy = _cl(torch.randn_like(y))
            dx = torch.ops.conv_tutorial.conv2d_input_grad(dy, x, w, *args)
            dw = torch.ops.conv_tutorial.conv2d_weight_grad(dy, x, w, *args)
            kept.append((x, w, dy, y, dx, dw, stride, padding))
    torch.cuda.synchronize()
    for x, w, dy, y, dx, dw, stride, padding in kept:
        torch.testing.assert_close(y.float(), torch.nn.functional.conv2d(x.float(), w.float(), None, stride, padding),
                                   atol=3e-2, rtol=3e-2)
        want_dx, want_dw = torch.ops.aten.convolution_backward(dy.float(), x.float(), w.float(), None, [stride] * 2,
                                                               [padding] * 2, [1, 1], False, [0, 0], 1,
                                                               [True, True, False])[:2]
        torch.testing.assert_close(dx.float(), want_dx, atol=5e-2, rtol=3e-2)
        torch.testing.assert_close(dw.float(), want_dw, atol=0.5, rtol=3e-2)
    assert _replay_of("conv2d") and _replay_of("conv2d_input_grad") and _replay_of("conv2d_weight_grad")


def test_a_python_launch_resolves_slots_in_arguments_and_their_tuples_and_refuses_deeper_ones():
    from conv_tutorial.packed import Slot
    log = []
    python_launch = launch.PythonLaunch(StandIn(log), (3,), (Slot(0, 8), 5, (Slot(1), 6, (7, 8)), None))
    python_launch.launch(None, [100, 200])
    assert log == [((3,), (108, 5, (200, 6, (7, 8)), None))]
    with pytest.raises(TypeError, match="two tuples deep"):
        launch.PythonLaunch(StandIn([]), (1,), ((1, (Slot(0),)),))
