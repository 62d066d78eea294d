#!/usr/bin/env bash
# Runs the whole series in order, setting up everything on first use (see README.md).
# Plots and data go to one folder: $CONV_TUTORIAL_OUT, or ./out. Extra arguments go to every lesson
# (e.g. --bench on a GPU, --quick for a fast look). Each lesson's time is printed after it.
set -euo pipefail
cd "$(dirname "$0")"
source tools/bootstrap.sh
export CONV_TUTORIAL_OUT=${CONV_TUTORIAL_OUT:-$PWD/out}
echo "[series] plots and data go to $CONV_TUTORIAL_OUT"
_series_start=$SECONDS
for lesson in [0-9][0-9]-*.py; do
  echo; echo "================ $lesson ================"
  _lesson_start=$SECONDS
  "$PY" "$lesson" --outdir "$CONV_TUTORIAL_OUT" "$@"
  echo "[series] $lesson: $((SECONDS - _lesson_start)) s"
done
echo; echo "[series] done in $((SECONDS - _series_start)) s; plots and data are in $CONV_TUTORIAL_OUT"
