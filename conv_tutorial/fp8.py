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
  would be one more pass over memory).
- Residual chains (a ResNet stage's block outputs and its downsample): the kernel takes the
  residual in the output's format at the output's scale (section 9), so members that pass a
  residual on share a scale or convert the residual between them. Sharing one scale across a whole
  chain (the largest amax of the chain) fails on deep stages: over ResNet-101's 23 blocks the
  activations grow block by block, and at the last block's scale the early blocks' values fall
  below e4m3's smallest step (2^-9 of the scale) and become zero. Two ways out: give every member
  its own scale and fold the residual's scale ratio into the epilogue as one more per-tensor
  factor (a change to the kernel, which takes its residual at the output's scale), or split a
  chain into segments whose amaxes lie within `max_chain_range` of each other (16 by default: e4m3's
  normal range spans 2^15, so the smallest member's bulk, a few octaves below its amax, keeps
  e4m3's 3 mantissa bits) and convert the residual once where it crosses a segment's boundary
  (`RequantizeFp8`: e4m3 at one scale to e4m3 at the next, one pass over a 1-byte tensor). This
  pass splits: the kernel stays as lesson 05 teaches it, a ResNet-50 stage (amaxes within a few
  times of each other) stays one segment with no conversion, as before, and a deep stage pays one
  small conversion per boundary (a handful per stage) instead of losing its early blocks.
  A residual that arrives in bf16 (or fp32) where the member writes e4m3 (a block whose residual is
  the max-pool's output, ResNet-34's first) is quantized at the member's scale (`QuantizeFp8`);
  an e4m3 residual into a member that writes bf16 is dequantized (`DequantizeFp8`).
- Conversions: where an e4m3 conv reads a bf16 tensor (after the stem's max-pool) a
  `QuantizeFp8` module converts it once; where something that is not a conv reads an e4m3 output
  (the pooling before the classifier), a `DequantizeFp8` module. torch.compile fuses both into
  the op next to them.
- Scales are positive and finite: an all-zero calibration tensor gets scale 1 (its zeros are
  exact at any scale), a calibration batch that makes inf or NaN is an error naming the layer.
- The pass checks itself, on the calibration batches: (1) layer by layer, each e4m3 conv is run on
  the bf16 model's own input to that layer (quantized as the e4m3 model would see it) and compared
  with the bf16 layer's output: a relative RMS error above `layer_tolerance` (0.125 by default,
  twice e4m3's largest rounding of a single value: 2^-4; a healthy layer measures 0.02-0.05) keeps
  that layer in bf16, and one warning names the layers kept; (2) the whole model: the max error of
  its outputs over their largest magnitude, against the model as given; above `model_tolerance`
  (0.15) a warning, or with `strict=True` an error. The figures stay on the result
  (`layer_errors`, `output_error`, `kept_bf16`).
- Model dtype: the pass takes a bf16 or an fp32 fused model (an fp32 one is the reference a user
  checks against); what leaves e4m3 for the rest of the model leaves in the model's dtype.
"""
import math
import warnings

import torch
import torch.utils._pytree as pytree

from . import ops
from .fusion import FusedConv2d
from .geometry import FP8, FP8_MAX, quantize_tensor

MIN_CHANNELS = 16      # fewer input channels: the stem, which stays bf16 (see above)
MAX_CHAIN_RANGE = 16.0  # the largest ratio of amaxes within one segment of a residual chain
LAYER_TOLERANCE = 0.125  # a layer's relative RMS error past which it stays bf16
MODEL_TOLERANCE = 0.15   # the outputs' max error over their largest magnitude past which the user hears it


def _scalar(value, device):
    return torch.tensor(float(value), dtype=torch.float32, device=device)


def to_fp8(x, scale):
    """x in e4m3 at a per-tensor scale: round(x / scale), saturated at 448 (as the kernel's cast)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)



def _run_with_hooks(model, hooks, batches):
    """Run `model` on each batch (no grad) with forward hooks {submodule name: hook}, removed after."""
    handles = [model.get_submodule(name).register_forward_hook(hook) for name, hook in hooks.items()]
    try:
        with torch.no_grad():
            for batch in batches:
                model(batch)
    finally:
        for handle in handles:
            handle.remove()

class QuantizeFp8(torch.nn.Module):
    """x -> e4m3 at a fixed per-tensor scale (from calibration): round(x / scale), saturated at 448."""

    def __init__(self, scale, device=None):
        super().__init__()
        self.register_buffer("scale", _scalar(scale, device))

    def forward(self, x):
        return to_fp8(x, self.scale)

    def extra_repr(self):
        return f"scale={self.scale.item():.3g}"


class DequantizeFp8(torch.nn.Module):
    """e4m3 at a per-tensor scale -> `dtype` (bf16), for what reads an e4m3 conv's output and is not
    a conv (pooling, a concatenation, the model's output); torch.compile fuses it into that op."""

    def __init__(self, scale, dtype=torch.bfloat16, device=None):
        super().__init__()
        self.register_buffer("scale", _scalar(scale, device))
        self.dtype = dtype

    def forward(self, x_q):
        return (x_q.float() * self.scale).to(self.dtype)


class RequantizeFp8(torch.nn.Module):
    """e4m3 at `from_scale` -> e4m3 at `to_scale`: a residual crossing from one segment of a chain
    into the next (saturated at 448, as the kernel's cast)."""

    def __init__(self, from_scale, to_scale, device=None):
        super().__init__()
        self.register_buffer("ratio", _scalar(from_scale / to_scale, device))

    def forward(self, x_q):
        return (x_q.float() * self.ratio).clamp(-FP8_MAX, FP8_MAX).to(FP8)

    def extra_repr(self):
        return f"ratio={self.ratio.item():.3g}"


class FusedConv2dFp8(torch.nn.Module):
    """A FusedConv2d (conv, folded BatchNorm, residual, activation) on e4m3 operands: the weight
    quantized per output channel, the input arriving in e4m3 at `input_scale`, the output in bf16
    or, given `out_scale`, in e4m3. forward(x_q) or forward(x_q, residual). In a model of another
    dtype than bf16 (fp32), a bf16 output is cast to it and a residual for a bf16 output to bf16."""

    def __init__(self, fused: FusedConv2d, input_scale, out_scale=None):
        super().__init__()
        weight_q, weight_scale = quantize_tensor(fused.weight.detach(), channel_dim=0)
        self.register_buffer("weight_q", weight_q.contiguous(memory_format=torch.channels_last))
        self.register_buffer("weight_scale", weight_scale.contiguous())
        bias = fused.bias.detach().float() if fused.bias is not None else torch.zeros_like(weight_scale)
        self.register_buffer("bias", bias)
        self.register_buffer("input_scale", _scalar(input_scale, weight_q.device))
        self.register_buffer("out_scale", None if out_scale is None else _scalar(out_scale, weight_q.device))
        self.activation, self.takes_residual, self.conv_repr = fused.activation, fused.takes_residual, fused.conv_repr
        self.out_dtype = FP8 if out_scale is not None else torch.bfloat16
        self.model_dtype = fused.weight.dtype
        self._op_args = fused._op_args[:3]           # stride, padding, dilation (groups is 1)

    def forward(self, x_q, residual=None):
        if (residual is not None) != self.takes_residual:
            raise ValueError(f"this FusedConv2dFp8 {'takes' if self.takes_residual else 'takes no'} residual")
        if residual is not None and self.out_dtype != FP8 and residual.dtype != torch.bfloat16:
            residual = residual.to(torch.bfloat16)
        out = ops.call_conv2d_fp8(x_q, self.input_scale, self.weight_q, self.weight_scale, self.bias,
                                *self._op_args, residual, self.activation, self.out_dtype, self.out_scale)
        return out if self.out_dtype == FP8 or self.model_dtype == torch.bfloat16 else out.to(self.model_dtype)

    def dequantized(self, out):
        """An output of forward() as real values in fp32."""
        return out.float() * self.out_scale if self.out_dtype == FP8 else out.float()

    def extra_repr(self):
        out = "e4m3 out" if self.out_scale is not None else "bf16 out"
        return (f"{self.conv_repr}, e4m3 in, {out}" + ", + residual" * self.takes_residual
                + (f", {self.activation}" if self.activation != "none" else ""))


def runs_in_fp8(fused: FusedConv2d) -> bool:
    """The rule of what may run in e4m3 (the module docstring says why the rest stays bf16)."""
    groups = fused._op_args[3]
    return groups == 1 and fused.weight.shape[1] >= MIN_CHANNELS


def calibrate(model, calibration_batches, modules):
    """{name: (input amax, output amax)} of the named modules over the batches (forward hooks).
    ValueError where a layer's input or output holds inf or NaN: no scale represents them."""
    amax = {name: [0.0, 0.0] for name in modules}
    def hook(name):                                                      # noqa: E306
        def record(module, inputs, output):
            for slot, (what, tensor) in enumerate((("input", inputs[0]), ("output", output))):
                value = tensor.detach().abs().amax().item()
                if not math.isfinite(value):
                    raise ValueError(f"quantize_fp8: calibration made inf or NaN in the {what} of {name}; "
                                     f"e4m3 has no scale for it")
                amax[name][slot] = max(amax[name][slot], value)
        return record
    _run_with_hooks(model, {name: hook(name) for name in modules}, calibration_batches)
    return amax


def _scale_of(amax):
    """The scale that maps amax to 448: positive and finite for any finite amax (0 gets scale 1:
    its zeros are exact at any scale; the smallest normal fp32 bounds it below, so 1/scale is finite)."""
    if not math.isfinite(amax) or amax < 0:
        raise ValueError(f"an amax must be finite and non-negative, got {amax}")
    return max(amax / FP8_MAX if amax > 0 else 1.0, torch.finfo(torch.float32).tiny)


def _residual_of(n):
    return n.args[1] if len(n.args) > 1 else None


class _Plan:
    """What runs in e4m3 and at which scales, for a set `fp8` of conv nodes (see the module docstring)."""

    def __init__(self, fp8, conv_nodes, modules, amax, max_chain_range):
        self.fp8 = fp8
        def bf16_conv(n):                                                # noqa: E306
            return n.op == "call_module" and n not in fp8 \
                and isinstance(modules[n.target], (torch.nn.Conv2d, FusedConv2d))
        # e4m3 output unless a conv that runs in bf16 reads it (as input or residual)
        self.writes_fp8 = {n for n in fp8 if not any(bf16_conv(u) for u in n.users)}
        # residual chains, split into segments whose output amaxes lie within max_chain_range
        segment, members = {}, {}
        for n in conv_nodes:                                   # graph order: a residual comes first
            if n not in self.writes_fp8:
                continue
            r, out_amax = _residual_of(n), amax[n.target][1]
            if r in self.writes_fp8:
                joined = [amax[m.target][1] for m in members[segment[r]]] + [out_amax]
                if min(joined) > 0 and max(joined) <= max_chain_range * min(joined):
                    segment[n] = segment[r]
                    members[segment[n]].append(n)
                    continue
            segment[n], members[n] = n, [n]
        self.segments = list(members.values())
        self.out_scale = {n: _scale_of(max(amax[m.target][1] for m in members[segment[n]])) for n in self.writes_fp8}
        # input scales: the writer's output scale, or one per bf16 tensor shared by its e4m3 readers
        self.input_scale = {}
        for n in fp8:
            source = n.args[0]
            if source in self.writes_fp8:
                self.input_scale[n] = self.out_scale[source]
            else:
                readers = [u for u in source.users if u in fp8 and u.args[0] is source]
                self.input_scale[n] = _scale_of(max(amax[u.target][0] for u in readers))

    def residual_conversion(self, n, device):
        """The module that brings member n's residual to the format and scale n's output takes, or None."""
        r = _residual_of(n)
        if r is None:
            return None
        have = self.out_scale.get(r)                                 # None: a bf16 / fp32 tensor
        want = self.out_scale.get(n)                                 # None: n writes bf16
        if have is not None and want is not None:
            return None if have == want else RequantizeFp8(have, want, device)
        if have is not None:
            return DequantizeFp8(have, torch.bfloat16, device)
        return QuantizeFp8(want, device) if want is not None else None

    def module(self, n, fused):
        return FusedConv2dFp8(fused, self.input_scale[n], self.out_scale.get(n))


def _build(fused_model, conv_nodes, modules, plan):
    """A copy of fused_model's graph with plan.fp8's convs in e4m3 and the conversions they need."""
    graph, new_node = torch.fx.Graph(), {}
    graph.output(graph.graph_copy(fused_model.graph, new_node))
    graph_module = torch.fx.GraphModule(fused_model, graph)
    quantized_inputs = {}
    for old in conv_nodes:
        if old not in plan.fp8:
            continue
        node, module = new_node[old], modules[old.target]
        source = node.args[0]
        if old.args[0] not in plan.writes_fp8:     # a bf16 tensor: one QuantizeFp8 per tensor, shared by its readers
            if source not in quantized_inputs:
                name = f"quantize_{source.name}"
                graph_module.add_submodule(name, QuantizeFp8(plan.input_scale[old], module.weight.device))
                with graph.inserting_after(source):
                    quantized_inputs[source] = graph.call_module(name, (source,))
            node.args = (quantized_inputs[source],) + node.args[1:]
        conversion = plan.residual_conversion(old, module.weight.device)
        if conversion is not None:
            name = f"residual_of_{node.name}"
            graph_module.add_submodule(name, conversion)
            with graph.inserting_before(node):
                node.args = (node.args[0], graph.call_module(name, (node.args[1],))) + node.args[2:]
        name = f"{old.target}_fp8"
        graph_module.add_submodule(name, plan.module(old, module))
        node.target = name
        not_convs = [u for u in node.users  # (the e4m3 convs among the users still have their old names)
                     if not (u.op == "call_module" and isinstance(modules.get(u.target), FusedConv2d))]
        if old in plan.writes_fp8 and not_convs:          # they read a copy in the model's dtype
            name = f"dequantize_{node.name}"
            graph_module.add_submodule(name, DequantizeFp8(plan.out_scale[old], module.weight.dtype,
                                                           module.weight.device))
            with graph.inserting_after(node):
                dequantized = graph.call_module(name, (node,))
            for user in not_convs:
                user.replace_input_with(node, dequantized)
    graph.lint()
    graph_module.delete_all_unused_submodules()
    graph_module.recompile()
    return graph_module


def layer_errors(fused_model, batches, plan, modules):
    """{conv node: relative RMS error} of each e4m3 conv of `plan` against its bf16 layer, over the
    batches: the layer runs on the bf16 model's own input (and residual), quantized as the e4m3 model
    would receive them, so each layer answers for its own quantization only."""
    fp8_modules = {n.target: (n, plan.module(n, modules[n.target])) for n in plan.fp8}
    sums = {n: [0.0, 0.0] for n in plan.fp8}
    def hook(name):                                                      # noqa: E306
        def compare(module, inputs, output):
            node, fp8_module = fp8_modules[name]
            x_q = to_fp8(inputs[0], fp8_module.input_scale)
            residual = inputs[1] if len(inputs) > 1 else None
            if residual is not None and fp8_module.out_dtype == FP8:
                residual = to_fp8(residual, fp8_module.out_scale)
            got, expected = fp8_module.dequantized(fp8_module(x_q, residual)), output.float()
            sums[node][0] += (got - expected).square().sum().item()
            sums[node][1] += expected.square().sum().item()
        return compare
    _run_with_hooks(fused_model, {name: hook(name) for name in fp8_modules}, batches)
    return {n: (math.sqrt(err / ref) if ref > 0 else (0.0 if err == 0 else math.inf)) for n, (err, ref) in sums.items()}


def output_error(model, reference_model, batches):
    """max |model - reference| / max |reference| over every floating output tensor and batch (the
    figure RESULTS.md quotes for logits)."""
    largest_error, largest_value = 0.0, 0.0
    with torch.no_grad():
        for batch in batches:
            got, expected = pytree.tree_leaves(model(batch)), pytree.tree_leaves(reference_model(batch))
            for a, b in zip(got, expected):
                if isinstance(b, torch.Tensor) and b.is_floating_point():
                    largest_error = max(largest_error, (a.float() - b.float()).abs().max().item())
                    largest_value = max(largest_value, b.float().abs().max().item())
    return largest_error / largest_value if largest_value > 0 else (0.0 if largest_error == 0 else math.inf)


def quantize_fp8(fused_model: torch.fx.GraphModule, calibration_batches, *, max_chain_range=MAX_CHAIN_RANGE,
                 layer_tolerance=LAYER_TOLERANCE, model_tolerance=MODEL_TOLERANCE, strict=False
                 ) -> torch.fx.GraphModule:
    """The e4m3 version of a model that `fusion.fuse_conv_bn_act` made (bf16 or fp32), calibrated
    on `calibration_batches` (a few batches of real inputs; read three times: calibration, the
    layer check, the model check). Returns a new GraphModule whose eligible FusedConv2d calls
    became FusedConv2dFp8 calls; `fused_model` is not changed.

    `max_chain_range`: the largest ratio of output amaxes that one segment of a residual chain
    spans (module docstring). `layer_tolerance`: a conv whose relative RMS error against its bf16
    layer passes it stays bf16 (one warning names them). `model_tolerance`: past this max error of
    the outputs over their largest magnitude (against `fused_model`, on the calibration batches),
    a warning, or with `strict=True` a RuntimeError. On the result: `fp8_convs` and `bf16_convs`
    (counts), `kept_bf16` (the convs the layer check kept in bf16), `layer_errors` ({conv: error})
    and `output_error`."""
    if not isinstance(fused_model, torch.fx.GraphModule):
        raise TypeError(f"fused_model must be the torch.fx.GraphModule of fusion.fuse_conv_bn_act, "
                        f"got {type(fused_model).__name__}")
    for name, value in (("max_chain_range", max_chain_range), ("layer_tolerance", layer_tolerance),
                        ("model_tolerance", model_tolerance)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    if max_chain_range < 1:
        raise ValueError(f"max_chain_range must be at least 1 (a ratio of amaxes), got {max_chain_range!r}")
    batches = list(calibration_batches)
    if not batches:
        raise ValueError("calibration_batches is empty: the pass needs at least one batch for its scales")
    modules = dict(fused_model.named_modules())
    conv_nodes = [n for n in fused_model.graph.nodes
                  if n.op == "call_module" and isinstance(modules[n.target], FusedConv2d)]
    dtypes = {modules[n.target].weight.dtype for n in conv_nodes}
    if not dtypes <= {torch.bfloat16, torch.float32}:
        raise TypeError(f"quantize_fp8 takes a bf16 or fp32 model, got convs in {sorted(map(str, dtypes))}")
    fp8 = {n for n in conv_nodes if runs_in_fp8(modules[n.target])}
    amax = calibrate(fused_model, batches, [n.target for n in fp8])

    plan = _Plan(fp8, conv_nodes, modules, amax, max_chain_range)
    errors = layer_errors(fused_model, batches, plan, modules) if fp8 else {}
    kept = sorted((n for n in fp8 if errors[n] > layer_tolerance), key=conv_nodes.index)
    if kept:
        plan = _Plan(fp8 - set(kept), conv_nodes, modules, amax, max_chain_range)
        warnings.warn(f"quantize_fp8: {len(kept)} convs stay bf16, their e4m3 error (relative RMS against the bf16 "
                      f"layer) past layer_tolerance={layer_tolerance}: "
                      + ", ".join(f"{n.target} ({errors[n]:.3g})" for n in kept))
    graph_module = _build(fused_model, conv_nodes, modules, plan)
    graph_module.fp8_convs, graph_module.bf16_convs = len(plan.fp8), len(conv_nodes) - len(plan.fp8)
    graph_module.kept_bf16 = [n.target for n in kept]
    graph_module.layer_errors = {n.target: error for n, error in errors.items()}
    if not plan.fp8:
        warnings.warn("quantize_fp8: no conv of this model can run in e4m3 (see conv_tutorial.fp8.runs_in_fp8)")
    graph_module.output_error = output_error(graph_module, fused_model, batches)
    if graph_module.output_error > model_tolerance:
        message = (f"quantize_fp8: the e4m3 model's outputs differ from the model's by {graph_module.output_error:.3g} "
                   f"of their largest magnitude on the calibration batches, past model_tolerance={model_tolerance}")
        if strict:
            raise RuntimeError(message)
        warnings.warn(message)
    return graph_module
