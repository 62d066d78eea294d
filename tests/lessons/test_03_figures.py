"""Lesson 03's figures (drawn by the kit module lesson_figures.py) are written."""
import common
import lesson_figures

LESSON = "03-tma-im2col-modes"


def test_plots_are_written(tmp_path):
    lesson = common.load_lesson(LESSON)
    for name in lesson.EXAMPLES:
        assert lesson_figures.plot_example(lesson, name, tmp_path).stat().st_size > 10_000
    assert lesson_figures.plot_conv_k_loop(lesson, tmp_path).stat().st_size > 10_000
