#!/usr/bin/env bash
# The package installs as a user installs it, end to end, on a machine with or without a GPU:
#   1. a fresh clone of this repository's committed tree (--tree: a copy of the working tree instead)
#   2. `pip wheel . --no-deps`; the wheel holds every module of conv_tutorial/, and declares the Triton pin
#      of requirements.txt (the lessons' set-up), and no more dependencies than torch, Triton and ninja
#   3. a new venv, `pip install <wheel>`, its dependencies resolved by pip alone (first a dry run that
#      says which torch and Triton pip picks)
#   4. from an empty folder, with the checkout nowhere on the path: `import conv_tutorial` (from the
#      venv), a conv on CPU tensors through conv_tutorial.conv2d (the fallback to torch) against
#      torch.nn.functional.conv2d, and the package's forward kernel compiled ahead of time for sm_90
#      from the installed files (conv_tutorial.kernels.aot; Triton compiles for a target without a GPU), and
#      the replays' packed launches (conv_tutorial/packed_launch.c) built by Triton's build, and the repeat
#      calls' C++ kernels (conv_tutorial/native.cpp) built by torch's, with the ninja pip installed.
# Usage: tools/check_wheel.sh [--tree] [--pypi] [--torch SPEC] [--keep]
#   --pypi  resolve as a user's pip does: PyPI only, without this machine's pip configuration
#           (PIP_CONFIG_FILE=/dev/null; on this machine it caps torch at its local wheels). On Linux x86_64
#           that is PyPI's CUDA torch, several GB.
#   --torch SPEC  the README's route for keeping an older CUDA torch: `pip install SPEC` (e.g. torch==2.9.1,
#           which pins an older Triton), then `pip install --no-deps "triton>=3.9,<3.10"` and the wheel --no-deps.
#   --keep  keep the work folder (its path is printed).
# Exits non-zero at the first step that fails.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
from=clone pypi=0 keep=0 torch=
while [ $# -gt 0 ]; do
  case $1 in
    --tree) from=tree ;;
    --pypi) pypi=1 ;;
    --torch) torch=${2:?--torch needs a requirement, e.g. torch==2.9.1}; shift ;;
    --keep) keep=1 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
work=$(mktemp -d /tmp/check-wheel.XXXXXX)
[ "$keep" = 1 ] || trap 'rm -rf "$work"' EXIT
echo "[check_wheel] work folder $work"
if [ "$pypi" = 1 ]; then
  pipenv=(env -u PIP_FIND_LINKS -u PIP_CONSTRAINT -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null)
else
  pipenv=(env)
fi

# 1. the source
if [ "$from" = clone ]; then
  git clone -q "$root" "$work/src"
  echo "[check_wheel] 1. fresh clone of $root at $(git -C "$work/src" rev-parse --short HEAD)"
else
  mkdir "$work/src"
  (cd "$root" && tar --exclude=./.venv --exclude=./.git --exclude=./dist --exclude=./build -cf - .) | tar -xf - -C "$work/src"
  echo "[check_wheel] 1. copy of the working tree of $root"
fi

# 2. the wheel
python3 -m venv "$work/venv"
py=$work/venv/bin/python
(cd "$work/src" && "${pipenv[@]}" "$py" -m pip wheel -q . --no-deps -w "$work/dist")
wheel=$(ls "$work"/dist/conv_tutorial-*.whl)
echo "[check_wheel] 2. $(basename "$wheel"), $(stat -c %s "$wheel") bytes"
"$py" - "$wheel" "$work/src" <<'PY'
import pathlib, re, sys, zipfile
wheel, src = sys.argv[1], pathlib.Path(sys.argv[2])
names = set(zipfile.ZipFile(wheel).namelist())
modules = {p.relative_to(src).as_posix() for pattern in ("*.py", "*.c", "*.cpp") for p in (src / "conv_tutorial").rglob(pattern)}
missing = sorted(modules - names)
assert not missing, f"the wheel lacks {missing} (a subpackage without __init__.py?)"
meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
print("   Requires-Dist:", "; ".join(requires))
def name_and_specs(requirement):
    name, specs = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(.*)", requirement).groups()
    return name.lower(), sorted(s.replace(" ", "") for s in specs.split(";")[0].split(",") if s.strip())
declared = dict(name_and_specs(r) for r in requires if "extra ==" not in r)
assert set(declared) == {"torch", "triton", "ninja"}, f"the package should declare torch, triton and ninja only, not {sorted(declared)}"
lessons = dict(name_and_specs(line) for line in (src / "requirements.txt").read_text().splitlines()
               if line.strip() and not line.lstrip().startswith("#"))
for name in ("triton", "torch"):
    assert declared[name] == lessons[name], f"{name}: pyproject.toml says {declared[name]}, requirements.txt {lessons[name]}"
print(f"   {len(modules)} modules and sources of conv_tutorial/ in the wheel; torch and Triton pinned as requirements.txt pins them, and ninja")
PY

# 3. the install, pip resolving the dependencies
if [ -n "$torch" ]; then     # an older CUDA torch kept: Triton 3.9 over its pin, then the package alone
  "${pipenv[@]}" "$py" -m pip install -q "$torch"
  triton_pin=$(grep -E '^triton' "$work/src/requirements.txt")
  "${pipenv[@]}" "$py" -m pip install -q --no-deps "$triton_pin"
  "${pipenv[@]}" "$py" -m pip install -q --no-deps "$wheel"
  echo "[check_wheel] 3. pip install $torch; pip install --no-deps \"$triton_pin\"; pip install --no-deps $(basename "$wheel")"
else
  "${pipenv[@]}" "$py" -m pip install -q --dry-run --report "$work/resolved.json" "$wheel"
  "$py" - "$work/resolved.json" <<'PY'
import json, sys
picked = {i["metadata"]["name"].lower(): i for i in json.load(open(sys.argv[1]))["install"]}
for name in ("torch", "triton"):
    if name in picked:
        print(f"[check_wheel] 3. pip resolves {name} {picked[name]['metadata']['version']} "
              f"({picked[name]['download_info']['url'].rsplit('/', 1)[-1]})")
PY
  "${pipenv[@]}" "$py" -m pip install -q "$wheel"
fi
echo "[check_wheel]    installed: $("$py" -m pip list 2>/dev/null | grep -iE '^(torch|triton|conv.tutorial) ' | tr -s ' ' | paste -sd ',' | sed 's/,/, /g');" \
     "venv $(du -sh "$work/venv" | cut -f1)"

# 4. from an empty folder
mkdir "$work/empty"
cd "$work/empty"
env -u PYTHONPATH "$py" - "$root" <<'PY'
import pathlib, sys, warnings
root = pathlib.Path(sys.argv[1]).resolve()
sys.path[:] = [p for p in sys.path if p and pathlib.Path(p).resolve() != root]
import torch
import conv_tutorial
where = pathlib.Path(conv_tutorial.__file__).resolve()
assert root not in where.parents, f"imported from the checkout: {where}"
print(f"[check_wheel] 4. import conv_tutorial: {where.parent} (torch {torch.__version__})")
checkout = [name for name, m in sys.modules.items() if (f := getattr(m, "__file__", None)) and root in pathlib.Path(f).resolve().parents]
assert not checkout, f"modules loaded from the checkout: {checkout}"

# a conv on CPU tensors: the kernel needs a Hopper or Blackwell GPU, so the operator hands it to torch
torch.manual_seed(0)
x, w, b = torch.randn(2, 8, 12, 12), torch.randn(16, 8, 3, 3), torch.randn(16)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    y = conv_tutorial.conv2d(x, w, b, stride=1, padding=1)
expected = torch.nn.functional.conv2d(x, w, b, stride=1, padding=1)
err = (y - expected).abs().max().item()
assert y.shape == expected.shape and err <= 1e-5, (tuple(y.shape), err)
print(f"   conv_tutorial.conv2d on CPU tensors {tuple(x.shape)} x {tuple(w.shape)}: {tuple(y.shape)}, "
      f"max |diff| against torch.nn.functional.conv2d {err:.1e}; warnings: "
      + ("; ".join(str(c.message).splitlines()[0][:100] for c in caught) or "none"))
PY
env -u PYTHONPATH -u TRITON_INTERPRET "$py" - "$root" <<'PY'
# The forward kernel compiled ahead of time for sm_90 (Triton compiles for a target without a GPU),
# through the package's own helper (conv_tutorial.kernels.aot), from the installed files alone.
import pathlib, re, sys
root = pathlib.Path(sys.argv[1]).resolve()
sys.path[:] = [p for p in sys.path if p and pathlib.Path(p).resolve() != root]
import triton
from conv_tutorial.kernels import aot
arch = "sm_90"
kernel, args, kwargs = aot.fprop_build(arch)      # lesson 05's headline build: bf16, 3x3, 64 -> 128, the fixed config
compiled = aot.compile_for_target(kernel, args, kwargs, arch)
ptx = compiled.asm["ptx"]
where = pathlib.Path(aot.__file__).resolve()
assert root not in where.parents, f"compiled from the checkout: {where}"
assert ".target sm_90a" in ptx and "wgmma.mma_async" in ptx, "no sm_90a WGMMA in the PTX"
counts = {op: len(re.findall(rf"\b{re.escape(op)}\b", ptx)) for op in ("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait")}
print(f"   {kernel.__name__} compiled ahead of time for {arch} by {where.relative_to(where.parents[2])} with Triton "
      f"{triton.__version__}: {len(ptx.splitlines())} PTX lines, cubin {len(compiled.asm['cubin'])} bytes, "
      f"{compiled.metadata.shared} bytes of shared memory; " + ", ".join(f"{op} x{n}" for op, n in counts.items()))
# the replays' packed launches, built from the installed C source by Triton's build (packed.py)
from conv_tutorial import packed
built = pathlib.Path(packed.module().__file__)
print(f"   conv_tutorial/packed_launch.c built by Triton's build: {built.name}")
# the repeat calls' C++ kernels, built from the installed source by torch's build with pip's ninja (native.py)
import conv_tutorial.launch  # noqa: F401  (tells native.py how launches are made)
from conv_tutorial import native
print(f"   conv_tutorial/native.cpp built by torch's build: {pathlib.Path(native._module().__file__).name}")
PY
echo "[check_wheel] passed"
