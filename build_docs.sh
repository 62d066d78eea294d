#!/usr/bin/env bash
# Builds the series' website into ./site from the six lessons (sphinx-gallery runs each one as it
# runs on this machine) and RESULTS.md, setting up everything on first use (see README.md).
#   bash build_docs.sh            # build ./site (open site/index.html)
#   bash build_docs.sh --check    # build, then open every page in headless Chromium and check it
set -euo pipefail
cd "$(dirname "$0")"
source tools/bootstrap.sh
if ! "$PY" -c 'import sphinx, sphinx_gallery, furo, myst_parser' 2>/dev/null; then
  echo "[setup] installing docs/requirements.txt (first run only)..."
  # with their dependencies, which ./.venv's pip.conf turns off for what could replace its torch (tools/bootstrap.sh)
  PIP_NO_DEPS=false "$PY" -m pip install -q -r docs/requirements.txt
fi
rm -rf docs/lessons docs/lessons_src docs/_generated site
mkdir -p docs/lessons_src
cp [0-9][0-9]-*.py docs/lessons_src/
cp docs/lessons_header.rst docs/lessons_src/GALLERY_HEADER.rst
start=$SECONDS
"$PY" -m sphinx -b html -q docs site
echo "[docs] site built in $((SECONDS - start)) s: $PWD/site/index.html"
if [ "${1:-}" = "--check" ]; then
  "$PY" tools/check_site.py site
fi
