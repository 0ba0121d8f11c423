#!/usr/bin/env bash
# kvbench's GPU check: one command, at most 9 minutes on one H200 (the stages' limits add up to 8.0), runnable on a
# machine without a package index, with .whl/ filled by `make gpu-wheels` in the repository (any working directory):
#
#   OUT=/tmp/kvbench-gpu bash scripts/gpu_check.sh                     # OUT defaults to /tmp/kvbench-gpu-check
#   GPU_CHECK_STAGES="decode long-context" bash scripts/gpu_check.sh   # only these (setup and report always run)
#   GPU_CHECK_DRY=1 bash scripts/gpu_check.sh                          # the same stages on the CPU, tiny sizes
#
# Each stage runs under its own time limit (`timeout`); a stage that fails or runs out is reported and the rest go
# on. `python -m experiments.gpu_check plan` prints every stage's limit beside its predicted time (the roofline
# of harness/analytic/roofline.py at half the H200's datasheet peaks, plus each point's fixed costs; see that module).
#   setup         the wheels of .whl/ (hydra-core, omegaconf, antlr4: the GPU image lacks them) into a folder on
#                 PYTHONPATH, and this repository on PYTHONPATH; then one python checks that torch sees the GPU
#   ceilings      this device's copy bandwidth and matmul peaks (python -m experiments.ceilings), stored once
#   decode        experiment=gpu-check-decode: Llama-3.1-8B, batch 1, 512-token prompts, contiguous/paged x bf16/fp8 KV
#   long-context  experiment=gpu-check-long-context: the same four caches at batch 8 x 8192 tokens, fp8 accuracy too
#   compile       experiment=gpu-check-compile: `small` eager (profiled) and compile=reduce-overhead (CUDA graphs)
#   crossover     experiment=gpu-check-crossover: Llama-3.1-8B at 32-token prompts, batch 1..512
#   serve         python -m experiments.serve -m experiment=serve-gpu-check: Llama-3.1-8B on dummy weights, a paged
#                 pool in bf16 and fp8_e4m3, one fixed stream at qps=inf; max running measured beside predicted
#   tiers         python -m experiments.tiers at Llama-3.1-8B's 16- and 256-token blocks: d2h and h2d through
#                 page-locked host memory, the disk tier's write and cold read
#   pd            python -m experiments.pd: Llama-3.1-8B's KV from a prefill to a decode process over tcp and shm,
#                 staged through the host, at 1024 and 4096 tokens
#   tests         every `gpu`-marked test and the Triton kernel's tests, compiled for this GPU (pytest-xdist if there)
#   report        python -m experiments.gpu_check report: the merged rows, summary.md and its verdict lines
# Stages write only into GPU_CHECK_WORK (default /tmp/kvbench-gpu-work: each stage's rows and Hydra logs, cleared
# at every start; the stored ceilings, kept). $OUT gets eight files, none in a folder: gpu_check.log (everything
# printed), summary.md (the machine, the stages, the key rows, and last one PASS/FAIL/N/A line per target),
# rows.parquet (every decode row of every stage, a `stage` column added), ops.parquet (the profiler's top ops),
# ceilings.json (with the tiers stage's tier_gbps), tests.xml (pytest's JUnit report), serve.parquet (the serve
# runs' run rows) and movement.parquet (the tier and PD rows, a `table` column naming each one's contract). Should
# the report itself fail, its partial files are removed and every stage's raw results come back as stages.tar.gz
# beside a summary.md that says so.
# GPU_CHECK_DRY=1: every stage at tiny sizes on the CPU (model=tiny, a few tokens, one repeat, in the sweep's own
# process; the gpu tests skip themselves, a few kernel tests run in Triton's interpreter, reduce-overhead is an
# `unsupported` row), with .venv/bin/python when there is one. PYTHON=... picks the interpreter either way.
# Exit status: 0 when every stage exited 0. The verdicts are findings about the targets, not the exit status.
set -uo pipefail

DRY=${GPU_CHECK_DRY:-}
[ "$DRY" = 0 ] && DRY=
OUT=$(realpath -m "${OUT:-/tmp/kvbench-gpu-check}")
WORK=$(realpath -m "${GPU_CHECK_WORK:-/tmp/kvbench-gpu-work}")
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1 # the repository root: conf/, tests/, .whl/
ALL_STAGES="ceilings decode long-context compile crossover serve tiers pd tests"
STAGES=${GPU_CHECK_STAGES:-$ALL_STAGES}
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -n "$DRY" ] && [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
else
  PY=python3
fi
for name in $STAGES; do
  if [[ " $ALL_STAGES " != *" $name "* ]]; then
    echo "gpu_check: bad GPU_CHECK_STAGES: unknown stage '$name'; allowed: $ALL_STAGES" >&2
    exit 2
  fi
done
# The measuring stages read the stored ceilings (bw_util needs them): measured first, or loaded when stored.
if [[ " $STAGES " =~ \ (decode|long-context|compile|crossover|tiers)\  ]] && [[ " $STAGES " != *" ceilings "* ]]; then
  STAGES="ceilings $STAGES"
fi

mkdir -p "$OUT" "$WORK" || exit 1
# This script's own files only: $OUT may hold anything else (it is emptied before each command on the device).
REPORTED=(rows.parquet ops.parquet ceilings.json serve.parquet movement.parquet) # the report stage's files
rm -f "${REPORTED[@]/#/$OUT/}" "$OUT"/{summary.md,tests.xml,stages.tar.gz}
rm -rf "${WORK:?}/stages" "$WORK/site" "$WORK/stages.tsv" "$WORK/tests.xml"
mkdir -p "$WORK/stages" "$WORK/store"
: >"$OUT/gpu_check.log"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
tee_pid=$!
export PYTHONUNBUFFERED=1

# The serving and movement stages' GPU arguments, one line each: experiments/gpu_stages.py reads these lines to
# predict each stage's seconds (python -m experiments.gpu_check plan). A dry run appends its tiny sizes.
SERVE_ARGS=(experiment=serve-gpu-check)
TIERS_ARGS=(model=llama-3.1-8b kv_dtype=bf16 "block_tokens=[16,256]" total_mb=64 repeats=5)
PD_ARGS=(model=llama-3.1-8b "transports=[tcp,shm]" "kv_dtypes=[bf16]" "contexts=[1024,4096]" repeats=3 prefill_repeats=1)
if [ -n "$DRY" ]; then
  DEVICE=cpu QUICK=true LONG_CONTEXT_TOKENS=64 DEADLINE_S=${GPU_CHECK_DEADLINE_S:-360}
  # Tiny points on the CPU: what the stages' presets run, minus the sizes (later overrides win over a preset's), and
  # measured in the sweep's own process: a spawned worker costs each sweep ~10 s here, a third of the dry run, and
  # the workers have tests of their own (tests/run/test_sweep.py, tests/run/test_faults.py).
  POINT=(model=tiny device=cpu warmup=1 min_repeats=1 max_repeats=1 max_time_s=1 gen_len=3 isolate=false)
  # One thread: a tiny model's ops are far too small to share, and threads that wait on each other on a busy 2-core
  # machine made a tiny bf16 step take 5 to 170 ms here (1 thread: 3 to 6 ms).
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  DECODE=(prompt_len=32) LONG=(batch_size=2 "prompt_len=$LONG_CONTEXT_TOKENS") CROSS=(batch_size=1,2,4 prompt_len=8)
  # Serve: 16 requests of 16 + 4 tokens into 7 blocks (bf16; 12 in fp8) of the tiny model's KV, so the pool still
  # limits the requests running at once; tiers: one block size, 64 files of 4 KiB a repeat (an fsync each, ~15 ms
  # here); pd: two short contexts.
  SERVE_ARGS+=(model=tiny num_prompts=16 prompt_len=16 output_len=4 max_model_len=32 kv_memory_gb=0.00003)
  TIERS_ARGS+=(model=tiny "block_tokens=[16]" total_mb=0.25 repeats=2)
  PD_ARGS+=(model=tiny "contexts=[16,64]" repeats=2)
else
  DEVICE=cuda QUICK=false LONG_CONTEXT_TOKENS=8192 DEADLINE_S=${GPU_CHECK_DEADLINE_S:-540}
  POINT=() DECODE=() LONG=() CROSS=()
fi
SITE=$WORK/site STORE=$WORK/store
export PY SITE DRY WORK
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
REPORT_LIMIT=$([ -n "$DRY" ] && echo 60 || echo 10)  # the report stage's limits, below: kept in reserve
failures=()
started=$SECONDS
printf 'stage\tlimit_s\texit\tseconds\n' >"$WORK/stages.tsv"

# stage NAME GPU_LIMIT DRY_LIMIT COMMAND...: COMMAND under a time limit (seconds), its exit status and duration
# reported and appended to stages.tsv; exit 124 means it ran out of time. The limit shrinks so that the whole run
# ends within DEADLINE_S, the report's own limit kept in reserve; a stage with under 5 s left is skipped.
stage() {
  local name=$1 limit=$2
  [ -n "$DRY" ] && limit=$3
  shift 3
  local reserve=$REPORT_LIMIT
  [ "$name" = report ] && reserve=0
  local left=$((DEADLINE_S - (SECONDS - started) - reserve))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 5 ]; then
    echo "=== $name: skipped, ${left} s left of the ${DEADLINE_S} s deadline"
    printf '%s\t%s\t%s\t%s\n' "$name" "$limit" skipped 0 >>"$WORK/stages.tsv"
    failures+=("$name (skipped)")
    return
  fi
  local t0=$SECONDS
  echo "=== $name (limit ${limit} s) $(date -u +%H:%M:%S)"
  timeout --kill-after=5 "$limit" "$@"
  local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - t0)) s$([ "$rc" -eq 124 ] && echo ': out of time')"
  printf '%s\t%s\t%s\t%s\n' "$name" "$limit" "$rc" "$((SECONDS - t0))" >>"$WORK/stages.tsv"
  if [ "$rc" -ne 0 ]; then failures+=("$name (exit $rc)"); fi
}

selected() { [[ " $STAGES " == *" $1 "* ]]; }

# The command of one stage's sweep, in `cmd`: its preset, its own results folder, the stored ceilings, and in a dry
# run the tiny sizes.
sweep_command() {
  local name=$1 preset=$2
  shift 2
  cmd=("$PY" -m experiments.decode "experiment=$preset" "results_dir=$WORK/stages/$name" "ceilings_dir=$STORE"
    "ceilings_quick=$QUICK" "${POINT[@]}" "$@")
}

SETUP='set -e
"$PY" -c "import hydra" 2>/dev/null || compgen -G ".whl/*.whl" >/dev/null ||
  echo "no hydra-core here and no .whl/: run make gpu-wheels where pip works, and bring .whl/ along"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
fi
[ -n "$DRY" ] || nvidia-smi
"$PY" - <<"EOF"
import os, sys
import hydra, omegaconf, torch
import experiments.decode, harness
print("python", sys.version.split()[0], sys.executable, "| torch", torch.__version__, "| hydra-core",
      hydra.__version__, "| omegaconf", omegaconf.__version__, "| kvbench from", os.path.dirname(harness.__file__))
if not os.environ.get("DRY"):
    assert torch.cuda.is_available(), "torch sees no CUDA device"
    import triton
    print(torch.cuda.get_device_name(), "| triton", triton.__version__, "| CUDA", torch.version.cuda)
EOF'

# The gpu-marked tests (collected from every file that marks some: a file importing a package this machine lacks is
# not collected) and the kernel's tests. On the GPU: 4 xdist workers when pytest-xdist is installed. Dry: the gpu
# tests are collected and skip themselves; of the kernel's tests, a few (Triton's interpreter takes ~40 s for all).
TESTS='set -e
export TORCHINDUCTOR_COMPILE_THREADS=4 # per xdist worker: 4 x 4 compile processes on the 16 cores, not 4 x 16
# The files in tests/ subfolders that mark some: with none named, pytest collects the whole suite to find the same
# ids, ~20 s of the dry run.
mapfile -t files < <(grep -rl --include="test_*.py" "mark.gpu" tests | sort)
[ "${#files[@]}" -gt 0 ] || { echo "no test file under tests/ marks mark.gpu"; exit 1; }
mapfile -t ids < <("$PY" -m pytest --collect-only -q -p no:cacheprovider -m gpu "${files[@]}" | grep "::")
[ "${#ids[@]}" -gt 0 ] || { echo "no gpu-marked tests collected from ${files[*]}"; exit 1; }
options=(-q -p no:cacheprovider -rfEs --junitxml="$WORK/tests.xml")
if [ -n "$DRY" ]; then
  options+=(-k "gpu or contiguous_buffer or split_count")
elif "$PY" -c "import xdist" 2>/dev/null; then
  options+=(-n 4)
fi
"$PY" -m pytest "${options[@]}" "${ids[@]}" tests/kv/test_triton_paged.py'

echo "=== kvbench GPU check$([ -n "$DRY" ] && echo ' (dry run on the CPU)'): stages: $STAGES"
echo "=== python $PY; OUT $OUT; work $WORK; deadline ${DEADLINE_S} s"
stage setup 20 60 bash -c "$SETUP"
if selected ceilings; then
  stage ceilings 18 60 "$PY" -m experiments.ceilings "device=$DEVICE" "results_dir=$STORE" "quick=$QUICK"
fi
if selected decode; then
  sweep_command decode gpu-check-decode "${DECODE[@]}"
  stage decode 40 60 "${cmd[@]}"
fi
if selected long-context; then
  sweep_command long-context gpu-check-long-context "${LONG[@]}"
  stage long-context 75 60 "${cmd[@]}"
fi
if selected compile; then
  sweep_command compile gpu-check-compile
  stage compile 75 60 "${cmd[@]}"
fi
if selected crossover; then
  sweep_command crossover gpu-check-crossover "${CROSS[@]}"
  stage crossover 42 60 "${cmd[@]}"
fi
if selected serve; then
  stage serve 38 60 "$PY" -m experiments.serve -m "${SERVE_ARGS[@]}" "device=$DEVICE" "results_dir=$WORK/stages/serve"
fi
if selected tiers; then
  # The stored ceilings copied into the stage's own folder: read there (none measured again), tier_gbps added.
  mkdir -p "$WORK/stages/tiers/ceilings" && cp -f "$STORE"/ceilings/*.json "$WORK/stages/tiers/ceilings/" 2>/dev/null
  stage tiers 26 60 "$PY" -m experiments.tiers "${TIERS_ARGS[@]}" "device=$DEVICE" "quick=$QUICK" \
    "results_dir=$WORK/stages/tiers"
fi
if selected pd; then
  stage pd 42 60 "$PY" -m experiments.pd "${PD_ARGS[@]}" "device=$DEVICE" "results_dir=$WORK/stages/pd"
fi
if selected tests; then
  stage tests 92 90 bash -c "$TESTS"
fi
stage report 10 60 "$PY" -m experiments.gpu_check report --work "$WORK" --out "$OUT" \
  --long-context-tokens "$LONG_CONTEXT_TOKENS" ${DRY:+--dry}
[ -f "$WORK/tests.xml" ] && cp "$WORK/tests.xml" "$OUT/tests.xml"
if [ ! -f "$OUT/summary.md" ]; then
  # The report itself failed: bring back every stage's raw results in one file, the report's partial files removed
  # (at most 8 files come back), and say so where the verdicts go.
  rm -f "${REPORTED[@]/#/$OUT/}"
  tar -czf "$OUT/stages.tar.gz" -C "$WORK" stages stages.tsv
  {
    echo "# kvbench GPU check: the report stage failed (see gpu_check.log); every row is in stages.tar.gz"
    echo
    echo '```'
    column -t -s $'\t' "$WORK/stages.tsv" 2>/dev/null || cat "$WORK/stages.tsv"
    echo '```'
    echo
    echo "## Verdicts"
    echo
    targets=(bandwidth paged-overhead fp8-long-context reduce-overhead energy-clocks serve-concurrency pd-transfer)
    for target in "${targets[@]}"; do
      echo "N/A   $target: the report stage failed"
    done
  } >"$OUT/summary.md"
fi

echo "=== total $((SECONDS - started)) s; failed stages: ${failures[*]:-none}"
echo "=== $OUT: $(find "$OUT" -type f | wc -l) files:" $(cd "$OUT" && find . -type f -printf '%P (%s B)\n' | sort)
# The merged rows and the verdicts, last: the run tool's output tail shows them whatever else scrolled past.
[ -f "$OUT/summary.md" ] && sed -n '/^## Verdicts/,$p' "$OUT/summary.md"
exec >&- 2>&-
wait "$tee_pid"
[ "${#failures[@]}" -eq 0 ]
