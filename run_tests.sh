#!/usr/bin/env bash
# Runs every test of the series (the lessons' test_* functions and tests/), setting up everything on
# first use (see README.md). Extra arguments go to pytest (e.g. -k tma, -x).
set -euo pipefail
cd "$(dirname "$0")"
source tools/bootstrap.sh
exec "$PY" -m pytest "$@"
