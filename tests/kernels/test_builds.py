"""How many builds the package's kernels take: the split-K sum one for every count, the depthwise kernel one for
every batch and image size. Worked out in child processes where Triton is not the interpreter (conftest's
`run_without_interpreter`), as on a GPU; no GPU needed."""

# What keys a launch's build: the specialization aot.compile_source gives it for sm_90 (its constants and
# its arguments' alignment attributes).
BUILD_KEY = ("from conv_tutorial.kernels import aot\n"
             "def build_key(kernel, args, kwargs):\n"
             "    src, _, _ = aot.compile_source(kernel, args, kwargs, 'sm_90')\n"
             "    return repr((src.constants, src.attrs))\n")


def test_the_split_k_sum_compiles_once_for_every_count(run_without_interpreter):
    """The split-K sum kernel's specialization (what keys its compiles) depends on its tile, dtypes and the
    alignment of Co and Ci_group alone: layers that differ in their counts (taps, tiles, slices; 1, a multiple
    of 16, or neither) share one build, and a Ci_group that breaks 16-element vectors gets its own."""
    code = (BUILD_KEY + "import torch\n"
            "from conv_tutorial.kernels import wgrad\n"
            "partial, dw = torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16)\n"
            "def specialization(Co, Ci_group, *counts):\n"
            "    return build_key(wgrad.wgrad_split_k_sum_kernel, (partial, dw, Co, Ci_group, *counts),\n"
            "                     dict(BLOCK_M=128, BLOCK_N=128, BLOCK=256))\n"
            # (Co, Ci_group, then taps, num_pid_m, ci_blocks, whole_tiles, split_tiles, split_k)
            "layers = [(256, 64, 9, 2, 1, 0, 16, 2), (512, 128, 1, 1, 3, 132, 7, 11), (64, 64, 1, 16, 32, 48, 1, 3)]\n"
            "print('builds', len({specialization(*layer) for layer in layers}),\n"
            "      specialization(256, 24, 9, 2, 1, 0, 16, 2) != specialization(*layers[0]))\n")
    proc = run_without_interpreter(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "builds 1 True" in proc.stdout, proc.stdout


def test_the_depthwise_kernel_builds_once_for_every_batch_and_image_size(run_without_interpreter):
    """The depthwise kernel's specialization depends on its channels, filter, strides, dilations, blocks and
    epilogue, not on the batch or image size: a batch of 1 and one of 128, 224x224 and 7x9 images share a build."""
    code = (BUILD_KEY + "import torch\n"
            "from conv_tutorial import depthwise\n"
            "def specialization(N, H, W, stride, padding):\n"
            "    C, R = 32, 3\n"
            "    x, w = torch.zeros(N, H, W, C, dtype=torch.bfloat16), torch.zeros(C, R, R, dtype=torch.bfloat16)\n"
            "    out_h, out_w = (H + 2 * padding - R) // stride + 1, (W + 2 * padding - R) // stride + 1\n"
            "    out = torch.zeros(N, out_h, out_w, C, dtype=torch.bfloat16)\n"
            "    args = (x, w, out, out, out, out, N, H, W, out_h, out_w, stride, stride, padding, padding, 1, 1)\n"
            "    kwargs = dict(C=C, R=R, S=R, BLOCK_P=128, BLOCK_C=32, EPILOGUE=depthwise.fprop.Epilogue())\n"
            "    return build_key(depthwise.depthwise_conv2d_kernel, args, kwargs)\n"
            "sizes = [(1, 224, 224, 1, 1), (128, 7, 9, 1, 1), (16, 16, 16, 1, 0), (3, 33, 17, 1, 1)]\n"
            "print('builds', len({specialization(*size) for size in sizes}),\n"
            "      specialization(1, 224, 224, 2, 1) != specialization(*sizes[0]))\n")
    proc = run_without_interpreter(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "builds 1 True" in proc.stdout, proc.stdout      # (a stride of 2 is another build: it stays specialized)
