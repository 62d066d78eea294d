"""pytest set-up: make `import common` work from every test and pick the interpreter before Triton loads."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402,F401  (sets TRITON_INTERPRET=1 when there is no GPU)
