#!/usr/bin/env bash
# Builds the series' website into ./site from the lessons ([0-9][0-9]-*.py: sphinx-gallery runs each
# one as it runs on this machine) and RESULTS.md, setting up everything on first use (see README.md).
#   bash build_docs.sh            # build ./site (open site/index.html)
#   bash build_docs.sh --check    # build, then check every page (tools/check_site.py): fails on any
#                                 # Sphinx warning or error, a broken link or image, a lesson page with
#                                 # more than one top-level heading, and a page Chromium could not
#                                 # screenshot whole (tall pages are shot in pieces)
set -euo pipefail
cd "$(dirname "$0")"
source tools/bootstrap.sh
if ! "$PY" -c 'import sphinx, sphinx_gallery, furo, myst_parser' 2>/dev/null; then
  echo "[setup] installing docs/requirements.txt (first run only)..."
  # with their dependencies, which ./.venv's pip.conf turns off for what could replace its torch (tools/bootstrap.sh)
  PIP_NO_DEPS=false "$PY" -m pip install -q -r docs/requirements.txt
fi
rm -rf docs/lessons docs/lessons_src docs/_generated site
mkdir -p docs/lessons_src docs/_generated
cp [0-9][0-9]-*.py docs/lessons_src/
cp docs/lessons_header.rst docs/lessons_src/GALLERY_HEADER.rst
# Sphinx's warnings and errors go to the terminal (as they happen) and to this file, which --check reads.
warnings=docs/_generated/sphinx-warnings.log
start=$SECONDS
"$PY" -m sphinx -b html -q -w "$warnings" docs site
count=$(grep -cE '(WARNING|ERROR|CRITICAL|SEVERE):' "$warnings" || true)
echo "[docs] site built in $((SECONDS - start)) s: $PWD/site/index.html; $count Sphinx warnings or errors ($warnings)"
if [ "${1:-}" = "--check" ]; then
  "$PY" tools/check_site.py site --sphinx-warnings "$warnings"
fi
