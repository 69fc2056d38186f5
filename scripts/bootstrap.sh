#!/usr/bin/env bash
# Set up .venv with every package (editable) and its test tools. Idempotent and quick when
# nothing changed. torch==2.13.0 goes in first, on its own, so pip takes the local CPU wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.conduit-installed
# (the build hook and the C sources count: a change to them must rebuild the compiled kernels)
want=$(cat requirements/*.txt packages/*/pyproject.toml packages/conduit-core/hatch_build.py \
  packages/conduit-core/src/conduit/*/*.c | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install -q -r requirements/torch-cpu.txt
  .venv/bin/python -m pip install -q -r requirements/dev.txt
  echo "$want" > "$stamp"
fi
# The packages are installed editable, so pip compiled none of their modules; where PYTHONDONTWRITEBYTECODE is set
# (as on CI) every process that imports them (each test worker, Ray actor and subprocess) would compile them again.
# Quiet unless a module does not compile: its error is printed, and the setup goes on (importing it fails as before).
.venv/bin/python -m compileall -q packages/*/src || true
