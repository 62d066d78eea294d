"""pytest set-up: make `import common` work from every test and pick the interpreter before Triton loads."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (sets TRITON_INTERPRET=1 when there is no GPU)
import pytest  # noqa: E402

common.quiet_teardown()


@pytest.hookimpl(trylast=True)     # after the terminal reporter exists
def pytest_configure(config):
    """Ahead-of-time compiles take seconds to a minute each on a small CPU, inside one test: the
    terminal shows which one runs, so a long wait does not look like a hang."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        return

    def show(text):
        with capture.global_and_fixture_disabled():      # past pytest's capture of the test's output
            reporter.write(text)
            reporter.flush()
    common.SHOW_PROGRESS = show


def pytest_collection_modifyitems(config, items):
    """CONV_TUTORIAL_SHARD=i/n keeps every n-th test from the i-th: n processes share a long GPU run."""
    import os
    shard = os.environ.get("CONV_TUTORIAL_SHARD")
    if not shard:
        return
    index, count = (int(v) for v in shard.split("/"))
    kept = items[index::count]
    config.hook.pytest_deselected(items=[item for item in items if item not in kept])
    items[:] = kept
