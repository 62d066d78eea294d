"""Fusing conv -> BatchNorm -> (+ residual) -> activation into one operator call, with torch.fx, and
keeping the convs torch runs faster.

    fused = conv_tutorial.fuse_conv_bn_act(model.eval(), example_input=x)   # a torch.fx pass:
    # conv -> BatchNorm (folded) -> (+ residual) -> ReLU/SiLU become one call each (FusedConv2d)
    fused = conv_tutorial.keep_faster_convs(fused.to(torch.bfloat16, memory_format=torch.channels_last).cuda(),
                                            x_deployed)   # measured: torch keeps the convs it runs faster
"""
import copy
import operator
import time
import warnings
from typing import Optional

import torch
import triton

from . import launch, ops, selection
from .configs import grouped_conv_fits
from .geometry import ACTIVATIONS, current_arch
from .ops import conv2d_op, is_depthwise, reference_epilogue


# %% Fusing conv -> BatchNorm -> (+ residual) -> activation into one call ---------------------------
# In eval mode a BatchNorm is an affine map per channel: bn(z) = z * g + (beta - mean * g) with
# g = gamma / sqrt(var + eps). After a conv it folds into the conv: weights w * g (per output
# channel) and a shift (b - mean) * g + beta. What follows it in a ResNet block, the residual add
# and the ReLU, the kernel's epilogue applies while the tile is still in registers, so the
# activation tensor is written once instead of being read and written again by each of them.

ACTIVATION_MODULES = {torch.nn.ReLU: "relu", torch.nn.SiLU: "silu"}
ACTIVATION_FUNCTIONS = {torch.relu: "relu", torch.nn.functional.relu: "relu",
                        torch.nn.functional.silu: "silu"}
ACTIVATION_METHODS = {"relu": "relu", "relu_": "relu"}
ADD_FUNCTIONS = (operator.add, operator.iadd, torch.add)


def fold_batchnorm(weight, bias, bn):
    """(weight, shift) of conv -> bn in eval mode, computed in fp32; the weight is returned in its
    own dtype, the shift in fp32."""
    g = bn.weight.detach().float() if bn.affine else torch.ones_like(bn.running_var, dtype=torch.float32)
    beta = bn.bias.detach().float() if bn.affine else torch.zeros_like(g)
    g = g / torch.sqrt(bn.running_var.float() + bn.eps)
    conv_bias = bias.detach().float() if bias is not None else torch.zeros_like(g)
    folded_weight = (weight.detach().float() * g.view(-1, 1, 1, 1)).to(weight.dtype)
    return folded_weight, (conv_bias - bn.running_mean.float()) * g + beta


MAX_GROUP_MERGE = 16    # the most groups merged into one: each does MAX_GROUP_MERGE times the MMA work


def group_merge(groups, Ci_group, Co_group, arch="this machine"):
    """How many neighbouring groups of a grouped conv to merge into one so that the kernel runs it:
    the smallest divisor P of `groups` (up to MAX_GROUP_MERGE) for which P groups' channels fill
    whole tiles (lesson 05, section 10), or all of them (P = groups: a plain conv, any channels);
    None if there is none. Tiles of `arch` ("sm_90", "sm_100"; None: of both; by default this
    machine's GPU, or both where it has none)."""
    arch = current_arch() if arch == "this machine" else arch
    for P in range(1, min(groups, MAX_GROUP_MERGE) + 1):
        if groups % P == 0 and (P == groups or grouped_conv_fits(P * Ci_group, P * Co_group, arch)):
            return P
    return None


def merge_groups(weight, groups, P):
    """The weight [Co, Ci/groups, R, S] of a conv with `groups` groups, rewritten for the same conv
    with groups / P groups: a merged group's output channel keeps its own filter at its old group's
    place among the P groups' input channels, zeros at the other P - 1 (block diagonal). Exact: the
    zeros multiply the other groups' channels."""
    Co, Cg, R, S = weight.shape
    blocks = weight.reshape(groups // P, P, Co // groups, Cg, R, S)
    merged = weight.new_zeros(groups // P, P, Co // groups, P, Cg, R, S)
    for p in range(P):
        merged[:, p, :, p] = blocks[:, p]
    return merged.reshape(Co, P * Cg, R, S)


def split_groups(weight, groups, P):
    """merge_groups undone: the [Co, Ci/groups, R, S] weight of the conv with `groups` groups."""
    Co, merged_channels, R, S = weight.shape
    merged = weight.reshape(groups // P, P, Co // groups, P, merged_channels // P, R, S)
    return torch.stack([merged[:, p, :, p] for p in range(P)], dim=1).reshape(Co, merged_channels // P, R, S)


class FusedConv2d(torch.nn.Module):
    """One operator call for conv [-> BatchNorm (folded)] [-> + residual] [-> ReLU or SiLU].

    forward(x) or forward(x, residual); x and residual NCHW-shaped (channels_last memory avoids
    copies). The weight keeps nn.Conv2d's [Co, Ci, R, S] shape in channels_last memory; `bias` is
    the fp32 shift (the conv's bias with the BatchNorm folded in). A grouped conv whose groups are
    too small for the kernel's tiles has `group_merge` groups merged into one (`merge_groups`); its
    weight then holds zeros that training must not move, so it takes no gradient."""

    def __init__(self, conv: torch.nn.Conv2d, bn: Optional[torch.nn.BatchNorm2d] = None,
                 activation: str = "none", takes_residual: bool = False):
        super().__init__()
        if conv.padding_mode != "zeros":
            raise ValueError(f"padding_mode={conv.padding_mode!r}: the kernel pads with zeros only")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        weight, bias = conv.weight, conv.bias
        if bn is not None:
            if bn.training or bn.running_mean is None:
                raise ValueError("only an eval-mode BatchNorm with running statistics can be folded")
            weight, bias = fold_batchnorm(weight, bias, bn)
        groups, self.group_merge = conv.groups, 1
        if groups > 1 and not is_depthwise(groups, conv.in_channels, conv.out_channels, weight.shape):
            self.group_merge = group_merge(groups, weight.shape[1], weight.shape[0] // groups) or 1
            if self.group_merge > 1:
                weight = merge_groups(weight.detach(), groups, self.group_merge)
        self.weight = torch.nn.Parameter(weight.detach().contiguous(memory_format=torch.channels_last),
                                         requires_grad=conv.weight.requires_grad and self.group_merge == 1)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.activation, self.takes_residual, self.folded_batchnorm = activation, takes_residual, bn is not None
        self.conv_repr = f"{conv.in_channels}, {conv.out_channels}, kernel_size={conv.kernel_size}, " \
                         f"stride={conv.stride}" + (f", groups={groups}" if groups > 1 else "") \
                         + (f" (merged {self.group_merge} by {self.group_merge})" if self.group_merge > 1 else "")
        pads = ops.resolve_padding(conv.padding, self.weight.shape, tuple(conv.stride), tuple(conv.dilation))
        if pads is None:
            raise ValueError(f"padding={conv.padding!r} needs asymmetric padding, which the kernel does not do")
        self._op_args = (list(conv.stride), list(pads), list(conv.dilation), groups // self.group_merge)

    def forward(self, x, residual=None):
        if (residual is not None) != self.takes_residual:
            raise ValueError(f"this FusedConv2d {'takes' if self.takes_residual else 'takes no'} residual")
        return conv2d_op(x, self.weight, self.bias, *self._op_args, residual=residual,
                         activation=self.activation)

    def extra_repr(self):
        parts = ["BatchNorm folded"] * self.folded_batchnorm + ["+ residual"] * self.takes_residual \
            + ([self.activation] if self.activation != "none" else [])
        return self.conv_repr + "".join(f", {p}" for p in parts)


def _single_user(node):
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _activation_of(node, modules):
    """'relu' or 'silu' if this fx node applies that activation to its one input, else None."""
    if node.op == "call_module":
        return ACTIVATION_MODULES.get(type(modules[node.target]))
    if node.op == "call_function" and node.target in ACTIVATION_FUNCTIONS and len(node.args) == 1:
        return ACTIVATION_FUNCTIONS[node.target]
    if node.op == "call_method" and node.target in ACTIVATION_METHODS and len(node.args) == 1:
        return ACTIVATION_METHODS[node.target]
    return None


def _residual_of(add, value, shapes):
    """The other operand of `add` if it is a plain sum of two same-shape tensors, else None."""
    if add.op != "call_function" or add.target not in ADD_FUNCTIONS or add.kwargs or len(add.args) != 2:
        return None
    other = add.args[1] if add.args[0] is value else add.args[0]
    if not isinstance(other, torch.fx.Node) or other is value:
        return None
    if shapes is None or shapes.get(other) != shapes.get(value):   # shapes unknown or broadcasting
        return None
    return other


def kernel_for(conv: torch.nn.Conv2d) -> Optional[str]:
    """Which of our kernels runs `conv`: "implicit-gemm" (lesson 05; a grouped conv too where
    `group_merge` finds groups that fill its tiles), "depthwise" (depthwise.py), or None."""
    if conv.groups == 1:
        return "implicit-gemm"
    if is_depthwise(conv.groups, conv.in_channels, conv.out_channels, conv.weight.shape):
        return "depthwise"
    if group_merge(conv.groups, conv.in_channels // conv.groups, conv.out_channels // conv.groups) is not None:
        return "implicit-gemm"
    return None


def install_module(graph_module, modules, prefix, target, module):
    """Add `module` to the graph module as prefix_<target with dots as underscores> (and to the
    `modules` dictionary a pass keeps); returns its name."""
    name = f"{prefix}_{target.replace('.', '_')}"
    graph_module.add_submodule(name, module)
    modules[name] = module
    return name


def fuse_conv_bn_act(model: torch.nn.Module, example_input: Optional[torch.Tensor] = None
                     ) -> torch.fx.GraphModule:
    """A torch.fx pass over any traceable model: every nn.Conv2d becomes a FusedConv2d that also
    does what follows it, matched on the graph (not on class names of blocks):
      conv -> BatchNorm2d (eval)  -> folded into the weights and shift
           -> + residual          -> fused when `example_input` is given, so that the shapes of
                                     both operands are known to match (no broadcasting)
           -> ReLU / SiLU         -> the epilogue's activation
    Each intermediate value must have no other user. BatchNorms in training mode are left alone.
    Depthwise convs go to depthwise.py (with the same epilogue), grouped ones to lesson 05's
    kernel where their groups fill its tiles. A conv none of our kernels runs (kernel_for) stays as it was, with its BatchNorm and activation as separate
    modules: the operator would send it to torch with the epilogue apart, slower than what
    torch.compile makes of conv -> BatchNorm -> activation, so the pass never makes a model slower;
    `kept_convs` on the result counts them (with one warning).
    Returns a new GraphModule; `model` is not changed."""
    graph_module = torch.fx.symbolic_trace(copy.deepcopy(model))   # shares no module with `model`
    modules = dict(graph_module.named_modules())
    shapes = None
    if example_input is not None:
        from torch.fx.passes.shape_prop import ShapeProp
        ShapeProp(graph_module).propagate(example_input)
        shapes = {n: (tuple(n.meta["tensor_meta"].shape), n.meta["tensor_meta"].dtype)
                  for n in graph_module.graph.nodes if hasattr(n.meta.get("tensor_meta"), "shape")}
    graph, removed, count, kept = graph_module.graph, set(), 0, 0
    for conv_node in list(graph.nodes):
        if conv_node in removed or conv_node.op != "call_module" \
                or not isinstance(modules[conv_node.target], torch.nn.Conv2d) \
                or modules[conv_node.target].padding_mode != "zeros":
            continue
        if kernel_for(modules[conv_node.target]) is None:   # no kernel of ours for it: left for torch
            kept += 1
            continue
        conv = modules[conv_node.target]
        chain, bn, residual, activation = [conv_node], None, None, "none"
        nxt = _single_user(chain[-1])
        if nxt is not None and nxt.op == "call_module" and isinstance(modules[nxt.target], torch.nn.BatchNorm2d) \
                and not modules[nxt.target].training and modules[nxt.target].running_mean is not None:
            bn = modules[nxt.target]
            chain.append(nxt)
            nxt = _single_user(nxt)
        if nxt is not None and (other := _residual_of(nxt, chain[-1], shapes)) is not None:
            residual = other
            chain.append(nxt)
            nxt = _single_user(nxt)
        if nxt is not None and (act := _activation_of(nxt, modules)) is not None:
            activation = act
            chain.append(nxt)
        try:
            fused = FusedConv2d(conv, bn, activation, residual is not None)
        except ValueError as error:
            warnings.warn(f"{conv_node.target}: {error}; left as it is")
            continue
        name = install_module(graph_module, modules, "fused", conv_node.target, fused)
        with graph.inserting_after(chain[-1]):
            new_node = graph.call_module(name, (conv_node.args[0],) + ((residual,) if residual is not None else ()))
        chain[-1].replace_all_uses_with(new_node)
        if shapes is not None:
            shapes[new_node] = shapes.get(chain[-1])
        for node in reversed(chain):
            graph.erase_node(node)
            removed.add(node)
        count += 1
    graph.lint()
    graph_module.delete_all_unused_submodules()
    graph_module.recompile()
    graph_module.fused_convs, graph_module.kept_convs = count, kept
    if kept:
        warnings.warn(f"fuse_conv_bn_act: {kept} grouped convs left as they were (conv, BatchNorm, activation "
                      f"apart, for torch.compile to fuse): no kernel of ours runs groups of their channels")
    return graph_module


class TorchConvEpilogue(torch.nn.Module):
    """A FusedConv2d's work done by torch: F.conv2d (cuDNN), then shift, residual and activation in
    fp32 as elementwise ops, which torch.compile fuses into one pass over the output. What
    keep_faster_convs puts back where torch measures faster. Same weights, same call signature."""

    def __init__(self, fused: FusedConv2d):
        super().__init__()
        self.weight, self.bias = fused.weight, fused.bias
        self.activation, self.takes_residual, self._op_args = fused.activation, fused.takes_residual, fused._op_args
        if fused.group_merge > 1:      # cuDNN runs the groups as they were, without the merge's zeros
            groups = fused._op_args[3] * fused.group_merge
            weight = split_groups(fused.weight.detach(), groups, fused.group_merge)
            self.weight = torch.nn.Parameter(weight.contiguous(memory_format=torch.channels_last), requires_grad=False)
            self._op_args = fused._op_args[:3] + (groups,)
        self.conv_repr = fused.conv_repr

    def forward(self, x, residual=None):
        out = torch.nn.functional.conv2d(x, self.weight, None, *self._op_args)
        if self.bias is None and residual is None and self.activation == "none":
            return out
        return reference_epilogue(out.float(), self.bias, None, None if residual is None else residual.float(),
                                  self.activation).to(out.dtype)

    def extra_repr(self):
        return self.conv_repr + f", torch, {self.activation}"


def module_calls(model, example_input, types):
    """(name, module, args) of every call of a submodule of `types` in one forward pass of
    `model` on example_input, in order (forward hooks, removed after)."""
    calls = []

    def record(name):
        def hook(module, args, out):      # (returns None: a forward hook's result would replace the output)
            calls.append((name, module, args))
        return hook
    hooks = [module.register_forward_hook(record(name))
             for name, module in model.named_modules() if isinstance(module, types)]
    try:
        with torch.no_grad():
            model(example_input)
    finally:
        for hook in hooks:
            hook.remove()
    return calls


def _graph_replay_ms(fn, budget_ms=4.0, replays=3):
    """A call's time replayed in a CUDA graph (kernels alone, as a captured model runs them): as
    many calls as fill about `budget_ms` captured back to back in one graph, the graph replayed
    `replays` times, the fastest replay's time per call. A decision needs a ranking, not a
    benchmark's figure: on an H100 ResNet-50's decisions at batch 128 took 1.8 s with this timer
    and 9.6 s with triton.testing.do_bench_cudagraph(rep=20) (ten 20-ms rounds per side), and
    came out the same (`python benchmarks/first_call.py --compare-timers`; RESULTS.md, "The first
    call of a fused model")."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()                                   # outside any capture: lazy set-up, first allocations

        def fastest_replay_ms(calls):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(calls):
                    fn()
            graph.replay()                     # the first replay uploads the graph
            best = float("inf")
            for _ in range(replays):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                graph.replay()
                end.record(stream)
                end.synchronize()
                best = min(best, start.elapsed_time(end))
            return best / calls

        estimate = fastest_replay_ms(1)
        calls = max(1, min(200, round(budget_ms / max(estimate, 1e-3))))
        return estimate if calls == 1 else fastest_replay_ms(calls)


def _decision_key(layer, x):
    """The tuning file's key of one keep_faster_convs decision: the layer (shapes, conv arguments,
    epilogue), its input's dtype and memory layout, the GPU and the versions whose speeds it compared."""
    layout = "channels_last" if x.is_contiguous(memory_format=torch.channels_last) else "contiguous"
    device = torch.cuda.get_device_name(x.device) if x.is_cuda else "cpu"
    return (f"keep_faster_convs | {device} | triton {triton.__version__} | "
            f"torch {torch.__version__} | {layer} | {str(x.dtype).replace('torch.', '')} {layout}")


def keep_faster_convs(fused_model: torch.fx.GraphModule, example_input: torch.Tensor, timer=None,
                      remember=None) -> torch.fx.GraphModule:
    """After fuse_conv_bn_act, on the model as it will run (dtype, device, the batch it will see):
    time each FusedConv2d at its real input against torch doing the same work, F.conv2d (cuDNN)
    plus, if there is a shift, residual or activation, one elementwise pass over the output (what
    torch.compile makes of them); where torch is faster, put a TorchConvEpilogue in its place.
    Small layers (SE blocks' 1x1 convs on pooled vectors, thin 1x1 convs at batch 1) are where
    cuDNN's lighter kernels win. `timer(fn) -> ms` defaults to a CUDA-graph replay; distinct
    layers are timed once. Changes `fused_model` in place and returns it; `torch_convs` on it
    counts the convs given back to torch.

    Without a CUDA GPU for the default timer (no GPU, or a model and input on the CPU, where every
    FusedConv2d already runs torch's conv), there is nothing to measure: the model comes back
    unchanged (`torch_convs` 0) with one warning.

    With the default timer (or `remember=True`) each decision is kept in the tuning file (selection.tuning_cache_path,
    with both times), keyed by the layer, its input, the GPU and the Triton and torch versions: a
    second process deploying the same model at the same batch reads them instead of timing again.
    Before timing, the model runs once inside `launch.compiling_ahead`, so that its distinct
    kernels compile side by side (not with a stand-in timer or with autotuning on). Where the
    first call's seconds go: `keep_faster_convs_seconds` on the model, and RESULTS.md, "The first
    call of a fused model"."""
    if timer is None:
        if not torch.cuda.is_available() or example_input.device.type != "cuda":
            where = "no CUDA GPU" if not torch.cuda.is_available() else f"the input on {example_input.device}"
            warnings.warn(f"keep_faster_convs: {where}, nothing to time (the operator runs torch's conv here); "
                          f"the model is returned unchanged")
            fused_model.torch_convs = 0
            return fused_model
        timer, remember = _graph_replay_ms, remember is not False
    remember = bool(remember)     # a stand-in timer's decisions are kept only when asked
    seconds, start = {}, time.perf_counter()
    if timer is _graph_replay_ms and not selection.autotune_enabled():
        # Every distinct kernel the model needs, compiled side by side before the first real call
        # (launch.compiling_ahead; the outputs of this forward are garbage). The autotuner compiles
        # its own candidates as it times them, so with autotuning on this step is left out.
        with launch.compiling_ahead(), torch.no_grad():
            fused_model(example_input)
        torch.cuda.synchronize()
    seconds["compile"] = time.perf_counter() - start
    start = time.perf_counter()
    calls = {}
    for name, module, args in module_calls(fused_model, example_input, FusedConv2d):
        calls.setdefault(name, (module, args))
    decided, given_back = {}, 0
    for name, (module, args) in calls.items():
        key = (tuple(args[0].shape), tuple(module.weight.shape), str(module._op_args), module.activation,
               module.takes_residual, module.bias is not None)
        file_key = _decision_key(key, args[0]) if remember else None
        saved = selection.remembered_decision(file_key) if remember else None
        if key not in decided and saved is not None:
            decided[key] = bool(saved["torch_faster"])
        if key not in decided:
            with torch.no_grad():
                ours_ms = timer(lambda: module(*args))
                conv = lambda: torch.nn.functional.conv2d(args[0], module.weight, None, *module._op_args)  # noqa: E731
                torch_ms = timer(conv)
                if module.bias is not None or module.takes_residual or module.activation != "none":
                    out = conv()
                    torch_ms += timer(lambda: torch.add(out, args[1]) if module.takes_residual else torch.relu(out))
            decided[key] = torch_ms < ours_ms
            if remember:
                selection.remember_decision(file_key, {"torch_faster": decided[key], "ours_ms": round(ours_ms, 5),
                                                       "torch_ms": round(torch_ms, 5)})
        if decided[key]:
            parent, _, attribute = name.rpartition(".")
            setattr(fused_model.get_submodule(parent), attribute, TorchConvEpilogue(module))
            given_back += 1
    fused_model.torch_convs = given_back
    seconds["decide"] = time.perf_counter() - start
    fused_model.keep_faster_convs_seconds = seconds     # where the time went: benchmarks/first_call.py
    return fused_model
