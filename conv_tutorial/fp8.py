"""fp8 (e4m3) for whole models: a torch.fx pass that quantizes what `fuse_conv_bn_act` fused.

    import conv_tutorial
    fused = conv_tutorial.fuse_conv_bn_act(model.eval(), example_input=x)      # bf16, channels_last
    fp8_model = conv_tutorial.quantize_fp8(fused, calibration_batches)           # a new GraphModule

Lesson 05, section 9 runs the kernel on e4m3 operands; `ops.conv2d_fp8` is its operator.
This pass decides, for every fused conv of a model, whether it runs in e4m3 and in which format
its output leaves, and where scales come from:

- Weights: per output channel, amax mapped to 448 (`geometry.quantize_tensor(w, channel_dim=0)`), after
  the BatchNorm is folded into them: a folded BatchNorm scales each output channel differently,
  which a per-tensor weight scale would spend e4m3's 3 mantissa bits on.
- Activations: one scale per tensor, from calibration: the largest |value| each tensor takes
  over a few batches (forward hooks on the bf16 model), mapped to 448. Values past it in later
  inputs saturate at 448 (the kernel's cast saturates).
- What stays bf16, and why:
  * the stem, any conv with fewer than 16 input channels (an image's 3): its K of R*S*Ci is too
    short for the tensor cores to be its limit (lesson 05 folds it, section 8), so fp8 gains
    nothing there; and it sees the raw image, whose quantization error every later layer inherits;
  * the classifier: a Linear, which this pass does not touch (nor pooling): the first and last
    layers are where low precision costs the most accuracy, for the least time;
  * grouped and depthwise convs (the kernel runs grouped convs in fp16/bf16 only; one merged into a plain
    conv, groups=1, runs in fp8), and convs kept as they were.
- Output formats: an e4m3 conv writes e4m3, so activations go from one conv to the next in e4m3
  and nothing converts them in between, unless a bf16 conv reads its output (converting it there
  would be one more pass over memory). A residual must arrive in the consuming conv's output
  format at its output scale (section 9), so the convs of one residual chain (a ResNet stage's
  block outputs and its downsample) share one output scale (the largest amax of the chain) and
  one format: one member that must write bf16 turns the whole chain to bf16.
- Conversions: where an e4m3 conv reads a bf16 tensor (after the stem's max-pool) a
  `QuantizeFp8` module converts it once; where something that is not a conv reads an e4m3 output
  (the pooling before the classifier), a `DequantizeFp8` module. torch.compile fuses both into
  the op next to them.
"""
import warnings

import torch

from . import ops
from .fusion import FusedConv2d
from .geometry import FP8, FP8_MAX, quantize_tensor

MIN_CHANNELS = 16      # fewer input channels: the stem, which stays bf16 (see above)


class QuantizeFp8(torch.nn.Module):
    """x -> e4m3 at a fixed per-tensor scale (from calibration): round(x / scale), saturated at 448."""

    def __init__(self, scale, device=None):
        super().__init__()
        self.register_buffer("scale", torch.tensor(float(scale), dtype=torch.float32, device=device))

    def forward(self, x):
        return (x.float() / self.scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)

    def extra_repr(self):
        return f"scale={self.scale.item():.3g}"


class DequantizeFp8(torch.nn.Module):
    """e4m3 at a per-tensor scale -> `dtype` (bf16), for what reads an e4m3 conv's output and is not
    a conv (pooling, a concatenation, the model's output); torch.compile fuses it into that op."""

    def __init__(self, scale, dtype=torch.bfloat16, device=None):
        super().__init__()
        self.register_buffer("scale", torch.tensor(float(scale), dtype=torch.float32, device=device))
        self.dtype = dtype

    def forward(self, x_q):
        return (x_q.float() * self.scale).to(self.dtype)


class FusedConv2dFp8(torch.nn.Module):
    """A FusedConv2d (conv, folded BatchNorm, residual, activation) on e4m3 operands: the weight
    quantized per output channel, the input arriving in e4m3 at `input_scale`, the output in bf16
    or, given `out_scale`, in e4m3. forward(x_q) or forward(x_q, residual)."""

    def __init__(self, fused: FusedConv2d, input_scale, out_scale=None):
        super().__init__()
        weight_q, weight_scale = quantize_tensor(fused.weight.detach(), channel_dim=0)
        self.register_buffer("weight_q", weight_q.contiguous(memory_format=torch.channels_last))
        self.register_buffer("weight_scale", weight_scale.contiguous())
        bias = fused.bias.detach().float() if fused.bias is not None else torch.zeros_like(weight_scale)
        self.register_buffer("bias", bias)
        scalar = lambda value: torch.tensor(float(value), dtype=torch.float32, device=weight_q.device)  # noqa: E731
        self.register_buffer("input_scale", scalar(input_scale))
        self.register_buffer("out_scale", None if out_scale is None else scalar(out_scale))
        self.activation, self.takes_residual, self.conv_repr = fused.activation, fused.takes_residual, fused.conv_repr
        self.out_dtype = FP8 if out_scale is not None else torch.bfloat16
        self._op_args = fused._op_args[:3]           # stride, padding, dilation (groups is 1)

    def forward(self, x_q, residual=None):
        if (residual is not None) != self.takes_residual:
            raise ValueError(f"this FusedConv2dFp8 {'takes' if self.takes_residual else 'takes no'} residual")
        return ops.conv2d_fp8_op(x_q, self.input_scale, self.weight_q, self.weight_scale, self.bias,
                                        *self._op_args, residual, self.activation, self.out_dtype, self.out_scale)

    def extra_repr(self):
        out = "e4m3 out" if self.out_scale is not None else "bf16 out"
        return (f"{self.conv_repr}, e4m3 in, {out}" + ", + residual" * self.takes_residual
                + (f", {self.activation}" if self.activation != "none" else ""))


def runs_in_fp8(fused: FusedConv2d) -> bool:
    """The rule of what may run in e4m3 (the module docstring says why the rest stays bf16)."""
    groups = fused._op_args[3]
    return groups == 1 and fused.weight.shape[1] >= MIN_CHANNELS


def calibrate(model, calibration_batches, modules):
    """{name: (input amax, output amax)} of the named modules over the batches (forward hooks)."""
    amax = {name: [0.0, 0.0] for name in modules}
    def hook(name):                                                      # noqa: E306
        def record(module, inputs, output):
            amax[name][0] = max(amax[name][0], inputs[0].detach().abs().amax().item())
            amax[name][1] = max(amax[name][1], output.detach().abs().amax().item())
        return record
    handles = [model.get_submodule(name).register_forward_hook(hook(name)) for name in modules]
    try:
        with torch.no_grad():
            for batch in calibration_batches:
                model(batch)
    finally:
        for handle in handles:
            handle.remove()
    return amax


def _scale_of(amax):
    return max(amax, torch.finfo(torch.float32).tiny) / FP8_MAX


def quantize_fp8(fused_model: torch.fx.GraphModule, calibration_batches) -> torch.fx.GraphModule:
    """The e4m3 version of a model that `fusion.fuse_conv_bn_act` made, calibrated on
    `calibration_batches` (an iterable of inputs, e.g. a few batches of real data). Returns a new
    GraphModule whose eligible FusedConv2d calls became FusedConv2dFp8 calls; `fused_model` is not
    changed. `fp8_convs` and `bf16_convs` on the result count them."""
    if not isinstance(fused_model, torch.fx.GraphModule):
        raise TypeError(f"fused_model must be the torch.fx.GraphModule of fusion.fuse_conv_bn_act, "
                        f"got {type(fused_model).__name__}")
    modules = dict(fused_model.named_modules())
    conv_nodes = [n for n in fused_model.graph.nodes
                  if n.op == "call_module" and isinstance(modules[n.target], FusedConv2d)]
    fp8 = {n for n in conv_nodes if runs_in_fp8(modules[n.target])}
    amax = calibrate(fused_model, calibration_batches, [n.target for n in fp8])

    def residual_of(n):
        return n.args[1] if len(n.args) > 1 else None

    # Output formats: e4m3 unless a bf16 conv reads the output or a residual partner writes bf16;
    # one bf16 member turns its whole residual chain to bf16, so iterate until nothing changes.
    def bf16_conv(n):
        return n.op == "call_module" and n not in fp8 \
            and isinstance(modules[n.target], (torch.nn.Conv2d, FusedConv2d))
    writes_fp8 = set(fp8)
    changed = True
    while changed:
        changed = False
        for n in list(writes_fp8):
            partners = [u for u in n.users if residual_of(u) is n] + ([residual_of(n)] if residual_of(n) else [])
            if any(bf16_conv(u) for u in n.users) or any(p not in writes_fp8 for p in partners):
                writes_fp8.discard(n)
                changed = True
    # Residual chains share one output scale: group the e4m3 writers along residual edges.
    chain = {n: n for n in writes_fp8}
    def root(n):                                                         # noqa: E306
        while chain[n] is not n:
            n = chain[n]
        return n
    for n in writes_fp8:
        if residual_of(n) is not None:
            chain[root(n)] = root(residual_of(n))
    chain_amax = {}
    for n in writes_fp8:
        chain_amax[root(n)] = max(chain_amax.get(root(n), 0.0), amax[n.target][1])
    out_scale = {n: _scale_of(chain_amax[root(n)]) for n in writes_fp8}

    graph, new_node = torch.fx.Graph(), {}            # a copy of the graph, to rewrite
    graph.output(graph.graph_copy(fused_model.graph, new_node))
    graph_module = torch.fx.GraphModule(fused_model, graph)
    quantized_inputs = {}
    for old in conv_nodes:
        if old not in fp8:
            continue
        node, module = new_node[old], modules[old.target]
        source = node.args[0]
        if old.args[0] in writes_fp8:
            input_scale = out_scale[old.args[0]]
        else:                       # a bf16 tensor: one QuantizeFp8 per tensor, shared by its e4m3 readers
            readers = [u for u in old.args[0].users if u in fp8 and u.args[0] is old.args[0]]
            input_scale = _scale_of(max(amax[u.target][0] for u in readers))
            if source not in quantized_inputs:
                name = f"quantize_{source.name}"
                graph_module.add_submodule(name, QuantizeFp8(input_scale, module.weight.device))
                with graph.inserting_after(source):
                    quantized_inputs[source] = graph.call_module(name, (source,))
            node.args = (quantized_inputs[source],) + node.args[1:]
        name = f"{old.target}_fp8"
        graph_module.add_submodule(name, FusedConv2dFp8(module, input_scale, out_scale.get(old)))
        node.target = name
        not_convs = [u for u in node.users  # (the e4m3 convs among the users still have their old names)
                     if not (u.op == "call_module" and isinstance(modules.get(u.target), FusedConv2d))]
        if old in writes_fp8 and not_convs:          # they read a bf16 copy
            name = f"dequantize_{node.name}"
            graph_module.add_submodule(name, DequantizeFp8(out_scale[old], module.weight.dtype, module.weight.device))
            with graph.inserting_after(node):
                dequantized = graph.call_module(name, (node,))
            for user in not_convs:
                user.replace_input_with(node, dequantized)
    graph.lint()
    graph_module.delete_all_unused_submodules()
    graph_module.recompile()
    graph_module.fp8_convs, graph_module.bf16_convs = len(fp8), len(conv_nodes) - len(fp8)
    if not fp8:
        warnings.warn("quantize_fp8: no conv of this model can run in e4m3 (see conv_tutorial.fp8.runs_in_fp8)")
    return graph_module
