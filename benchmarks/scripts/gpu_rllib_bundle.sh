#!/usr/bin/env bash
# Ray 2.60 + RLlib for a lent GPU machine that reaches no registry, in one call. A call carries at most
# 64 MiB with the working tree and Ray's cp312 wheel alone is 79 MB, so the wheels are installed here for
# CPython 3.12 (the H200 image's python3) into a folder, Ray's Java jars are left out, and the folder
# travels as one xz tarball (~30 MB). torch, numpy, scipy, pandas and pyarrow are left out: the image has
# them (../.library/device/KINDS.md). Conduit's packages are not in it: they run from the working tree, with
# core's C kernels compiled there by the image's Python where it finds a C compiler.
#
# Here (downloads from PyPI, ~2 min of xz):
#   bash benchmarks/scripts/gpu_rllib_bundle.sh pack            # -> .whl/rllib/site.tar.xz + SHA256SUMS
#   bash benchmarks/scripts/gpu_rllib_bundle.sh pack-verl       # optional: -> .whl/verl (verl's GPU test too)
# There, with carry [".whl/rllib"] (and ".whl/verl"):
#   bash benchmarks/scripts/gpu_rllib_bundle.sh run             # install, then the GPU checks into $OUT
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
SITE=/tmp/rllib-site
# binary wheels for the GPU image's CPython 3.12 on x86-64 Linux
PLATFORM=(--only-binary=:all: --implementation cp --python-version 3.12 --platform manylinux_2_28_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

# seal DIR NAME: DIR/site packed as .whl/NAME/site.tar.xz with its SHA256SUMS; DIR removed
seal() {
  rm -rf ".whl/$2" && mkdir -p ".whl/$2"
  tar cf - -C "$1/site" . | xz -9 -T0 >".whl/$2/site.tar.xz"
  (cd ".whl/$2" && sha256sum site.tar.xz >SHA256SUMS)
  rm -rf "$1"
  ls -l ".whl/$2"
}

case "${1:-}" in
pack)
  set -e
  dir=$(mktemp -d)
  .venv/bin/python -m pip download -q "${PLATFORM[@]}" -d "$dir/whl" "ray[rllib]==2.60.0"
  rm -f "$dir"/whl/{numpy,scipy,torch,pandas,pyarrow}-*.whl
  .venv/bin/python -m pip install -q --no-deps --no-compile "${PLATFORM[@]}" --target "$dir/site" "$dir"/whl/*.whl
  rm -rf "$dir/site/ray/jars" "$dir/site/ray/dashboard/client/build"
  seal "$dir" rllib
  ;;
run)
  OUT=${OUT:-out/gpu}
  mkdir -p "$OUT"
  LOG="$OUT/gpu_rllib.log"
  export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 RAY_AUTH_MODE=disabled
  # shellcheck source=gpu_step.sh
  source benchmarks/scripts/gpu_step.sh
  (cd .whl/rllib && sha256sum -c --quiet SHA256SUMS) || exit 1
  rm -rf "$SITE" && mkdir -p "$SITE" && xz -dc -T0 .whl/rllib/site.tar.xz | tar xf - -C "$SITE" || exit 1
  tests=(packages/conduit-core/tests packages/conduit-srl/tests/test_buffer.py packages/conduit-rllib/tests/test_replay.py)
  if [ -f .whl/verl/site.tar.xz ]; then  # (carried when "pack-verl" made it)
    (cd .whl/verl && sha256sum -c --quiet SHA256SUMS) && xz -dc -T0 .whl/verl/site.tar.xz | tar xf - -C "$SITE" \
      && tests+=(packages/conduit-verl/tests/test_delivery.py)
  fi
  export PYTHONPATH="$SITE:$PWD/packages/conduit-core/src:$PWD/packages/conduit-rllib/src:$PWD/packages/conduit-srl/src"
  PYTHONPATH="$PYTHONPATH:$PWD/packages/conduit-verl/src"
  { nvidia-smi -L; nproc; "$PY" -c "import torch, numpy, ray, ray.rllib, conduit_rllib; print('torch',
torch.__version__, 'numpy', numpy.__version__, 'ray', ray.__version__, torch.cuda.get_device_name(0))"; } >>"$LOG" 2>&1
  kernels  # (in the working tree's src/, which the PYTHONPATH above imports)
  # issue 5: the d = 5000 DQN comparison, learner on the GPU (buffer on host and on the GPU tier), then a
  # remote learner holding the GPU
  # (RLLIB_SECONDS=0 leaves it out)
  [ "${RLLIB_SECONDS:-330}" -gt 0 ] && step rllib_gpu_dqn "${RLLIB_SECONDS:-330}" "$PY" benchmarks/scripts/rllib_gpu_dqn.py \
    --num-cpus 12 --iterations 8 --remote-iterations 4 --out "$OUT/rllib_gpu_dqn.json"
  # where one DQN sample's time goes on the GPU machine (cProfile and torch.profiler tables; PROFILE_SECONDS=0: not)
  [ "${PROFILE_SECONDS:-0}" -gt 0 ] && step sample_profile "$PROFILE_SECONDS" "$PY" benchmarks/scripts/gpu_sample_profile.py \
    --device cuda:0 --out "$OUT/sample_profile"
  # every GPU-marked test, now with Ray present (the distributed tier's and the RLlib adapter's too; verl's when carried)
  step gpu_tests "${TESTS_SECONDS:-60}" "$PY" -m pytest -p no:cacheprovider -p no:randomly -q -rs -m gpu "${tests[@]}"
  tail -5 "$LOG"
  ;;
pack-verl)
  # verl's delivery test on the GPU needs verl and what importing it pulls in beyond Ray and the image
  # (transformers, accelerate and tokenizers are there): the versions of this project's venv, for CPython 3.12
  set -e
  dir=$(mktemp -d)
  .venv/bin/python -m pip install -q --no-deps --no-compile "${PLATFORM[@]}" --target "$dir/site" \
    verl==0.9.1 tensordict==0.10.0 TransferQueue==0.1.11 orjson==3.13.0 msgspec==0.23.0 pyzmq==27.3.0 \
    pyvers==0.1.0 importlib_metadata==10.2.0 dill==0.4.1 codetiming==1.4.0 omegaconf==2.3.1 hydra-core==1.3.8
  .venv/bin/python -m pip install -q --no-deps --no-compile --target "$dir/site" antlr4-python3-runtime==4.9.3
  seal "$dir" verl
  ;;
*)
  echo "usage: $0 pack | pack-verl | run" >&2
  exit 2
  ;;
esac
