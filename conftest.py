"""pytest set-up: make `import common` work from every test and pick the interpreter before Triton loads."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (sets TRITON_INTERPRET=1 when there is no GPU)

common.quiet_teardown()


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
