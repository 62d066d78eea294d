"""The operator under torch.distributed's DistributedDataParallel (DDP), and under FSDP2 (fully_shard).

DDP all-reduces each parameter's gradient as autograd accumulates it (hooks on the gradient's
accumulator, in buckets), so a converted model trains under DDP if the operator's backward hands
autograd its gradients as any op does. Checked here as a user would see it: two processes, each on
half of the global batch, end with the same weights as one process on the whole batch, every
parameter's gradient passing through DDP's buckets once per step (`find_unused_parameters` off);
also with gradients accumulated over two micro-batches under `no_sync` (the all-reduce only on the last),
with and without the gradients as views into DDP's buckets (`gradient_as_bucket_view`), and with those views,
DDP's static graph and no broadcast of buffers (the settings README.md recommends; not with `no_sync`, which
torch's DDP refuses under a static graph with an internal assert, pytorch/pytorch#143580, the operator or not).
FSDP2 shards contiguous parameters only: with PyTorch's weight layout (convert_conv2d's
channels_last_weight=False) the same holds; its own error refuses channels_last weights.
On a CPU over gloo (the operator's CPU path: torch's conv in the forward, the backward's fallback
to torch with lesson 06's backend chosen), in float64 so that the two runs differ only by the order
of the all-reduce's sums; on two GPUs over NCCL, the kernels themselves, in bf16 autocast.
"""
import os
import sys
import tempfile

import common

import pytest
import torch

WORLD = 2
STEPS = 3


def small_net(seed=0, channels_last_weight=True):
    """A small convnet with the operator's convs (stride 2, a bias, no bias), the same weights for a seed."""
    import conv_tutorial
    torch.manual_seed(seed)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 32, 1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 5))
    return conv_tutorial.convert_conv2d(net, channels_last_weight)


def global_batches(dtype, device, batch=8, size=12):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 3, size, size, generator=generator, dtype=dtype).to(device).contiguous(
                memory_format=torch.channels_last),
             torch.randint(0, 5, (batch,), generator=generator).to(device)) for _ in range(STEPS)]


def train(model, batches, micro_batches=1, parameters_of=None, autocast=None):
    """SGD with momentum on the mean cross-entropy of each batch, its gradient summed over
    `micro_batches` slices (each loss scaled by its share); a DDP model all-reduces only on the
    last slice (no_sync before it)."""
    optimizer = torch.optim.SGD((parameters_of or model).parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        for i, (xs, ys) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
            last = i == micro_batches - 1
            sync = model.no_sync() if hasattr(model, "no_sync") and not last else _nothing()
            with sync, torch.autocast("cuda", torch.bfloat16, enabled=autocast is not None):
                loss = torch.nn.functional.cross_entropy(model(xs), ys) / micro_batches
            loss.backward()
        optimizer.step()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def ddp_worker(rank, init_file, out_file, backend, micro_batches, wrapper="ddp", bucket_view=False, static=False):
    """One process of WORLD: DDP (or FSDP2's fully_shard, `wrapper`) over `backend`, this rank's share of every
    global batch; rank 0 saves the weights. `bucket_view`: DDP's gradient_as_bucket_view (the gradients
    views into its buckets, each in its parameter's strides: channels_last for the operator's weights). `static`:
    DDP's static_graph and no broadcast of buffers before each forward (the settings README.md recommends)."""
    import conv_tutorial
    import torch.distributed as dist
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")      # NVLink multicast stays off
    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        conv_tutorial.set_backward("lesson06")
        device = f"cuda:{rank}" if cuda else "cpu"
        model = small_net(channels_last_weight=wrapper == "ddp").to(device)
        model = model if cuda else model.double()
        buckets = []        # (the gradients' elements each all-reduce carried, per bucket)
        if wrapper == "ddp":
            wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank] if cuda else None,
                                                                gradient_as_bucket_view=bucket_view,
                                                                static_graph=static, broadcast_buffers=not static)

            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            def counted(state, bucket):       # DDP's own all-reduce, counted: what the backward handed it
                buckets.append(bucket.buffer().numel())
                return allreduce_hook(state, bucket)
            wrapped.register_comm_hook(None, counted)
        else:       # FSDP2: each layer with parameters sharded, then the whole
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            # the mesh named: without one, fully_shard takes the machine's GPU where it has one, and moves a
            # CPU test's weights there
            mesh = init_device_mesh("cuda" if cuda else "cpu", (WORLD,))
            for layer in model:
                if any(True for _ in layer.parameters()):
                    fully_shard(layer, mesh=mesh)
            wrapped = fully_shard(model, mesh=mesh)
        batches = [(x.chunk(WORLD)[rank], y.chunk(WORLD)[rank])
                   for x, y in global_batches(torch.float32 if cuda else torch.float64, device)]
        train(wrapped, batches, micro_batches, autocast=True if cuda else None)
        weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).cpu()   # (every rank gathers)
                   for k, v in model.state_dict().items()}
        if wrapper == "ddp":     # every parameter's gradient reached DDP's buckets, once per all-reduced step
            total = sum(p.numel() for p in model.parameters())
            assert sum(buckets) == total * len(batches), (sum(buckets), total, len(batches))
        if rank == 0:
            torch.save(weights, out_file)
        dist.barrier()      # every rank's collectives done before any rank tears the group down
    finally:
        dist.destroy_process_group()
    if not cuda:
        # Every rank has trained, gathered and saved. On a CPU, gloo's groups sometimes abort in the process's
        # own teardown afterwards ("terminate called without an active exception": about 1 run in 15 under
        # fully_shard, and seen once under DDP, with both ranks already returned): leave without that teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_ddp(backend, micro_batches, wrapper="ddp", bucket_view=False, static=False):
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as folder:
        init_file, out_file = os.path.join(folder, "init"), os.path.join(folder, "weights.pt")
        mp.spawn(ddp_worker, args=(init_file, out_file, backend, micro_batches, wrapper, bucket_view, static),
                 nprocs=WORLD,
                 join=True)
        return torch.load(out_file)


def one_process(dtype, device, autocast=None):
    model = small_net().to(device).to(memory_format=torch.channels_last)
    model = model.to(dtype) if dtype == torch.float64 else model
    train(model, global_batches(dtype, device), autocast=autocast)
    return {k: v.cpu() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("micro_batches, bucket_view, static", [(1, False, False), (2, False, False), (2, True, False),
                                                                 (1, True, True)],
                         ids=["one step", "no_sync, then sync", "no_sync, then sync, gradients as bucket views",
                              "one step, gradients as bucket views, static graph, no buffer broadcast"])
def test_two_processes_end_with_the_weights_of_one_on_the_whole_batch(micro_batches, bucket_view, static):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # the CPU path's fallback says so once per reason
        want = one_process(torch.float64, "cpu")
        got = run_ddp("gloo", micro_batches, bucket_view=bucket_view, static=static)
    initial = {k: v.double() for k, v in small_net().state_dict().items()}
    assert got.keys() == want.keys()
    for name in want:
        assert not torch.equal(want[name], initial[name]), f"{name} did not train"
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12, msg=name)


def test_fully_shard_trains_the_operator_with_contiguous_weights():
    """FSDP2 (torch.distributed.fsdp.fully_shard) shards contiguous parameters only: with the weights in
    PyTorch's layout (convert_conv2d(..., channels_last_weight=False)) two sharded processes end with one
    process's weights; the default channels_last weights are refused, with fully_shard's own error."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = one_process(torch.float64, "cpu")
        got = run_ddp("gloo", 1, wrapper="fsdp2")
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12, msg=name)


def test_fully_shard_says_why_it_refuses_channels_last_weights():
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'init')}", rank=0, world_size=1)
        try:
            with pytest.raises(NotImplementedError, match="non-contiguous parameters"):
                fully_shard(small_net()[0])
        finally:
            dist.destroy_process_group()


needs_two_gpus = pytest.mark.skipif(not (common.has_tma_mma_gpu() and torch.cuda.device_count() >= WORLD),
                                    reason=f"needs {WORLD} Hopper or data-centre Blackwell GPUs")


@needs_two_gpus
def test_two_gpus_end_near_the_weights_of_one_on_the_whole_batch():
    """The kernels on two GPUs over NCCL against one GPU on the whole batch, bf16 autocast: each run rounds
    its convs' outputs and gradients to bf16 (2^-8 relative) in its own tile order (the batch each GPU sees
    changes the tiling), so the weights' changes agree to a few bf16 roundings of the gradient, not bit
    for bit: within 5% of each parameter's change, over three steps."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import conv_tutorial
        before = conv_tutorial.backward_backend()
        conv_tutorial.set_backward("lesson06")
        try:
            want = one_process(torch.float32, "cuda", autocast=True)
        finally:
            conv_tutorial.set_backward(before)
        got = run_ddp("nccl", 1)
    initial = small_net().state_dict()
    for name in want:
        change, ddp_change = want[name] - initial[name], got[name] - initial[name]
        assert torch.linalg.vector_norm(ddp_change - change) <= 0.05 * torch.linalg.vector_norm(change), name
