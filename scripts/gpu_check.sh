#!/usr/bin/env bash
# kvbench's GPU check: one command, at most 8 minutes on one H200 (its stages' limits add up to 7.6). From the
# repository root:
#
#   OUT=/tmp/kvbench-gpu bash scripts/gpu_check.sh        # OUT defaults to ./gpu-check
#
# What it does, each stage under its own time limit (a stage that fails or runs out is reported, the rest go on):
#   1. set-up: hydra-core, omegaconf and antlr4 from wheels in .whl/ when that folder exists (a machine without a
#      package index; fill it elsewhere with `pip download hydra-core omegaconf antlr4-python3-runtime==4.9.3 -d .whl`),
#      then this repository, editable, without dependencies (torch, pandas, pyarrow, nvidia-ml-py, transformers and
#      triton are expected to be there already);
#   2. the CUDA tests: every test marked `gpu`, and the paged-decode kernel's tests, compiled for this GPU;
#   3. this device's ceilings (copy bandwidth, matmul peaks), stored under $OUT/ceilings/;
#   4. Llama-3.1-8B decode at batch 1, 8 and 64 (512-token prompts): contiguous and paged x bf16 and fp8_e4m3 KV;
#   5. the long-context check: batch 8 at 8192-token prompts, the same four caches, accuracy of fp8 included;
#   6. the crossover: experiment=crossover-gpu at 32-token prompts, batch 1..512;
#   7. a summary of every row under $OUT (python -m harness.results show), printed last.
# Every point writes its parquet under $OUT/<stage>/<sweep_id>/ as it completes, whatever happens to later ones.
set -uo pipefail

OUT=${OUT:-$PWD/gpu-check}
PY=${PYTHON:-python}
mkdir -p "$OUT"
failures=()
started=$SECONDS

# stage NAME SECONDS COMMAND...: runs COMMAND under a time limit, reports its exit status and duration.
stage() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit} s)"
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  if [ "$rc" -ne 0 ]; then failures+=("$name (exit $rc)"); fi
}

setup() {
  if [ -d .whl ]; then
    "$PY" -m pip install --quiet --no-index --find-links .whl hydra-core omegaconf antlr4-python3-runtime || return 1
  fi
  # --no-build-isolation: setuptools from this environment, so that nothing is fetched for the build either.
  "$PY" -m pip install --quiet --no-deps --no-build-isolation -e . || return 1
  "$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; \
print(torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
}

# Decode points: no profiler pass (its own figures, not this check's), few repeats, ceilings shared through $OUT.
COMMON=(device=cuda dtype=bf16 warmup=1 max_time_s=10 profile=false "ceilings_dir=$OUT")

echo "=== setup"
setup || failures+=("setup")
# The test files that hold `gpu` tests (a file importing a package this machine lacks is never collected).
mapfile -t gpu_tests < <(grep -l "mark.gpu" tests/test_*.py)
stage tests 100 "$PY" -m pytest -q -p no:cacheprovider -m gpu "${gpu_tests[@]}"
stage kernel-tests 50 "$PY" -m pytest -q -p no:cacheprovider tests/test_triton_paged.py
stage ceilings 45 "$PY" -m experiments.ceilings device=cuda "results_dir=$OUT"
stage decode 100 "$PY" -m experiments.decode -m model=llama-3.1-8b cache=contiguous,paged kv_dtype=auto,fp8_e4m3 \
  batch_size=1,8,64 prompt_len=512 gen_len=32 min_repeats=2 max_repeats=3 accuracy=false "${COMMON[@]}" \
  "results_dir=$OUT/decode"
stage long-context 70 "$PY" -m experiments.decode -m model=llama-3.1-8b cache=contiguous,paged \
  kv_dtype=auto,fp8_e4m3 batch_size=8 prompt_len=8192 gen_len=32 min_repeats=2 max_repeats=2 "${COMMON[@]}" \
  "results_dir=$OUT/long-context"
stage crossover 90 "$PY" -m experiments.decode experiment=crossover-gpu prompt_len=32 gen_len=8 min_repeats=2 \
  max_repeats=3 "${COMMON[@]}" "results_dir=$OUT/crossover"

echo "=== total $((SECONDS - started)) s; failed stages: ${failures[*]:-none}"
"$PY" -m harness.results show "$OUT"
