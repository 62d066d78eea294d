"""conv_tutorial.compile_kernels_ahead: a training step's kernels compiled side by side before the step.

On a CPU: bad arguments get clear errors; the pass keeps nothing of the step it runs (no parameter's
gradient written, BatchNorm's running statistics and counter put back, though a train-mode forward
moves them; a buffer the forward replaces, the random number generator, the backward's fallback
count); an output it cannot differentiate is said; an operator call inside `launch.compiling_ahead`
records no replay. On a GPU: the
backward's calls see the compile-only mode (autograd would otherwise run them on a thread of its
own), the step after the pass compiles no Gluon kernel of its own, and its gradients are torch's; with
compile_while_tracing instead of the pass (traced_compiles.py), a compiled step's kernels are compiled by
the workers from its tracing, and its gradients are torch's."""
import copy
import warnings

import common

import pytest
import torch
import triton

import conv_tutorial
from conv_tutorial import compile_ahead, hostpath
from conv_tutorial import launch as plans

needs_gpu = pytest.mark.skipif(not common.has_tma_mma_gpu(), reason=common.GLUON_SKIP_REASON)


def small_net(device="cpu"):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1, bias=False), torch.nn.BatchNorm2d(32),
                              torch.nn.ReLU(), torch.nn.Conv2d(32, 64, 3, stride=2, padding=1, bias=False),
                              torch.nn.BatchNorm2d(64), torch.nn.ReLU(), torch.nn.Conv2d(64, 64, 1, stride=2, bias=False),
                              torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10))
    return net.to(device).to(memory_format=torch.channels_last).train()


@pytest.mark.parametrize("model, inputs, kwargs, error, match", [
    ("not a module", (torch.zeros(1),), {}, TypeError, "model must be a torch.nn.Module"),
    (None, (), {}, TypeError, "example_inputs must be one or more tensors"),
    (None, ([1, 2],), {}, TypeError, "example_inputs must be one or more tensors"),
    (None, (torch.zeros(1, 3, 8, 8),), {"autocast_dtype": torch.float32}, ValueError, "autocast_dtype must be"),
    (None, (torch.zeros(1, 3, 8, 8),), {"workers": 0}, ValueError, "workers must be"),
    (None, (torch.zeros(1, 3, 8, 8),), {"workers": True}, ValueError, "workers must be"),
    (None, (torch.zeros(1, 3, 8, 8),), {"wait": "no"}, TypeError, "wait must be a bool"),
])
def test_refuses_bad_arguments(model, inputs, kwargs, error, match):
    with pytest.raises(error, match=match):
        conv_tutorial.compile_kernels_ahead(small_net() if model is None else model, *inputs, **kwargs)


def test_refuses_a_ddp_wrapper():
    class FakeDDP(torch.nn.parallel.DistributedDataParallel):   # (no process group needed to be one)
        def __init__(self, module):
            torch.nn.Module.__init__(self)
            self.module = module
    with pytest.raises(ValueError, match="model.module"):
        conv_tutorial.compile_kernels_ahead(FakeDDP(small_net()), torch.zeros(2, 3, 8, 8))


def test_refuses_a_compiled_module():
    with pytest.raises(ValueError, match="_orig_mod"):
        conv_tutorial.compile_kernels_ahead(torch.compile(small_net()), torch.zeros(2, 3, 8, 8))


def test_nothing_to_compile_off_the_gpu():
    model = small_net()
    before = copy.deepcopy(model.state_dict())
    assert conv_tutorial.compile_kernels_ahead(model, torch.randn(2, 3, 8, 8)) == 0.0
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_the_step_it_runs_leaves_no_trace():
    """The pass itself (on a CPU, where the operator runs torch's conv): a train-mode forward moves
    BatchNorm's running statistics and counter, and a backward would write every `.grad`; after the
    pass, all are as they were (the `.grad`s that existed unchanged, the others still None)."""
    model = conv_tutorial.convert_conv2d(small_net())
    x = torch.randn(4, 3, 12, 12).contiguous(memory_format=torch.channels_last)
    model[-1].weight.grad = torch.ones_like(model[-1].weight)       # one gradient already there
    state = copy.deepcopy(model.state_dict())
    probe = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # (the operator's word that torch runs these convs on a CPU)
        with torch.no_grad():
            probe(x)
        compile_ahead._step_once(model, (x,), backward=True, autocast_dtype=torch.bfloat16, workers=1)
    moved = [name for name, value in probe.state_dict().items() if not torch.equal(value, state[name])]
    assert any("running_mean" in name for name in moved) and any("num_batches_tracked" in name for name in moved)
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name
    for name, p in model.named_parameters():
        if p is model[-1].weight:
            assert torch.equal(p.grad, torch.ones_like(p))
        else:
            assert p.grad is None, name


def test_the_pass_puts_back_what_a_forward_moves_besides_batchnorm():
    """The random number generator (a Dropout draws from it), a buffer the forward replaces by another tensor,
    and the count of the backward's fallbacks (on a CPU, lesson 06's backend hands every gradient to torch)."""
    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3)
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            self.calls = self.calls + 1                        # another tensor in the buffer's place
            return torch.nn.functional.dropout(self.conv(x), 0.5, training=True)
    model = conv_tutorial.convert_conv2d(Counting())
    backend = conv_tutorial.backward_backend()
    conv_tutorial.set_backward("lesson06")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(torch.randn(1, 3, 6, 6)).sum().backward()         # one real step: one fallback per gradient
            counted = conv_tutorial.backward_fallbacks()
            assert counted
            x = torch.randn(2, 3, 8, 8)
            buffer, rng = model.calls, torch.get_rng_state()
            compile_ahead._step_once(model, (x,), True, None, 1)
    finally:
        conv_tutorial.set_backward(backend)
    assert model.calls is buffer and model.calls.item() == 1
    assert torch.equal(torch.get_rng_state(), rng)
    assert conv_tutorial.backward_fallbacks() == counted


def test_an_output_it_cannot_differentiate_is_said():
    class Boxed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 1)

        def forward(self, x):
            return type("Box", (), {"value": self.conv(x)})()       # not a tensor, tuple, list or dict
    with pytest.warns(UserWarning, match="only the forward's kernels"):
        compile_ahead._step_once(Boxed(), (torch.randn(1, 3, 4, 4),), True, None, 1)


def test_refuses_a_lazy_model():
    with pytest.raises(ValueError, match="lazy"):
        conv_tutorial.compile_kernels_ahead(torch.nn.LazyConv2d(8, 3), torch.randn(1, 3, 8, 8))


def test_an_operator_call_inside_compiling_ahead_records_no_replay():
    key = ("a key of no real call", 1)
    calls = []
    with plans.compiling_ahead(workers=1):
        out = hostpath.call("test::op", key, "cpu", {}, lambda: calls.append(1) or "result", ("output",))
    assert out == "result" and calls == [1] and key not in hostpath._REPLAYS


@needs_gpu
def test_refuses_an_input_off_the_models_gpu():
    with pytest.raises(ValueError, match="pass an input on the device the step runs on"):
        conv_tutorial.compile_kernels_ahead(small_net("cuda"), torch.randn(2, 3, 8, 8))


@needs_gpu
def test_the_backward_runs_where_the_compile_only_mode_is_set():
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(plans.compiling_ahead_active())
            return grad

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4, device="cuda"))

        def forward(self, x):
            return Probe.apply(x * self.w)
    compile_ahead._step_once(Net(), (torch.ones(4, device="cuda"),), True, None, 1)
    assert seen == [True]


def _clear_in_memory_caches():
    # Triton's in-memory caches of the forward's and wgrad's kernels on this GPU (the plans built so far keep
    # their compiled kernels)
    from conv_tutorial.kernels import fprop, wgrad
    for kernel in (fprop.conv2d_fprop_kernel, wgrad.conv2d_wgrad_kernel):
        kernel.device_caches[torch.cuda.current_device()][0].clear()


def _cache_entries():
    # every entry of Triton's in-memory caches of the forward's and wgrad's kernels on this GPU, by (kernel, key)
    from conv_tutorial.kernels import fprop, wgrad
    device = torch.cuda.current_device()
    return {(kernel.fn.__name__, key): entry for kernel in (fprop.conv2d_fprop_kernel, wgrad.conv2d_wgrad_kernel)
            for key, entry in kernel.device_caches[device][0].items()}


def _assert_gradients_match(model, names, reference):
    """The converted net's gradients (its parameters named by `names`, their storage's address -> name) against
    the same net's on cuDNN: bf16's rounding through three convs and two BatchNorms, 5e-2 of each gradient's
    largest value (garbage, a missed launch, would be off by its whole size)."""
    ours = {names[p.data_ptr()]: p.grad for p in model.parameters()}
    assert ours.keys() == {name for name, _ in reference.named_parameters()}
    for name, expected in reference.named_parameters():
        scale = expected.grad.abs().max().item()
        torch.testing.assert_close(ours[name].float(), expected.grad.float(), rtol=5e-2, atol=5e-2 * scale,
                                   msg=lambda m, name=name: f"{name}: {m}")


def _compiled_kernels():
    from conv_tutorial.kernels import fprop, wgrad
    device = torch.cuda.current_device()
    return sum(len(kernel.device_caches[device][0]) for kernel in (fprop.conv2d_fprop_kernel, wgrad.conv2d_wgrad_kernel))


@needs_gpu
@pytest.mark.parametrize("wait", [True, False], ids=["waiting", "not waiting"])
def test_the_step_after_it_compiles_nothing_and_trains_as_torch(wait, tmp_path, monkeypatch):
    """A converted net with BatchNorm's sums fused and lesson 06's gradients, under bf16 autocast: after the
    pass, one real step adds no forward or wgrad kernel to Triton's caches (each was compiled ahead), and its
    gradients match the same net on cuDNN (bf16's rounding through three convs and two BatchNorms: 5e-2 of each
    gradient's largest value; garbage, a missed launch, would be off by its whole size). Its 1x1 stride-2
    conv's dgrad zero-fills the pixels no tap reaches: a kernel the pass compiles and does not launch.
    Not waiting (wait=False), the pass leaves its compiles in progress in Triton's cache (FutureKernels),
    and the step's first launches wait for them; waiting, it leaves none. With Triton's file cache empty,
    the compiles run in worker processes (compile_pool)."""
    from triton.runtime._async_compile import FutureKernel
    from conv_tutorial import compile_pool
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))       # (every compile a miss: to the workers)
    in_workers = compile_pool.compiles_in_workers()
    before = conv_tutorial.backward_backend()
    conv_tutorial.set_backward("lesson06")
    try:
        reference = small_net("cuda")
        twin = copy.deepcopy(reference)
        names = {p.data_ptr(): name for name, p in twin.named_parameters()}      # (the passes keep the storage)
        model = conv_tutorial.convert_conv2d(conv_tutorial.fuse_conv_batchnorm_for_training(twin, inplace=True))
        # (a height of its own per case: shapes no plan has seen, so the pass goes through every plan's compile)
        x = torch.randn(16, 3, 40 if wait else 44, 36, device="cuda").contiguous(memory_format=torch.channels_last)
        _clear_in_memory_caches()      # (so the pass submits every compile: Triton's disk cache still serves)
        seconds = conv_tutorial.compile_kernels_ahead(model, x, autocast_dtype=torch.bfloat16, workers=4, wait=wait)
        assert seconds > 0
        entries = _cache_entries()
        pending = [key for key, entry in entries.items() if isinstance(entry, FutureKernel)]
        assert entries and bool(pending) == (not wait), f"{len(pending)} of {len(entries)} compiles left in progress"
        compiled = _compiled_kernels()
        for net in (model, reference):
            with torch.autocast("cuda", torch.bfloat16):
                net(x).float().square().sum().backward()
        assert _compiled_kernels() == compiled
        assert compile_pool.compiles_in_workers() >= in_workers + len(entries)
        _assert_gradients_match(model, names, reference)
    finally:
        conv_tutorial.set_backward(before)


@needs_gpu
def test_a_compiled_step_has_its_kernels_compiled_in_the_workers_and_trains_as_cudnn(tmp_path, monkeypatch):
    """compile_while_tracing instead of the pass. With Triton's file cache empty, its in-memory caches of the
    forward's and wgrad's kernels cleared, and AOTAutograd's and Inductor's caches off (so the backward is
    traced here, not loaded), torch.compile's tracing of one training step (BatchNorm's sums fused, lesson 06's
    gradients, bf16 autocast) hands the step's compiles to the workers: every forward (dgrad's phases among
    them) and wgrad kernel in Triton's caches after the step was compiled by a worker (one the tracing missed
    would have compiled at its launch, in this process), no hand-over failed, and the step's gradients match
    the same net's on cuDNN (bf16's rounding through three convs and two BatchNorms: 5e-2 of each gradient's
    largest value)."""
    import time
    import torch._functorch.config
    import torch._inductor.config
    from conv_tutorial import compile_pool, traced_compiles
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))       # (every compile a miss: to the workers)
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    _clear_in_memory_caches()
    started = time.perf_counter()
    before = conv_tutorial.backward_backend()
    conv_tutorial.set_backward("lesson06")
    torch._dynamo.reset()
    conv_tutorial.compile_while_tracing(workers=4)
    try:
        reference = small_net("cuda")
        twin = copy.deepcopy(reference)
        names = {p.data_ptr(): name for name, p in twin.named_parameters()}
        model = conv_tutorial.convert_conv2d(conv_tutorial.fuse_conv_batchnorm_for_training(twin, inplace=True))
        step = torch.compile(model)
        x = torch.randn(16, 3, 36, 44, device="cuda").contiguous(memory_format=torch.channels_last)
        with torch.autocast("cuda", torch.bfloat16):
            step(x).float().square().sum().backward()
            reference(x).float().square().sum().backward()
        assert traced_compiles.hand_over_failures() == 0
        entries = _cache_entries()
        by_workers = [entry["kernel"] for entry in compile_pool.compile_timeline()
                      if entry["submitted"] >= started and entry["where"] == "worker"]
        for kernel in ("conv2d_fprop_kernel", "conv2d_wgrad_kernel"):
            in_cache = [key for name, key in entries if name == kernel]
            assert in_cache and by_workers.count(kernel) >= len(in_cache), (kernel, len(in_cache), by_workers)
        _assert_gradients_match(model, names, reference)
    finally:
        conv_tutorial.compile_while_tracing(False)
        conv_tutorial.set_backward(before)
        torch._dynamo.reset()
