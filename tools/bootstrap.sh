# Sourced by run_series.sh and run_tests.sh: finds or makes a Python with everything in
# requirements.txt, exports PY (that interpreter) and picks the Triton interpreter when no GPU is present.
# Order of preference: $PYTHON if set; a python3 that already satisfies requirements.txt (e.g. a GPU
# image); otherwise a fresh ./.venv installed from requirements.txt (a CPU build of torch on CPU machines).
set -euo pipefail
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_satisfies() {
  "$1" - <<'PY' 2>/dev/null
import importlib.metadata as md, sys
def ver(name):
    return tuple(int(p) for p in md.version(name).split("+")[0].split(".")[:2])
ok = ver("triton") == (3, 9) and ver("torch") >= (2, 9)
for name in ("pytest", "matplotlib", "numpy", "torchvision", "ninja"):
    md.version(name)
import torchvision  # noqa: F401  (a torchvision built for another torch fails here: "torchvision::nms does not exist")
sys.exit(0 if ok else 1)
PY
}
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -x "$_root/.venv/bin/python" ] && _satisfies "$_root/.venv/bin/python"; then
  PY=$_root/.venv/bin/python
elif _satisfies "$(command -v python3)"; then
  PY=$(command -v python3)
else
  # Each step says what it installs and when it started; pip lists what it downloads (a progress bar
  # on a terminal, one line per file in a CI log). Step 2 takes most of the time.
  _t0=$SECONDS
  _step() { echo "[setup] step $1/4 ($((SECONDS - _t0)) s): $2"; }
  if [ -t 1 ]; then _pip_progress="--progress-bar on"; else _pip_progress="--progress-bar off"; fi
  echo "[setup] creating $_root/.venv and installing requirements.txt (first run only)"
  python3 -m venv "$_root/.venv"
  rm -f "$_root/.venv/pip.conf"     # (written below, after the installs)
  PY=$_root/.venv/bin/python
  _step 1 "a current pip"
  "$PY" -m pip install -q --upgrade pip
  # torch and the torchvision built for it, as one pair (a torchvision built for another torch does
  # not import). No NVIDIA driver: on x86_64 the pair 2.14.1/0.29.1, on Arm the CPU pair 2.9.1/0.24.1,
  # elsewhere PyTorch's CPU index; with a GPU, PyPI's newest pair.
  if command -v nvidia-smi >/dev/null 2>&1; then _pair="torch torchvision"
  elif [ "$(uname -m)" = x86_64 ]; then _pair="torch==2.14.1 torchvision==0.29.1"
  else _pair="torch==2.9.1 torchvision==0.24.1"; fi
  _step 2 "$_pair (the largest step: torch and the libraries it brings)"
  if ! "$PY" -m pip install $_pip_progress $_pair; then
    echo "[setup] step 2/4: trying PyTorch's CPU index instead"
    "$PY" -m pip install $_pip_progress torch torchvision --index-url https://download.pytorch.org/whl/cpu
  fi
  # Then the Triton the series is written for, over the one torch pinned for its own compiler
  # (Inductor): no torch with a torchvision is built on Triton 3.9 yet, and torch.compile of the
  # series' models runs on 3.9 (RESULTS.md). pip would warn that the pins differ: expected, so kept quiet.
  _step 3 "$(grep -E '^triton' "$_root/requirements.txt") over torch's own pin"
  if ! _out=$("$PY" -m pip install -q --no-deps "$(grep -E '^triton' "$_root/requirements.txt")" 2>&1); then
    echo "$_out" >&2; exit 1
  fi
  # The rest, keeping the torch just installed (an unpinned torchvision would pull a newer one).
  _torch=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')
  _step 4 "the rest of requirements.txt (pytest, matplotlib, numpy), keeping torch $_torch"
  "$PY" -m pip install -q $_pip_progress -r <(grep -vE '^(triton|torch)' "$_root/requirements.txt") -c <(echo "torch==$_torch")
  _satisfies "$PY" || { echo "[setup] $_root/.venv does not satisfy requirements.txt after installing it" >&2; exit 1; }
  echo "[setup] $_root/.venv ready in $((SECONDS - _t0)) s ($(du -sh "$_root/.venv" 2>/dev/null | cut -f1))"
fi
# Where ./.venv's torch pins an older Triton than the 3.9 installed over it (`pip check` says so), pip,
# resolving anyone's dependencies there (`pip install -e .` too), would replace that torch with another
# (a CPU 2.13 or PyPI's 2.15). So there pip installs only what it is asked to: the venv's own pip.conf.
if [ "$PY" = "$_root/.venv/bin/python" ] && [ ! -e "$_root/.venv/pip.conf" ] && ! "$PY" -m pip check >/dev/null 2>&1; then
  printf '%s\n' "# tools/bootstrap.sh: torch's metadata here pins an older Triton than the one installed (pip check);" \
    "# resolving dependencies would replace torch, so pip in this venv installs without them." \
    "[install]" "no-deps = true" > "$_root/.venv/pip.conf"
  echo "[setup] $_root/.venv/pip.conf: pip installs without dependencies in this venv (torch pins another Triton)"
fi
export PY
export MPLBACKEND=Agg PYTHONUNBUFFERED=1
# Triton kernels run under the interpreter when there is no CUDA GPU.
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  export TRITON_INTERPRET=1
  echo "[setup] no CUDA GPU: Triton kernels run under TRITON_INTERPRET=1; GPU-only parts are skipped"
fi
"$PY" -c "import sys, torch, triton; print('[setup] python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
