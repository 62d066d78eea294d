"""The lessons' kit, beside common.py: drawings that teach nothing about the GPU, used by lesson 03.

Lesson 03 draws the access window of a TMA im2col load. Every picture draws the walk of the
lesson's reference model (`im2col_walk`), so picture and model agree; the lesson passes its own
module in, so this kit never loads a lesson. Tested by tests/lessons/test_03_figures.py."""
import itertools
import textwrap

import common


def draw_access(ax, x_shape, positions, lower, upper, offsets, n=0, values=None):
    """Draw image n of x_shape, the access window, the padding it covers and the load order."""
    import matplotlib.patches as patches
    _, H, W, _ = x_shape
    win_top, win_left = lower[0] + offsets[0], lower[1] + offsets[1]
    win_bottom, win_right = H - 1 + upper[0] + offsets[0], W - 1 + upper[1] + offsets[1]
    shifted = tuple(offsets) != (0, 0)      # then also draw where the window was before the offsets
    top, left = min(0, win_top, lower[0] if shifted else 0), min(0, win_left, lower[1] if shifted else 0)
    bottom, right = max(H - 1, win_bottom), max(W - 1, win_right)
    for h, w in itertools.product(range(top, bottom + 1), range(left, right + 1)):
        in_window = win_top <= h <= win_bottom and win_left <= w <= win_right
        if 0 <= h < H and 0 <= w < W:
            ax.add_patch(patches.Rectangle((w - 0.5, h - 0.5), 1, 1, facecolor="white",
                                           edgecolor="black", lw=0.8))
            if values is not None:
                ax.text(w, h - 0.22, str(values(n, h, w)), ha="center", va="center",
                        fontsize=8, color="#555555")
        elif in_window:
            ax.add_patch(patches.Rectangle((w - 0.5, h - 0.5), 1, 1, facecolor="#e4e4e4",
                                           edgecolor="#999999", hatch="//", lw=0.6))
    height, width = win_bottom - win_top + 1, win_right - win_left + 1
    ax.add_patch(patches.Rectangle((win_left - 0.5, win_top - 0.5), width, height, fill=False,
                                   edgecolor="red", lw=2, ls="--"))
    if shifted:     # the window the corners alone give, and the offsets' shift to the red one
        ax.add_patch(patches.Rectangle((lower[1] - 0.5, lower[0] - 0.5), width, height, fill=False,
                                       edgecolor="#888888", lw=1.5, ls=":"))
        ax.annotate("", xy=(win_left - 0.45, win_top - 0.45), xytext=(lower[1] - 0.45, lower[0] - 0.45),
                    arrowprops=dict(arrowstyle="->", color="#444444", lw=1.5))
    for order, (pn, ph, pw) in enumerate(positions):
        if pn != n:
            continue
        padded = not (0 <= ph < H and 0 <= pw < W)
        ax.add_patch(patches.Circle((pw, ph + 0.15), 0.27, color="#808080" if padded else "#1f5fbf"))
        ax.text(pw, ph + 0.15, str(order), ha="center", va="center", fontsize=7, color="white",
                fontweight="bold")
    ax.set_xlim(left - 0.6, right + 0.6)
    ax.set_ylim(bottom + 0.6, top - 0.6)
    ax.set_aspect("equal")
    ax.set_xticks(range(left, right + 1))
    ax.set_yticks(range(top, bottom + 1))
    ax.set_xlabel("w (column)")
    ax.set_ylabel("h (row)")


def plot_example(lesson, name, outdir):
    """Example `name` of `lesson` (lesson 03's module: its examples and reference model), one figure;
    a multi-batch example's images are stacked, so it stays as wide (and as legible) as a one-image
    example."""
    spec = lesson.EXAMPLES[name]
    x_nhwc = lesson.pixel_index_tensor(spec["N"])
    settings = (spec["lower"], spec["upper"], [1, 1, 1, 1], spec["coord"], spec["offsets"])
    _, sources = lesson.im2col_reference(x_nhwc, 16, 32, *settings)
    positions = lesson.im2col_walk(x_nhwc.shape, 16, *settings)
    fig, axes = common.new_figure(spec["N"], 1, figsize=(6.0, 4.6 * spec["N"] + 1.4), squeeze=False,
                                  layout="constrained")
    for n in range(spec["N"]):
        draw_access(axes[n][0], x_nhwc.shape, positions, spec["lower"], spec["upper"], spec["offsets"],
                    n=n, values=lambda n, h, w: n * 16 + h * 4 + w + 1)
        axes[n][0].set_title(f"image n={n}", fontsize=10)
    legend = ("red dashed = access window"
              + (", grey dotted = the window before the offsets shift it" if tuple(spec["offsets"]) != (0, 0) else "")
              + ", hatched = padding (filled with 0), circles = loaded pixels in load order")
    title = [f"TMA im2col example '{name}'",
             f"corners {spec['lower']}/{spec['upper']}, coord {spec['coord']}, offsets {spec['offsets']}",
             lesson.EXAMPLE_NOTES[name], legend]
    fig.suptitle("\n".join(textwrap.fill(line, 70) for line in title), fontsize=10)
    return common.save_figure(fig, outdir, "03_example_" + name.replace(" ", "_").replace("-", "_"),
                              {"example": name, **spec,
                               "sources": [s if s != lesson.PADDING else "padding" for s in sources]})


def plot_conv_k_loop(lesson, outdir, H=5, W=6, R=3, S=3, padding=1, block_pixels=16):
    """One M-tile of a 3x3 conv, walked by `lesson`'s reference model: the same window, shifted by
    each tap's offsets."""
    geometry = common.conv_geometry((1, H, W, 4), (1, R, S, 4), 1, padding)
    settings = common.conv_im2col_settings(geometry)
    fig, axes = common.new_figure(R, S, figsize=(3.4 * S, 3.3 * R + 1.2), squeeze=False,
                                  layout="constrained")
    for r, s in itertools.product(range(R), range(S)):
        offsets = settings.tap_offsets(r, s)
        positions = lesson.im2col_walk((1, H, W, 4), block_pixels, settings.pixel_box_lower_corner,
                                       settings.pixel_box_upper_corner, settings.element_strides,
                                       settings.start_coord(0), offsets)
        ax = axes[r][s]
        draw_access(ax, (1, H, W, 4), positions, settings.pixel_box_lower_corner,
                    settings.pixel_box_upper_corner, offsets)
        ax.set_title(f"tap (r={r}, s={s}): offsets {offsets}", fontsize=13)
        # The page shows this 9-panel figure at about 70% of its drawn size: large print, axis
        # names on the outer panels only.
        ax.tick_params(labelsize=11)
        ax.set_xlabel("w (column)" if r == R - 1 else "", fontsize=12)
        ax.set_ylabel("h (row)" if s == 0 else "", fontsize=12)
    fig.suptitle(f"One tile of A ({block_pixels} output pixels) for a {R}x{S} conv, pad {padding}, "
                 f"on a {H}x{W} image: one TMA im2col load per tap\n"
                 f"corners {list(settings.pixel_box_lower_corner)}/{list(settings.pixel_box_upper_corner)}, "
                 f"coord {settings.start_coord(0)}; circle k = row k of the tile (grey = padding, loaded as 0);\n"
                 f"red dashed = the access window, grey dotted = the window before the offsets shift it",
                 fontsize=13)
    return common.save_figure(fig, outdir, "03_conv_k_loop")
