#!/usr/bin/env bash
# Ray 2.60 + RLlib for a lent GPU machine that reaches no registry, carried in parts: a call carries
# at most 64 MiB with the working tree, and Ray's cp312 wheel alone is 79 MB. The machine keeps ignored
# files between calls while it stays warm, so each call parks one part in .bundle/, and the last one
# reassembles and installs them.
#
# Here (downloads from PyPI; torch, numpy, scipy, pandas and pyarrow are left out: the H200 image has
# them, see ../.library/device/KINDS.md; ~95 MB in two parts of PART_MB):
#   bash benchmarks/scripts/gpu_rllib_bundle.sh pack            # -> .whl/rllib/part-00, part-01, ...
# There, one call per part, each with carry [".whl/rllib/part-NN"] (the first also ".whl/rllib/SHA256SUMS"),
# back to back:
#   bash benchmarks/scripts/gpu_rllib_bundle.sh keep            # moves the carried part into .bundle/
# and in the call that carries the last part (or a later one):
#   bash benchmarks/scripts/gpu_rllib_bundle.sh keep && bash benchmarks/scripts/gpu_rllib_bundle.sh install \
#     && PYTHONPATH=/tmp/rllib-site python3 benchmarks/scripts/rllib_gpu_dqn.py --out "$OUT/rllib_gpu_dqn.json"
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
PART_MB=${PART_MB:-56}  # + the working tree (~3 MB) stays under the 64 MiB a call carries

case "${1:-}" in
pack)
  dir=$(mktemp -d)
  .venv/bin/python -m pip download -q --only-binary=:all: --implementation cp --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir" "ray[rllib]==2.60.0"
  rm -f "$dir"/numpy-*.whl "$dir"/scipy-*.whl "$dir"/torch-*.whl "$dir"/pandas-*.whl "$dir"/pyarrow-*.whl
  .venv/bin/python -m pip wheel -q --no-deps -w "$dir" packages/conduit-core packages/conduit-rllib
  rm -rf .whl/rllib && mkdir -p .whl/rllib
  tar cf - -C "$dir" . | split -b "${PART_MB}M" -d - .whl/rllib/part-
  (cd "$dir" && sha256sum ./*.whl) >.whl/rllib/SHA256SUMS
  rm -rf "$dir"
  ls -l .whl/rllib
  ;;
keep)
  mkdir -p .bundle
  found=0
  for p in .whl/rllib/part-* .whl/rllib/SHA256SUMS; do
    [ -e "$p" ] && mv "$p" .bundle/ && found=1
  done
  [ "$found" = 1 ] || { echo "no part carried: pass carry [\".whl/rllib/part-NN\"]" >&2; exit 1; }
  ls -l .bundle
  ;;
install)
  rm -rf /tmp/rllib-bundle /tmp/rllib-site && mkdir -p /tmp/rllib-bundle
  cat .bundle/part-* | tar xf - -C /tmp/rllib-bundle
  if [ -e .bundle/SHA256SUMS ]; then
    root=$PWD
    (cd /tmp/rllib-bundle && sha256sum -c --quiet "$root/.bundle/SHA256SUMS")
  else
    echo "no .bundle/SHA256SUMS carried: wheels not checked" >&2
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/rllib-site /tmp/rllib-bundle/*.whl
  PYTHONPATH=/tmp/rllib-site "$PY" -c "import ray, ray.rllib, conduit_rllib; print('ray', ray.__version__, 'ok')"
  ;;
*)
  echo "usage: $0 pack | keep | install" >&2
  exit 2
  ;;
esac
