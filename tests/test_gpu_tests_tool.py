"""tools/gpu_tests.py, the GPU suite's runner, on a CPU: how it cuts the suite into chunks and how
it records outcomes (a chunk stopped at the deadline must report what it finished, and nothing it
did not run)."""
import importlib.util
import types
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("gpu_tests", Path(__file__).resolve().parent.parent / "tools" / "gpu_tests.py")
gpu_tests = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gpu_tests)

IDS = ([f"a_test.py::test_plain[{i}]" for i in range(30)]
       + ["b_test.py::test_fp8_on_200_random_layers", "b_test.py::test_small"]
       + [f"c_test.py::test_random_layers[{i}]" for i in range(13)]
       + ["c_test.py::test_depthwise_on_100_random_layers"])


def test_chunks_put_heavy_tests_alone_and_first_and_lose_no_test():
    chunks = gpu_tests.chunks_of(IDS, 8)
    assert sorted(i for chunk in chunks for i in chunk) == sorted(IDS)          # every test, once
    assert chunks[0] == ["b_test.py::test_fp8_on_200_random_layers"]
    assert chunks[1] == ["c_test.py::test_depthwise_on_100_random_layers"]
    assert [len(c) for c in chunks[2:6]] == [4, 4, 4, 1]                        # the random layers: size 8 / 2
    assert all(len({i.split("::")[0] for i in chunk}) == 1 for chunk in chunks)  # one file per chunk
    assert [len(c) for c in chunks[6:]] == [8, 8, 8, 6, 1]                      # a_test's 30, b_test's 1


def _report(nodeid, when, outcome, text=""):
    return types.SimpleNamespace(nodeid=nodeid, when=when, outcome=outcome, longreprtext=text)


def test_plugin_records_each_outcome_and_the_first_error_line(tmp_path):
    record = tmp_path / "record.tsv"
    hook = lambda report: gpu_tests.record_outcome(report, str(record))      # noqa: E731
    hook(_report("x.py::test_ok", "setup", "passed"))                 # setup passing: nothing yet
    hook(_report("x.py::test_ok", "call", "passed"))
    hook(_report("x.py::test_bad[a b]", "call", "failed", "    def f():\nE   AssertionError: 1 != 2\nE   more"))
    hook(_report("x.py::test_gpu", "setup", "skipped", "needs a GPU"))
    hook(_report("x.py::test_fixture", "setup", "failed", "E   RuntimeError: CUDA out of memory"))
    hook(_report("x.py::test_ok2", "call", "passed"))
    hook(_report("x.py::test_ok2", "teardown", "failed", "E   OSError: teardown"))  # a later line wins
    assert gpu_tests.recorded(record) == {
        "x.py::test_ok": ("PASSED", ""), "x.py::test_bad[a b]": ("FAILED", "AssertionError: 1 != 2"),
        "x.py::test_gpu": ("SKIPPED", ""), "x.py::test_fixture": ("ERROR", "RuntimeError: CUDA out of memory"),
        "x.py::test_ok2": ("ERROR", "OSError: teardown")}
    assert gpu_tests.recorded(tmp_path / "never-written.tsv") == {}     # a chunk killed before its first test


def test_without_a_record_the_plugin_does_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    gpu_tests.record_outcome(_report("x.py::test_ok", "call", "passed"), None)
    monkeypatch.setattr(gpu_tests, "_RECORD", None)             # a pytest run without the variable
    gpu_tests.pytest_runtest_logreport(_report("x.py::test_ok", "call", "passed"))
    assert list(tmp_path.iterdir()) == []


def test_the_plugin_records_a_test_that_changes_the_variable(tmp_path, monkeypatch):
    """The runner's own tests set GPU_TESTS_RECORD: the plugin keeps the path the session began with."""
    record = tmp_path / "chunk.tsv"
    monkeypatch.setenv("GPU_TESTS_RECORD", str(record))
    gpu_tests.pytest_configure(None)
    monkeypatch.setenv("GPU_TESTS_RECORD", str(tmp_path / "elsewhere.tsv"))
    gpu_tests.pytest_runtest_logreport(_report("x.py::test_ok", "call", "passed"))
    assert gpu_tests.recorded(record) == {"x.py::test_ok": ("PASSED", "")}


@pytest.mark.parametrize("part", ["0/2", "3/2", "1", "a/b"])
def test_bad_part_is_refused(part, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["gpu_tests.py", "--part", part])
    with pytest.raises(SystemExit):
        gpu_tests.main()
    assert "--part must be i/n" in capsys.readouterr().err
