# Sourced by the GPU scripts (gpu_checks.sh, gpu_rllib_bundle.sh), with LOG set to their log file.
# step NAME SECONDS COMMAND...: run COMMAND under its own time limit, its output appended to $LOG and its
# start, end and exit status marked there and on stdout; a failing step does not stop the next one.
step() {
  local name=$1 secs=$2
  shift 2
  echo "=== $name ($(date -u +%T))" | tee -a "$LOG"
  timeout "$secs" "$@" >>"$LOG" 2>&1
  echo "=== $name rc=$? ($(date -u +%T))" | tee -a "$LOG"
}

# kernels [--into SITE]: compile conduit-core's C kernels with $PY (next to the sources, or into SITE where a pure
# wheel went), then say in $LOG which ones conduit runs (without a C compiler there, its NumPy and torch paths)
kernels() {
  step kernels 120 "$PY" packages/conduit-core/hatch_build.py "$@"
  "$PY" -c "from conduit.semantics import sumtree; from conduit.storage import columnar
print('compiled kernels: sum tree', sumtree.COMPILED, '- row store', columnar._rows is not None)" >>"$LOG" 2>&1
}
