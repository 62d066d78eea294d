"""Tests of the operator's host runtime (conv_tutorial: configs, launch, selection, runtime) around lesson 05's kernel: config pruning (CPU), the
candidates' builds against the pruning model (CPU, ahead of time), and on a GPU the paths that
must not change results: the cached fast path, the direct launch, every Hopper candidate."""
import functools
import json

import common

import pytest
import torch

from conv_tutorial.kernels import fprop  # noqa: E402
from conv_tutorial import configs, runtime, selection
from conv_tutorial.core.windows import OutputWindow  # noqa: E402
from conv_tutorial import launch as plans  # noqa: E402
needs_hopper = pytest.mark.skipif(not (common.has_tma_mma_gpu() and common.is_hopper()),
                                  reason="needs a Hopper GPU (sm_90): ping-pong is its schedule")


def conv2d_fixed(x_nhwc, w, bias=None, stride=1, padding=0, dilation=1, config=configs.FIXED_CONFIG, **epilogue):
    """The runtime with one given config (no autotuning)."""
    return runtime.conv2d(x_nhwc, w, bias, stride, padding, dilation, config=tuple(config), **epilogue)

KernelConfig = fprop.KernelConfig
needs_gpu = pytest.mark.skipif(not common.has_tma_mma_gpu(), reason=common.GLUON_SKIP_REASON)


def test_pruning():
    geometry = common.conv_geometry((128, 56, 56, 64), (64, 3, 3, 64), 1, 1)
    kept = selection.prune_configs(configs.HOPPER_CANDIDATES, geometry, "sm_90")
    assert kept and all(config[1] <= 64 for config in kept)          # Co=64: no 128-wide tiles
    # (that each kept config's build fits is test_every_hopper_candidate_compiles_within_budget's)
    small = common.conv_geometry((1, 8, 8, 64), (256, 1, 1, 64))
    assert selection.prune_configs([(128, 256, 64, 4, 8, 1)], small, "sm_90") == []  # too much smem
    assert selection.prune_configs([(128, 256, 64, 3, 4, 1)], small, "sm_90") == []  # acc on 4 warps
    assert configs.block_k_channels(fprop.FIXED_CONFIG, 8, 2) == 16
    assert selection.prune_configs([(128, 64, 64, 4, 8, 2)], geometry, "sm_90") == []  # no registers
    # tails only where they cut the wasted columns: Co=320 keeps the 160-wide tiles, Co=384 does not
    tails = [c for c in configs.HOPPER_CANDIDATES if c.block_n_tail]
    sd = common.conv_geometry((8, 64, 64, 320), (320, 3, 3, 320), 1, 1)
    assert {c.tile_n for c in selection.prune_configs(tails, sd, "sm_90")} == {160}
    wide = common.conv_geometry((8, 64, 64, 384), (384, 3, 3, 384), 1, 1)
    assert selection.prune_configs(tails, wide, "sm_90") == []
    assert configs.wasted_columns(320, 128) == 64 and configs.wasted_columns(320, 160) == 0


def test_every_blackwell_candidate_is_a_valid_config():
    for config in configs.BLACKWELL_CANDIDATES:
        fprop.check_config(config, "sm_100")
    geometry = common.conv_geometry((8, 32, 32, 256), (256, 3, 3, 256), 1, 1)
    assert selection.prune_configs(configs.BLACKWELL_CANDIDATES, geometry, "sm_100")


def _shape_that_keeps(config):
    """(Ci, Co) of a small layer for which pruning keeps `config` (tails need a Co they save columns
    on, narrow K blocks a Ci they save zeros on)."""
    for Ci in (256, 160):
        for Co in (320, 96, 256, 192, 128, 64):
            geometry = common.conv_geometry((2, 16, 16, Ci), (Co, 3, 3, Ci), 1, 1)
            if selection.prune_configs([config], geometry, "sm_90"):
                return Ci, Co
    raise AssertionError(f"{config} is pruned for every test shape")


@pytest.mark.parametrize("config", configs.HOPPER_CANDIDATES, ids=str)
def test_every_hopper_candidate_compiles_within_budget(config):
    Ci, Co = _shape_that_keeps(config)
    compiled = common.aot_compile_or_skip("conv_tutorial.kernels.aot", "fprop_build", "sm_90",
                                          Ci=Ci, Co=Co, config=list(config),
                                          epilogue=[True, True, True, "relu"])   # the fullest epilogue
    assert compiled["shared"] <= selection.SMEM_LIMIT_BYTES["sm_90"]
    assert config.programs_per_sm * (compiled["shared"] + fprop.SHARED_MEMORY_RESERVED_PER_PROGRAM) \
        <= fprop.SHARED_MEMORY_PER_SM
    model = fprop.shared_memory_bytes(config)
    assert model <= compiled["shared"] <= model + fprop.BUILD_MARGIN_BYTES   # the model holds
    if config.programs_per_sm > 1:
        assert ".maxnreg 128" in compiled["ptx"]
    assert common.ptx_instructions(compiled["ptx"], ["wgmma.mma_async"])["wgmma.mma_async"] > 0


@pytest.mark.parametrize("config", configs.HOPPER_CANDIDATES, ids=str)
def test_register_model_of_the_residual_epilogue_matches_the_builds(config):
    """residual_fits_in_registers says which builds keep a residual tile beside their accumulators
    without spilling: checked against each candidate's build with the whole fused epilogue (the
    stack frame per thread, from cuobjdump: where a Triton kernel spills to)."""
    Ci, Co = _shape_that_keeps(config)
    compiled = common.aot_compile_or_skip("conv_tutorial.kernels.aot", "fprop_build", "sm_90",
                                          Ci=Ci, Co=Co, config=list(config), epilogue=[True, True, True, "relu"])
    assert compiled["stack"] is not None
    assert configs.residual_fits_in_registers(config) == (compiled["stack"] == 0), compiled["stack"]


@pytest.mark.parametrize("config", [c for c in configs.HOPPER_CANDIDATES if c.block_m_tail], ids=str)
def test_a_row_tail_with_a_residual_runs_on_8_warps(config):
    """A row tail has no room for a residual tile on 4-warp consumers; the runtime runs the same
    tile on one 8-warp consumer, which has. Other configs are left as tuned."""
    moved = configs.fitted_to_epilogue(config, has_residual=True)
    assert (moved.tile_m, moved.tile_n, moved.num_warps, moved.consumers) == (192, 128, 8, 1)
    assert configs.residual_fits_in_registers(moved)
    assert configs.shared_memory_bytes(moved) <= selection.SMEM_LIMIT_BYTES["sm_90"]
    assert configs.fitted_to_epilogue(config, has_residual=False) == config
    KernelConfig = runtime.KernelConfig
    wide = KernelConfig(128, 256, 64, 3, 8)        # spills a little with a residual; kept (measured faster)
    assert configs.fitted_to_epilogue(wide, has_residual=True) == wide


@pytest.mark.parametrize("config", [fprop.FIXED_CONFIG, KernelConfig(128, 128, 64, 4, 4, block_n_tail=32),
                                    KernelConfig(128, 128, 64, 6, 8, split_k=3)], ids=str)
def test_a_plans_template_holds_no_tensors(config):
    """A plan keeps the first call's launch as a template, without its tensors: else each plan
    (every layer of a network, every candidate the autotuner tried) would keep an input and an
    output alive. The template's descriptors still describe the same boxes."""
    x_nhwc, w = common.random_conv_inputs(2, 8, 8, 64, 160, 3, 3, torch.bfloat16, device_name="cpu")
    geometry = common.conv_geometry(x_nhwc.shape, w.shape, 1, 1)
    bias = torch.zeros(160)
    launch = fprop.prepare_launch(x_nhwc, w, bias, geometry, config, "sm_90", 132)
    template = plans._tensorless(launch)
    names = fprop.DESCRIPTORS
    descriptors = [getattr(template, name) for name in names if getattr(template, name) is not None]
    assert descriptors and all(d.base is None for d in descriptors)
    assert template.pointers is None                 # the epilogue's pointers
    assert template.shape == launch.shape
    assert template.out_2d.is_meta and template.out_2d.shape == launch.out_2d.shape
    assert (template.partial is None) == (config.split_k == 1)
    if template.partial is not None:
        assert template.partial.is_meta and template.partial.shape == launch.partial.shape
    for original, stripped in ((getattr(launch, name), getattr(template, name)) for name in names):
        if original is None:
            assert stripped is None
            continue
        copy = plans._with_base(stripped, original.base)
        assert (copy.base is original.base and list(copy.shape) == list(original.shape)
                and list(copy.strides) == list(original.strides) and copy.block_shape == original.block_shape)


@needs_gpu
def test_a_plan_does_not_keep_its_first_calls_tensors():
    import gc
    import weakref
    config = KernelConfig(128, 64, 64, 3, 4)        # a plan of its own, made by this test
    gc.collect()
    in_use = torch.cuda.memory_allocated()
    x_nhwc, w = common.random_conv_inputs(2, 12, 12, 64, 96, 3, 3, torch.bfloat16)
    out = runtime.conv2d(x_nhwc, w, None, 1, 1, config=config)           # builds the plan
    again = runtime.conv2d(x_nhwc, w, None, 1, 1, config=config)         # the direct launch
    torch.testing.assert_close(again, out)
    first_input = weakref.ref(x_nhwc)
    del x_nhwc, w, out, again
    gc.collect()
    assert first_input() is None
    assert torch.cuda.memory_allocated() == in_use


@needs_gpu
def test_fast_path_still_checks_each_call():
    # A call with a cached plan skips the full validation; what a same-shaped tensor can still get
    # wrong (layout, alignment) must be caught on every call.
    x_nhwc, w = common.random_conv_inputs(2, 12, 12, 64, 96, 3, 3, torch.bfloat16)
    conv2d_fixed(x_nhwc, w, padding=1)
    not_contiguous = x_nhwc.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(ValueError, match="contiguous NHWC"):
        conv2d_fixed(not_contiguous, w, padding=1)
    storage = torch.empty(x_nhwc.numel() + 1, dtype=x_nhwc.dtype, device=x_nhwc.device)
    misaligned = storage[1:].view(x_nhwc.shape)       # contiguous, same shape, 2 bytes off
    with pytest.raises(ValueError, match="16-byte aligned"):
        conv2d_fixed(misaligned, w, padding=1)
    # list-valued hyper-parameters are unhashable: they take the slow path and still work
    common.check_conv(conv2d_fixed, 2, 12, 12, 64, 96, 3, 3, [1, 1], [1, 1])


@needs_gpu
def test_direct_launch_path_on_new_data():
    # The second call of a plan skips Triton's generic launcher: it must see the new tensors.
    for seed in (1, 2, 3):
        common.check_conv(conv2d_fixed, 2, 12, 12, 64, 96, 3, 3, 1, 1,
                          with_bias=seed != 2, seed=seed)


@needs_gpu
def test_direct_launch_remembers_tensor_maps_by_address(monkeypatch):
    # Later calls pass tensors, not descriptors: each (descriptor, address) is encoded once. Two
    # inputs taking turns, and an input rewritten in place, must each give their own result; a
    # known address is not encoded again, a new one is.
    x_a, w = common.random_conv_inputs(2, 12, 12, 64, 96, 3, 3, torch.bfloat16, seed=4)
    x_b = torch.randn_like(x_a)

    def check(x):
        common.assert_close_to_reference(conv2d_fixed(x, w, padding=1),
                                         common.reference_conv2d_nhwc(x, w, None, 1, 1), dtype=x.dtype, K=576)
    for x in (x_a, x_b, x_a, x_b):
        check(x)
    geometry = common.conv_geometry(x_a.shape, w.shape, 1, 1)
    direct = plans.plan_for(geometry, x_a.dtype, fprop.FIXED_CONFIG).replays[("none", None, None, None)].direct
    encoded = []
    encode = direct.encode
    monkeypatch.setattr(direct, "encode", lambda descriptor, *rest: encoded.append(descriptor.base.data_ptr())
                        or encode(descriptor, *rest))
    x_a.mul_(-2)                                      # same address, new contents
    check(x_a)
    assert x_a.data_ptr() not in encoded and w.data_ptr() not in encoded
    x_c = x_a.clone()                                 # a new address: encoded once
    check(x_c)
    assert encoded.count(x_c.data_ptr()) == 1


@needs_hopper
def test_every_hopper_candidate_is_correct():
    for config in configs.HOPPER_CANDIDATES:
        common.check_conv(functools.partial(conv2d_fixed, config=config),
                          4, 20, 20, 136, 200, 3, 3, 1, 1, with_bias=True)


def window_case(N=2, H=13, W=11, Ci=64, Co=200, step=(2, 3), crop=(1, 2), dtype=torch.bfloat16, seed=0):
    """(x, w, its reference output, a larger NaN tensor, an OutputWindow into every step-th row and
    column of it, the reference's part that window must receive) for a 3x3 conv at padding 1."""
    x_nhwc, w = common.random_conv_inputs(N, H, W, Ci, Co, 3, 3, dtype, seed=seed)
    expected = common.reference_conv2d_nhwc(x_nhwc, w, None, 1, 1)
    rows, cols = H - crop[0] - 1, W - crop[1]
    larger = torch.full((N, rows * step[0] + 1, cols * step[1], Co), float("nan"), dtype=dtype, device=x_nhwc.device)
    window = OutputWindow(larger[:, 1::step[0], ::step[1]][:, :rows, :cols], *crop)
    return x_nhwc, w, larger, window, expected[:, crop[0]:crop[0] + rows, crop[1]:crop[1] + cols]


@needs_hopper
@pytest.mark.parametrize("config", [c for c in configs.HOPPER_CANDIDATES if c.split_k == 1], ids=str)
def test_every_hopper_candidate_stores_into_a_window(config):
    """Lesson 06's dgrad phases: the output stored pixel by pixel into a strided, cropped window
    of a larger tensor, through every candidate's epilogue (tails, row blocks, ping-pong), twice
    (Triton's launcher, then the direct launch, on new data); nothing outside the window written."""
    for seed in (0, 1):
        x_nhwc, w, larger, window, expected = window_case(seed=seed)
        out = runtime.conv2d(x_nhwc, w, None, 1, 1, config=tuple(config), out_window=window)
        assert out is window.view
        common.assert_close_to_reference(out, expected, dtype=x_nhwc.dtype, K=64 * 9)
        outside = torch.ones_like(larger, dtype=torch.bool)
        outside[:, 1::2, ::3][:, :window.view.shape[1], :window.view.shape[2]] = False
        assert larger[outside].isnan().all()


@needs_gpu
def test_a_window_and_a_whole_output_share_a_plan():
    """The same plan stores into a window and into an output of its own, in either order (each keeps
    its own template: a window's out_2d is a one-row stand-in); a split-K config takes a copy."""
    x_nhwc, w, _, window, expected = window_case()
    dense = common.reference_conv2d_nhwc(x_nhwc, w, None, 1, 1)

    def windowed(config):
        window.view.fill_(float("nan"))
        got = runtime.conv2d(x_nhwc, w, None, 1, 1, config=tuple(config), out_window=window)
        common.assert_close_to_reference(got, expected, dtype=x_nhwc.dtype, K=64 * 9)

    def whole(config):
        common.assert_close_to_reference(runtime.conv2d(x_nhwc, w, None, 1, 1, config=tuple(config)), dense,
                                         dtype=x_nhwc.dtype, K=64 * 9)
    # plans of their own (configs no other test uses), each met first with a window or first without
    for config, order in ((KernelConfig(128, 64, 64, 5, 4), (windowed, whole)),
                          (KernelConfig(64, 128, 64, 5, 4), (whole, windowed)),
                          (KernelConfig(128, 128, 64, 4, 4, split_k=2), (windowed, whole))):
        for _ in range(2):
            for call in order:
                call(config)
    with pytest.raises(ValueError, match="out_window crops"):
        runtime.conv2d(x_nhwc, w, None, 1, 1, out_window=window._replace(crop_h=5))


def _stand_in_tuner(monkeypatch, tmp_path, plan_class, do_bench):
    """The autotuner without a GPU: a tuning file in tmp_path, an sm_90 device of 132 SMs, plans
    of `plan_class`, timings from `do_bench`."""
    monkeypatch.setenv("CONV_TUTORIAL_TUNING_CACHE", str(tmp_path / "tuning.json"))
    monkeypatch.setattr(selection, "_TUNING_FILE", None)
    monkeypatch.setattr(selection, "_BEST_CONFIG", {})
    monkeypatch.setattr(selection, "device_facts", lambda: ("sm_90", 132, 232448))
    monkeypatch.setattr(selection, "plan_for", lambda g, d, c, out_dtype=None: plan_class(c))
    def do_bench_with_quantiles(fn, quantiles=None, **kwargs):   # several quantiles: a list, as do_bench
        ms = do_bench(fn, quantiles=quantiles, **kwargs)
        return [ms] * len(quantiles) if quantiles is not None and len(quantiles) > 1 else ms
    monkeypatch.setattr(selection.triton.testing, "do_bench", do_bench_with_quantiles)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "a test GPU")


def test_autotune_keeps_the_fastest_and_later_processes_reuse_it(monkeypatch, tmp_path, capsys):
    # The tuner's logic and its tuning file, without a GPU: plans and timings are stand-ins whose
    # "kernel time" is a table, so the choice is known in advance.
    geometry = common.conv_geometry((128, 14, 14, 1024), (256, 1, 1, 1024), 1, 0)
    candidates = selection.prune_configs(configs.HOPPER_CANDIDATES, geometry, "sm_90")
    fastest = candidates[len(candidates) // 2]
    kernel_ms = {c: (0.05 if c == fastest else 0.08 + 0.001 * i) for i, c in enumerate(candidates)}

    class TimedPlan:
        last = None

        def __init__(self, config):
            self.config = config

        def run(self, *args, **epilogue):
            TimedPlan.last = self.config

    def do_bench(fn, quantiles=None, **kwargs):
        fn()
        return kernel_ms[TimedPlan.last]      # do_bench returns a float for one quantile too

    _stand_in_tuner(monkeypatch, tmp_path, TimedPlan, do_bench)
    x = torch.empty(0, dtype=torch.bfloat16)
    assert selection.tuned_config(geometry, x, x, None, verbose=True) == fastest
    assert "<- chosen" in capsys.readouterr().out
    saved = selection.tuning_cache_path().read_text()
    assert str(list(fastest)).replace(" ", "") in saved.replace(" ", "").replace("\n", "")
    # A later process: nothing in memory, the file on disk; no timing may happen.
    monkeypatch.setattr(selection, "_TUNING_FILE", None)
    monkeypatch.setattr(selection, "_BEST_CONFIG", {})
    monkeypatch.setattr(selection.triton.testing, "do_bench", lambda *a, **k: pytest.fail("timed again"))
    assert selection.known_or_heuristic_config(geometry, torch.bfloat16) == fastest
    assert selection.tuned_config(geometry, x, x, None) == fastest
    # Without a tuning file the heuristic answers at once, with a config that fits the device.
    monkeypatch.setenv("CONV_TUTORIAL_TUNING_CACHE", str(tmp_path / "elsewhere.json"))
    monkeypatch.setattr(selection, "_TUNING_FILE", None)
    monkeypatch.setattr(selection, "_BEST_CONFIG", {})
    assert selection.known_or_heuristic_config(geometry, torch.bfloat16) in candidates


def test_autotune_times_with_the_epilogue_and_keeps_a_choice_per_epilogue(monkeypatch, tmp_path):
    # The residual's loads and registers change which config is fastest: a call with a residual
    # is tuned with it (each candidate fitted as the runtime runs it), its choice is kept under its
    # own key beside the plain conv's, and without a tuned choice of its own the plain one is
    # used, fitted. Stand-in plans and timings, as above.
    geometry = common.conv_geometry((128, 14, 14, 1024), (512, 1, 1, 1024), 1, 0)
    candidates = selection.prune_configs(configs.HOPPER_CANDIDATES, geometry, "sm_90")
    row_tail = next(c for c in candidates if c.block_m_tail and c.num_warps == 4)
    plain_fastest, residual_fastest = row_tail, candidates[0]
    assert plain_fastest != residual_fastest
    seen = []

    class TimedPlan:
        last = None

        def __init__(self, config):
            self.config = config

        def run(self, x, w, bias, scale=None, residual=None, activation="none"):
            seen.append((self.config, residual is not None, activation))
            TimedPlan.last = (self.config, residual is not None)

    def do_bench(fn, quantiles=None, **kwargs):
        fn()
        config, with_residual = TimedPlan.last
        fastest = residual_fastest if with_residual else plain_fastest
        return 0.05 if config == fastest else 0.09

    _stand_in_tuner(monkeypatch, tmp_path, TimedPlan, do_bench)
    x = torch.empty(0, dtype=torch.bfloat16)
    assert selection.tuned_config(geometry, x, x, None) == plain_fastest
    assert all(not with_residual for _, with_residual, _ in seen)
    # the plain choice, fitted, is what a residual call gets before it is tuned
    fitted = configs.fitted_to_epilogue(plain_fastest, True)
    assert fitted != plain_fastest
    tag = selection.epilogue_tag(scale=x, residual=x, activation="relu")
    assert tag == "scale+residual+relu"
    assert selection.known_or_heuristic_config(geometry, torch.bfloat16, tag) == fitted
    seen.clear()
    assert selection.tuned_config(geometry, x, x, None, scale=x, residual=x, activation="relu") == residual_fastest
    assert seen and all(with_residual and activation == "relu" for _, with_residual, activation in seen)
    assert row_tail not in {config for config, _, _ in seen}     # timed as it would run: fitted
    assert fitted in {config for config, _, _ in seen}
    # both choices on disk, each under its own key; a later process reads each back untimed
    saved = json.loads(selection.tuning_cache_path().read_text())
    assert sorted(key.endswith("| epilogue scale+residual+relu") for key in saved) == [False, True]
    monkeypatch.setattr(selection, "_TUNING_FILE", None)
    monkeypatch.setattr(selection, "_BEST_CONFIG", {})
    monkeypatch.setattr(selection.triton.testing, "do_bench", lambda *a, **k: pytest.fail("timed again"))
    assert selection.known_or_heuristic_config(geometry, torch.bfloat16, tag) == residual_fastest
    assert selection.known_or_heuristic_config(geometry, torch.bfloat16) == plain_fastest
    # a bias alone is a plain conv to the tuner
    assert selection.epilogue_tag() == ""


@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding, dilation", [
    (2, 32, 30, 3, 64, 7, 7, 2, 3, 1),          # a ResNet stem: 21 folded channels, padded to 24
    (1, 17, 23, 4, 24, 3, 5, (2, 1), (1, 2), 1),
    (3, 12, 11, 1, 8, 3, 3, 1, 2, 2),            # dilation 2 along W: the copy is a gather
])
def test_folding_filter_columns_into_channels_keeps_the_convolution(N, H, W, Ci, Co, R, S, stride,
                                                                     padding, dilation):
    """The folded R x 1 conv over S*Ci channels (the fold: a Triton kernel, in the interpreter on a
    CPU) equals the original; both convolutions computed by torch in fp32."""
    torch.manual_seed(0)
    x_nhwc, w = torch.randn(N, H, W, Ci).to(common.device()), torch.randn(Co, R, S, Ci).to(common.device())
    geometry = common.conv_geometry(x_nhwc.shape, w.shape, stride, padding, dilation)
    fold = runtime.folded_geometry(geometry)
    assert fold is not None and fold.geometry.S == 1 and fold.geometry.Ci % 8 == 0
    assert (fold.geometry.out_h, fold.geometry.out_w, fold.geometry.M) == (geometry.out_h, geometry.out_w, geometry.M)
    x_fold, w_fold = fold.apply(x_nhwc, w)
    assert x_fold.shape == (N, H, geometry.out_w, fold.geometry.Ci) and w_fold.shape == (Co, R, 1, fold.geometry.Ci)
    g = fold.geometry
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):     # exact fp32 on a GPU too
        folded = torch.nn.functional.conv2d(x_fold.permute(0, 3, 1, 2), w_fold.permute(0, 3, 1, 2), None,
                                            g.stride, g.padding, g.dilation)
        expected = common.reference_conv2d_nhwc(x_nhwc, w, None, stride, padding, dilation)
    torch.testing.assert_close(folded.permute(0, 2, 3, 1), expected, rtol=1e-4, atol=1e-4)


def test_only_small_channel_counts_are_folded():
    wide = common.conv_geometry((2, 16, 16, 64), (64, 3, 3, 64), 1, 1)
    one_by_one = common.conv_geometry((2, 16, 16, 3), (64, 1, 1, 3), 1, 0)
    assert runtime.folded_geometry(wide) is None and runtime.folded_geometry(one_by_one) is None


# %% The tuner is never slower than the heuristic ------------------------------------------------

def test_tuner_keeps_the_heuristic_where_it_measures_fastest():
    # Stand-in timers: the first pass ranks the heuristic's config 5th of 6 (a noisy brief run),
    # the benchmark's timing measures it fastest. It must be a finalist, and it must win.
    configs_ = [configs.KernelConfig(*c) for c in configs.CANDIDATES["sm_90"][:6]]
    heuristic = configs_[4]
    first_pass = {c: 1.0 + 0.1 * i for i, c in enumerate(configs_)}
    benchmark = {c: 2.0 - 0.05 * i for i, c in enumerate(configs_)}
    benchmark[heuristic] = 0.9
    timed = []
    best, medians = selection.choose_among(first_pass, heuristic, lambda c: timed.append(c) or benchmark[c])
    assert best == heuristic and set(medians) == set(configs_[:3]) | {heuristic}
    assert len(timed) == 4 * selection.FINAL_ROUNDS                   # each finalist once per round
    assert timed[:4] == configs_[:3] + [heuristic]                    # alternating rounds


def test_tuner_takes_a_faster_config_and_the_heuristic_on_a_tie():
    configs_ = [configs.KernelConfig(*c) for c in configs.CANDIDATES["sm_90"][:4]]
    heuristic = configs_[0]
    first_pass = {c: 1.0 for c in configs_}
    rounds = iter([1.0, 0.8, 1.5] * 2 + [1.0, 0.7, 1.5])   # 3 finalists per round; configs_[1]: median 0.8
    best, medians = selection.choose_among(first_pass, heuristic, lambda c: next(rounds))
    assert best == configs_[1] and medians[configs_[1]] == 0.8 and medians[heuristic] == 1.0
    best, _ = selection.choose_among(first_pass, heuristic, lambda c: 1.0)    # a tie: the heuristic
    assert best == heuristic


def test_tuning_file_keeps_both_figures_and_a_version(tmp_path, monkeypatch):
    monkeypatch.setenv("CONV_TUTORIAL_TUNING_CACHE", str(tmp_path / "tuning.json"))
    monkeypatch.setattr(selection, "_TUNING_FILE", None)
    monkeypatch.setattr(selection, "_tuning_file_key", lambda geometry, dtype, tag="": f"GPU | {geometry} | {tag}")
    tuned, heuristic = (configs.KernelConfig(*c) for c in configs.CANDIDATES["sm_90"][:2])
    selection._save_tuning("shape", torch.bfloat16, tuned, 612.34, "relu", heuristic, 501.0)
    entry = json.loads((tmp_path / "tuning.json").read_text())["GPU | shape | relu"]
    assert entry == {"config": list(tuned), "tflops": 612.3, "heuristic_config": list(heuristic),
                     "heuristic_tflops": 501.0, "version": selection.TUNING_FILE_VERSION}


@needs_gpu
@pytest.mark.parametrize("N, H, W, Ci, Co, R, S, stride, padding", [
    (64, 33, 47, 67, 100, 3, 3, 1, 1),             # an earlier tuner: 0.50x cuDNN, the heuristic 0.81x
    (32, 224, 224, 3, 64, 4, 4, 4, 0),             # the 4x4 stride-4 stem with Ci=3 (folded)
])
def test_autotune_is_never_slower_than_the_heuristic_on_the_gpu(N, H, W, Ci, Co, R, S, stride, padding):
    x = torch.randn(N, H, W, Ci, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(Co, R, S, Ci, device="cuda", dtype=torch.bfloat16) / (R * S * Ci) ** 0.5
    _, run_geometry, x, w = runtime.run_operands(common.conv_geometry(x.shape, w.shape, stride, padding), x, w)
    best, tflops, heuristic, heuristic_tflops = selection.autotune(run_geometry, x, w, None, details=True)
    assert heuristic_tflops is not None and tflops >= heuristic_tflops


class RecordedDriverLaunch:
    """What DirectLaunch hands the driver's launch, recorded instead of launched (a CPU check of its
    argument layout; the GPU tests run the real one)."""

    def __init__(self):
        self.calls = []

    def __call__(self, grid_x, grid_y, grid_z, stream, *rest):
        self.calls.append(((grid_x, grid_y, grid_z), stream, rest))


class TemplateDescriptor:
    """A stand-in for a validated descriptor: DirectLaunch copies it and swaps its base."""

    def __init__(self):
        self.base, self.shape, self.strides = None, [4, 8], [8, 1]


def direct_launch_on_a_cpu(descriptor_positions=(), constexprs=(256,)):
    """A DirectLaunch whose compiled kernel, driver and encoder are stand-ins."""
    direct = object.__new__(plans.DirectLaunch)
    templates = [TemplateDescriptor() for _ in descriptor_positions]
    encoded = []
    direct.constexprs, direct.tensor_maps, direct.lean = constexprs, {}, True
    direct.encode = lambda descriptor, meta, _: encoded.append(descriptor.base.data_ptr()) or [
        f"map of {descriptor.base.data_ptr():#x}", *descriptor.shape, *descriptor.strides]
    direct.current_device, direct.current_stream = (lambda: 0), (lambda device: "stream")
    direct.descriptor_at = dict(zip(descriptor_positions, (("meta", t) for t in templates)))
    direct.descriptors_end = max(descriptor_positions, default=-1) + 1
    direct.launch, direct.launch_head, direct.launch_tail = RecordedDriverLaunch(), ("function",), ("annotations",)
    return direct, encoded


@pytest.mark.parametrize("grid, expected", [((5,), (5, 1, 1)), ((5, 3), (5, 3, 1)), ((5, 3, 2), (5, 3, 2))])
def test_direct_launch_takes_a_grid_of_one_to_three_counts(grid, expected):
    """Triton takes a grid of 1-3 counts (lesson 06's kernels launch on 1-D grids): the driver gets three."""
    direct, _ = direct_launch_on_a_cpu()
    direct(grid, 0x1000, 7)
    (launched_grid, stream, rest), = direct.launch.calls
    assert launched_grid == expected and stream == "stream" and rest[-1] == [0x1000, 7, 256]


def test_direct_launch_expands_descriptors_and_encodes_an_address_once():
    """A descriptor argument becomes [tensor map, *shape, *strides] (Triton's expansion), the map
    encoded once per address; other arguments and then the constexprs follow in order."""
    direct, encoded = direct_launch_on_a_cpu(descriptor_positions=(0, 2))
    a, b, c = (torch.empty(32, dtype=torch.float16) for _ in range(3))
    direct((1,), a, 0x2000, b, ("shape",))
    direct((1,), a, 0x2000, c, ("shape",))
    first, second = (call[2][-1] for call in direct.launch.calls)
    map_of = lambda t: f"map of {t.data_ptr():#x}"      # noqa: E731
    assert first == [map_of(a), 4, 8, 8, 1, 0x2000, map_of(b), 4, 8, 8, 1, ("shape",), 256]
    assert second[6] == map_of(c) and encoded == [a.data_ptr(), b.data_ptr(), c.data_ptr()]
