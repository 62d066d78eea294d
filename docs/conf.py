"""Sphinx configuration of the series' site: sphinx-gallery runs every lesson ([0-9][0-9]-*.py, as
they run on a machine without a GPU) and turns each into a page; RESULTS.md becomes a page through
MyST. The index's list of lessons is written here from the lesson files, so the site follows
whatever lessons exist.

Headings in a lesson: its docstring's title is underlined with "=" (the page's one top-level
heading); every section of a cell with "-", a sub-section with "~". A cell heading underlined with
"=" would be a second top-level heading: a sibling of the lessons in the sidebar
(tools/check_site.py fails such a page)."""
import os
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("CONV_TUTORIAL_KEEP_FIGURES", "1")    # figures stay open for the scraper
# sphinx-gallery runs each lesson in docs/lessons_src (a copy made by build_docs.sh, not kept), so
# that the pages show "[output] plots and data go to out" as a reader's run from the repository does
os.environ.setdefault("CONV_TUTORIAL_OUT", str(DOCS / "lessons_src" / "out"))
os.environ.setdefault("MPLBACKEND", "Agg")

import common  # noqa: E402  (on a machine without a GPU it turns on the Triton interpreter)

project = "GPU convolution, from Triton to warp-specialized Hopper/Blackwell kernels"
author = "the series' authors"
extensions = ["sphinx_gallery.gen_gallery", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "_generated", "lessons_src", "requirements.txt", "lessons_header.rst"]
html_theme = "furo"
html_title = "GPU convolution tutorial"
myst_heading_anchors = 3
suppress_warnings = ["myst.header"]
smartquotes = False          # "--bench" must stay two hyphens: readers copy the commands

sphinx_gallery_conf = {
    "examples_dirs": [str(DOCS / "lessons_src")],     # copies of the lessons, made by build_docs.sh
    "gallery_dirs": [str(DOCS / "lessons")],
    "filename_pattern": r"/\d\d-",                     # run every lesson
    "within_subsection_order": "FileNameSortKey",
    "download_all_examples": False,
    "remove_config_comments": True,
    "abort_on_example_error": True,
    "show_memory": False,
    "image_scrapers": ("matplotlib",),
    "write_computation_times": False,                 # no timing file in the source tree
}



def _recorded_ladder():
    """The index's picture: the recorded ladder, drawn from its JSON by today's plotting code,
    with where and when it was measured."""
    recorded = common.recorded_results("05_tflops_per_shape")
    generated = DOCS / "_generated"
    generated.mkdir(exist_ok=True)
    if recorded is None:
        text = "(no recorded GPU results in this checkout)\n"
    else:
        data, info = recorded
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import matplotlib.pyplot as plt
        import network_suite
        network_suite.plot_ladder(data["rows"], info, data["dtype"], generated, None, recorded=info)
        plt.close("all")          # the figures stay open for the gallery's scraper (see above): not these
        text = (".. figure:: _generated/05_ladder_recorded.png\n   :width: 560px\n\n"
                f"   RECORDED, not measured while building this page: measured {info['date']} on "
                f"{info['device']} (versions in the title; data in {info['folder']}).\n")
    (generated / "recorded_ladder.rst").write_text(text)


def _results_pages():
    """RESULTS.md and the lab notebook as pages of the site (written here, not kept in docs/):
    their paths rewritten from the repository's root (and results/) to docs/, so that images
    resolve and RESULTS' link to the notebook points at the notebook's page."""
    results = (ROOT / "RESULTS.md").read_text()
    results = results.replace("](results/notebook.md)", "](notebook.md)").replace("](results/", "](../results/")
    (DOCS / "results.md").write_text(results)
    notebook = (ROOT / "results" / "notebook.md").read_text()
    notebook = re.sub(r"\]\((h100-[^)]*)\)", r"](../results/\1)", notebook)
    (DOCS / "notebook.md").write_text(notebook)


def _lesson_list():
    """The index's list of lessons: a link to each lesson file's page, titled by its docstring."""
    lines = [f"- :doc:`lessons/{path.stem}`" for path in sorted(ROOT.glob("[0-9][0-9]-*.py"))]
    (DOCS / "_generated" / "lesson_list.rst").write_text("\n".join(lines) + "\n")


_recorded_ladder()
_lesson_list()
_results_pages()
