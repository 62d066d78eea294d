"""tools/check_site.py, the site's check (`bash build_docs.sh --check`), on a CPU and without the
site: a Sphinx warning in the build's -w log fails it (shown on a two-page Sphinx project built here,
~3 s), so does a page with a second top-level heading; tall pages are cut into pieces that cover
them to the bottom; the lessons it expects are the repository's lesson files."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("check_site", Path(__file__).resolve().parent.parent / "tools" / "check_site.py")
check_site = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(check_site)

# A comment list with no blank line before it: docutils' "Unexpected indentation", the warning
# lesson 06's page once had while the check said 0 problems.
BROKEN_LIST = """
A paragraph of two lines
with a list right under it:
  - one line
  - another
"""


def build(tmp_path, extra_text):
    """A two-page Sphinx project (index links results), built with the -w log build_docs.sh uses."""
    pytest.importorskip("sphinx")
    pytest.importorskip("furo")                    # the site's theme (another may add an <h1> of its own)
    src = tmp_path / "src"
    src.mkdir()
    (src / "conf.py").write_text("project = 'planted'\nhtml_theme = 'furo'\n")
    (src / "index.rst").write_text("Index\n=====\n\nSee :doc:`results`.\n" + extra_text +
                                   "\n.. toctree::\n   :hidden:\n\n   results\n")
    (src / "results.rst").write_text("Results\n=======\n\nNothing yet.\n")
    log = tmp_path / "sphinx-warnings.log"
    subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-q", "-w", str(log), str(src),
                    str(tmp_path / "site")], check=True, capture_output=True, timeout=300)
    return tmp_path / "site", log


@pytest.mark.parametrize("planted", [False, True], ids=["clean", "planted_warning"])
def test_a_sphinx_warning_fails_the_check(tmp_path, monkeypatch, planted):
    site, log = build(tmp_path, BROKEN_LIST if planted else "")
    monkeypatch.setattr(check_site, "lesson_stems", lambda root=None: [])     # this site has no lessons
    problems = check_site.sphinx_problems(log)
    assert bool(problems) == planted
    if planted:
        assert "Unexpected indentation" in " ".join(problems)
    code = check_site.main([str(site), "--sphinx-warnings", str(log), "--no-screenshots"])
    assert code == (1 if planted else 0)


def test_a_missing_warnings_file_fails(tmp_path):
    assert check_site.sphinx_problems(tmp_path / "none.log") != []


def test_a_second_top_level_heading_is_reported(tmp_path):
    site = tmp_path / "site"
    (site / "lessons").mkdir(parents=True)
    (site / "index.html").write_text('<a href="results.html">r</a><a href="lessons/05-x.html">05</a>')
    (site / "results.html").write_text("<h1>Results</h1>")
    (site / "lessons" / "05-x.html").write_text(
        '<h1 id="a">Lesson 05: x<a class="headerlink" href="#a">\u00b6</a></h1><h2>1. ok</h2><h1>Part II: y</h1>'
        + '<div class="highlight"></div>' * 3 + '<img class="sphx-glr-single-img" src="../results.html">')
    _, problems = check_site.check(site, lessons=["05-x"])
    assert len(problems) == 1
    assert "2 top-level headings ['Lesson 05: x', 'Part II: y']" in problems[0]


@pytest.mark.parametrize("height, tops", [
    (900, [0]), (16_000, [0]), (16_001, [0, 1]), (40_000, [0, 16_000, 24_000]), (130_000, list(range(0, 113_000, 16_000)) + [114_000])])
def test_pieces_cover_a_tall_page_to_its_bottom(height, tops):
    found = check_site.piece_tops(height)
    assert found == tops
    assert found[-1] + min(height, check_site.PIECE_HEIGHT) == height                  # the last ends at the bottom
    assert all(b - a <= check_site.PIECE_HEIGHT for a, b in zip(found, found[1:]))     # no gap between pieces


def test_the_lessons_expected_are_the_repositorys_lesson_files():
    stems = check_site.lesson_stems()
    assert "01-conv-basics" in stems and stems == sorted(stems)
    assert all(stem[:2].isdigit() and stem[2] == "-" for stem in stems)


def test_build_docs_hands_the_warnings_file_to_the_check():
    """build_docs.sh --check: Sphinx writes its -w log, and the check reads that same file."""
    script = (Path(__file__).resolve().parent.parent / "build_docs.sh").read_text()
    assert '-w "$warnings"' in script and '--sphinx-warnings "$warnings"' in script
