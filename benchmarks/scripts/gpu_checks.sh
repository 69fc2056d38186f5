#!/usr/bin/env bash
# Every GPU check in one run, for a lent GPU machine whose python3 already holds a CUDA torch, pytest,
# scipy and tqdm (the project's H200 image; it has no Ray, so the RLlib and distributed checks cannot run
# there). Prepare pure wheels here (the image's Python is another version: a wheel with this venv's compiled
# kernels would not install there), then run this there from the repository root; it compiles the kernels with
# the image's Python where a C compiler is found (the log says whether they run):
#
#   CONDUIT_NO_NATIVE=1 .venv/bin/python -m pip wheel --no-deps -w .whl packages/conduit-core packages/conduit-srl
#   OUT=out/gpu bash benchmarks/scripts/gpu_checks.sh      # with .whl carried to the GPU machine
#
# Each step has its own time limit and log in $OUT; a failing step does not stop the next one.
set -u
OUT=${OUT:-out/gpu}
PY=${PY:-python3}
mkdir -p "$OUT"
LOG="$OUT/gpu_checks.log"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4

"$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/conduit-site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/conduit-site

# shellcheck source=gpu_step.sh
source "$(dirname "$0")/gpu_step.sh"

{ nvidia-smi -L; "$PY" -c "import torch, numpy; print('torch', torch.__version__, 'numpy', numpy.__version__,
'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"; } >>"$LOG" 2>&1
kernels --into /tmp/conduit-site

# the GPU-marked tests of core and the SRL adapter (tiers, pinned staging, side-stream prefetch)
step gpu_tests 150 "$PY" -m pytest -p no:cacheprovider -q -rs -m gpu \
  packages/conduit-core/tests packages/conduit-srl/tests/test_buffer.py
# issue 4: the next batch's H2D on a side stream hidden behind a matmul-heavy update
step gpu_overlap 150 "$PY" benchmarks/scripts/gpu_overlap.py --out "$OUT"
step gpu_overlap_g2 150 "$PY" benchmarks/scripts/gpu_overlap.py --dims 128 1000 10000 --g-del 2 --out "$OUT/g2"
# placement: the machine's measured profile, sample-512 on the GPU tier against the on-GPU floor
step gpu_placement 120 "$PY" benchmarks/scripts/gpu_placement.py --out "$OUT"
# every CPU test of core once more, now with CUDA present (pinned buffers, device discovery)
step core_suite 150 "$PY" -m pytest -p no:cacheprovider -q -n 8 packages/conduit-core/tests \
  --deselect packages/conduit-core/tests/test_placement_validation.py
# the cost model's host prediction against measurement, alone on the machine (it times deliveries)
step placement_validation 120 "$PY" -m pytest -p no:cacheprovider -q packages/conduit-core/tests/test_placement_validation.py
tail -3 "$LOG"
