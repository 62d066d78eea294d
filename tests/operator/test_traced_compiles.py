"""conv_tutorial.compile_while_tracing: the kernels a step needs handed to the compile pool from
torch.compile's own tracing (the operators' fake implementations), with no eager pass.

On a CPU, with fake CUDA tensors (which need no GPU) and the compile-only block and the stand-ins
replaced by CPU stand-ins: a traced call is handed over once, with stand-ins of its tensors' shapes,
strides, storage offsets and dtypes; a call seen before, a CPU call, a symbolic size and a call with
the switch off are not, nor are calls while autotuning is on or torch computes the gradients; a failing
hand-over is counted, warns once and never raises into the tracing; the backward's operators
are handed over too; the backward's fallback count is the step's alone. The GPU test, a compiled training
step with it on, is test_compile_ahead.py's (its net and Triton's caches are there)."""
import concurrent.futures
import contextlib
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import conv_tutorial
import conv_tutorial.ops  # noqa: F401  (registers the operators)
from conv_tutorial import launch, traced_compiles


@pytest.fixture
def handed(monkeypatch):
    """compile_while_tracing on; yields the hand-overs made, each the list of its stand-ins' facts (shape,
    strides, storage offset, dtype, the type of the tensor it stands in for and its own), made on the CPU, the
    compile-only block and the pool replaced by stand-ins of their own."""
    calls, pending = [], []

    def cpu_stand_in(t):
        extent = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
        stand_in = torch.empty(extent, dtype=t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())
        pending.append((tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, type(t).__name__,
                        type(stand_in).__name__))     # (a real tensor: made outside the tracing's modes)
        return stand_in

    real_compiling_into = launch.compiling_into

    class NoCompiles(concurrent.futures.Executor):      # (on a CPU the operators compile nothing)
        def submit(self, fn, /, *args, **kwargs):
            raise AssertionError("a compile was submitted on a CPU")

    @contextlib.contextmanager
    def compiling_into(pool):
        assert pool == "the pool"
        calls.append(list(pending))
        pending.clear()
        with real_compiling_into(NoCompiles()):       # (the compile-only mode itself, its pool a stand-in)
            yield

    monkeypatch.setattr(traced_compiles, "stand_in_for", cpu_stand_in)
    monkeypatch.setattr(launch, "compiling_into", compiling_into)
    monkeypatch.setattr(traced_compiles, "_pool", lambda: "the pool")
    monkeypatch.setattr(traced_compiles, "_on_device", lambda device: contextlib.nullcontext())
    conv_tutorial.compile_while_tracing()
    yield calls
    conv_tutorial.compile_while_tracing(False)


def fake_conv(shape=(2, 16, 8, 8), co=32, device="cuda", dtype=torch.bfloat16, stride=1):
    with FakeTensorMode():
        x = torch.empty(shape, device=device, dtype=dtype).to(memory_format=torch.channels_last)
        w = torch.empty(co, shape[1], 3, 3, device=device, dtype=dtype).to(memory_format=torch.channels_last)
        y = torch.ops.conv_tutorial.conv2d(x, w, None, [stride, stride], [1, 1], [1, 1], 1)
    return y


@pytest.mark.parametrize("kwargs, error, match", [
    ({"enabled": 1}, TypeError, "enabled must be a bool"),
    ({"workers": 0}, ValueError, "workers must be None or a positive int"),
    ({"workers": True}, ValueError, "workers must be None or a positive int"),
])
def test_refuses_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        conv_tutorial.compile_while_tracing(**kwargs)


def test_a_traced_call_is_handed_over_once_with_its_tensors_facts(handed):
    calls = handed
    y = fake_conv()
    assert tuple(y.shape) == (2, 32, 8, 8)       # (the fake's own result, unchanged)
    assert calls == [[((2, 16, 8, 8), (1024, 1, 128, 16), 0, torch.bfloat16, "FakeTensor", "Tensor"),
                      ((32, 16, 3, 3), (144, 1, 48, 16), 0, torch.bfloat16, "FakeTensor", "Tensor")]]
    fake_conv()                                   # the same call again: nothing more
    assert len(calls) == 1
    fake_conv(stride=2)                           # another argument: handed over
    fake_conv(shape=(2, 16, 10, 8))               # another shape: handed over
    assert len(calls) == 3 and calls[2][0][0] == (2, 16, 10, 8)


def test_cpu_calls_and_calls_with_the_switch_off_are_left_alone(handed):
    calls = handed
    fake_conv(device="cpu")
    assert calls == []
    conv_tutorial.compile_while_tracing(False)
    assert not traced_compiles.compiling_while_tracing()
    fake_conv()
    assert calls == []
    conv_tutorial.compile_while_tracing()         # on again: the calls seen before are forgotten
    fake_conv()
    fake_conv()
    assert len(calls) == 1


def test_a_symbolic_size_is_left_alone():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    size = ShapeEnv().create_unbacked_symint()
    assert traced_compiles._call_key(len, (size,), {}) is None
    assert traced_compiles._call_key(len, ([1, size],), {}) is None
    assert traced_compiles._call_key(len, (torch.zeros(2), [1, 2], "relu"), {"groups": 1}) is not None


def test_a_failing_hand_over_warns_once_is_counted_and_tracing_goes_on(handed, monkeypatch):
    def broken(t):
        raise RuntimeError("no stand-in")
    monkeypatch.setattr(traced_compiles, "stand_in_for", broken)
    with pytest.warns(RuntimeWarning, match="could not compile its kernels ahead.*no stand-in") as record:
        y = fake_conv()
        fake_conv(stride=2)
    assert len([w for w in record if "compile_while_tracing" in str(w.message)]) == 1
    assert tuple(y.shape) == (2, 32, 8, 8) and traced_compiles.hand_over_failures() == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # (said at most, never raised into the tracing)
        fake_conv(stride=3)
    assert traced_compiles.hand_over_failures() == 3
    conv_tutorial.compile_while_tracing()        # (on again: counted afresh)
    assert traced_compiles.hand_over_failures() == 0


def test_an_argument_that_makes_no_key_is_a_failure_not_an_error(handed):
    with FakeTensorMode():
        x = torch.empty(2, 3, device="cuda")
    with pytest.warns(RuntimeWarning, match="unhashable"):
        traced_compiles.hand_over(len, (x,), {"options": {"a": 1}})
    assert handed == [] and traced_compiles.hand_over_failures() == 1


def test_autotuning_on_and_torchs_backward_are_left_alone(handed):
    before_backend, before_tune = conv_tutorial.backward_backend(), conv_tutorial.autotune_enabled()
    try:
        conv_tutorial.set_autotune(True)
        fake_conv()
        assert handed == []
        conv_tutorial.set_autotune(False)
        conv_tutorial.set_backward("torch")     # (its gradients: torch's convolution_backward, nothing to compile)
        with FakeTensorMode():
            g, x, w = (torch.empty(shape, device="cuda", dtype=torch.bfloat16)
                       for shape in ((2, 32, 8, 8), (2, 16, 8, 8), (32, 16, 3, 3)))
            torch.ops.conv_tutorial.conv2d_input_grad(g, x, w, [1, 1], [1, 1], [1, 1], 1)
        assert handed == []
    finally:
        conv_tutorial.set_autotune(before_tune)
        conv_tutorial.set_backward(before_backend)


def test_the_backwards_operators_are_handed_over_and_the_fallback_count_is_the_steps(handed):
    calls = handed
    before_backend = conv_tutorial.backward_backend()
    conv_tutorial.set_backward("lesson06")
    try:
        fallbacks = conv_tutorial.backward_fallbacks()
        with FakeTensorMode():
            x = torch.empty(2, 16, 8, 8, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
            w = torch.empty(32, 16, 3, 3, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
            g = torch.empty(2, 32, 8, 8, device="cuda", dtype=torch.bfloat16).to(memory_format=torch.channels_last)
            dx = torch.ops.conv_tutorial.conv2d_input_grad(g, x, w, [1, 1], [1, 1], [1, 1], 1)
            dw = torch.ops.conv_tutorial.conv2d_weight_grad(g, x, w, [1, 1], [1, 1], [1, 1], 1)
        assert tuple(dx.shape) == (2, 16, 8, 8) and tuple(dw.shape) == (32, 16, 3, 3)
        assert [[fact[0] for fact in call] for call in calls] == [[(2, 32, 8, 8), (2, 16, 8, 8), (32, 16, 3, 3)]] * 2
        assert conv_tutorial.backward_fallbacks() == fallbacks
    finally:
        conv_tutorial.set_backward(before_backend)


def test_a_stand_in_has_the_tensors_facts():
    base = torch.zeros(200, dtype=torch.float16)
    for t in (base[3:3 + 60].view(3, 4, 5).transpose(0, 2), base[8:8 + 24].view(2, 3, 4), base[:0].view(0, 5)):
        stand_in = traced_compiles.stand_in_for(t)
        assert (stand_in.shape, stand_in.stride(), stand_in.storage_offset(), stand_in.dtype) == \
               (t.shape, t.stride(), t.storage_offset(), t.dtype)
        assert stand_in.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    with FakeTensorMode():
        fake = torch.empty(4, 6, dtype=torch.bfloat16)[1:, 2:]
    stand_in = traced_compiles.stand_in_for(fake)
    assert type(stand_in) is torch.Tensor and (stand_in.shape, stand_in.stride(), stand_in.storage_offset()) == \
           (fake.shape, fake.stride(), fake.storage_offset())


def test_torch_compiles_tracing_hands_over_the_forwards_and_the_backwards_calls(handed, monkeypatch):
    """torch.compile's own tracing, on a CPU (the CPU's calls let through for the test; torch's convs serve
    them): Dynamo's calls of the fused forward operator and AOTAutograd's of the backward's hand each call over
    once, their stand-ins run outside the tracing's modes (no warning), and the step's gradients are those of
    the same step in eager mode."""
    monkeypatch.setattr(traced_compiles, "_DEVICES", ("cuda", "cpu"))
    before = conv_tutorial.backward_backend()
    conv_tutorial.set_backward("lesson06")
    try:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
                                  torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3, stride=2, padding=1))
        net = conv_tutorial.convert_conv2d(conv_tutorial.fuse_conv_batchnorm_for_training(net))
        x = torch.randn(2, 3, 8, 8, requires_grad=True)
        torch.compile(net, backend="aot_eager")(x).square().sum().backward()
        assert traced_compiles.hand_over_failures() == 0
        compiled = [p.grad.clone() for p in net.parameters()] + [x.grad.clone()]
        for p in [*net.parameters(), x]:
            p.grad = None
        net(x).square().sum().backward()
        for ours, eager in zip(compiled, [p.grad for p in net.parameters()] + [x.grad]):
            torch.testing.assert_close(ours, eager)
        names = sorted({key[1] for key in traced_compiles._SEEN})
        assert names == ["_conv2d_channel_stats", "_conv2d_with_epilogue", "_input_grad", "_weight_grad"], names
        assert len(handed) == len(traced_compiles._SEEN)
        assert {fact[-1] for call in handed for fact in call} == {"Tensor"}       # (no fake, functional or traced one)
    finally:
        conv_tutorial.set_backward(before)
        torch._dynamo.reset()
