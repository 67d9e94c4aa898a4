#!/usr/bin/env bash
# The GPU checks, for anyone with a GPU, in at most 8 minutes; installs nothing (run it in the environment
# that has CuPy, PyTorch and mpi4py, e.g. after `. .venv/bin/activate`):
#   tests/gpu_check.sh                     # logs in a new temporary folder
#   OUT=/tmp/gpu tests/gpu_check.sh -k einsum   # logs in /tmp/gpu; arguments go to pytest (both suite runs)
# Steps, each cut off after its share of the 8 minutes (`timeout`; the suite's own MPIMESH_TEST_TIMEOUT ends
# it a little earlier, with its summary):
#   benchmark     python benchmarks/gpu.py (fp32, tf32, bf16 against PyTorch eager; 5 timed steps), first,
#                 on a GPU nothing else uses
#   profile       python benchmarks/gpu.py --profile for tf32 and bf16 (kernel vs wall time, op and kernel tables)
#   suite-1rank   python tests/run.py --backend cupy, MPIMESH_TEST_RANKS=1, -m "not slow" (no pip installs)
#   suite-2ranks  the same on 2 ranks sharing the GPU (NCCL refuses that: the meshes take the staged transport),
#                 beside suite-1rank
# The whole suite on CuPy takes much longer than its share (on an H200, 2026-11-27: CuPy compiles each new
# kernel and runs tiny arrays slowly; 8 parallel 1-rank shards got through 10-30% in 190 s), so the suite
# steps run the files of the GPU paths first (`GPU_FIRST`), then the rest as far as they get (GPU_CHECK_TESTS
# replaces that list); name test files to check just those, e.g.
#   tests/gpu_check.sh tests/test_compile.py tests/test_graphs.py tests/test_fused.py
# Each step's output goes to $OUT/<step>.log; the last lines are one table: step, status, seconds, key figure.
# Open MPI as root (as on the project's GPU machines) is allowed, and oversubscribed, for tests/run.py's launcher.
# Without a usable GPU it stops at once: one line, exit status 2. Otherwise the exit status is 0 only if every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}

# The reason CuPy cannot be used here (tests/run.py's own check, in a child process), or nothing.
why=$(timeout 20 "$PYTHON" -c 'import sys; sys.path.insert(0, "tests"); import run; print(run.check_backend("cupy") or "")' \
    2>&1 | tail -n 1)
if [[ -n $why ]]; then
    echo "tests/gpu_check.sh: no usable GPU here, nothing checked: $why" >&2
    exit 2
fi

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_mpi_yield_when_idle=1  # (two suites side by side: waiting ranks give up their cores)
OUT=${OUT:-$(mktemp -d -t mpimesh-gpu-check.XXXXXX)}
mkdir -p "$OUT"
ROWS=$(mktemp -d)
trap 'rm -rf "$ROWS"' EXIT
GPU_FIRST="tests/test_compile.py tests/test_graphs.py tests/test_gpu_transports.py tests/test_widen.py
           tests/test_cuda_sources.py tests/test_fused.py tests/test_donate.py tests/test_low_precision.py
           tests/test_einsum.py tests/test_nn.py tests/test_layers.py tests/test_gpu_memory_peak.py"

# step NAME SECONDS CMD...: run CMD for at most SECONDS into $OUT/NAME.log; its row (the key figure comes
# from key_NAME LOG) into $ROWS/NAME, so that steps can run side by side.
step() {
    local name=$1 limit=$2 start=$SECONDS status
    shift 2
    echo "== $name (at most ${limit} s): $(printf '%q ' "$@")> $OUT/$name.log"
    timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local code=$?
    case $code in
        0) status=PASS ;;
        124 | 137) status=TIMEOUT ;;
        *) status="FAIL($code)" ;;
    esac
    echo "$name|$status|$((SECONDS - start))|$("key_$name" "$OUT/$name.log")" > "$ROWS/$name"
}

pytest_summary() {  # rank 0's pytest summary ("412 passed, 20 skipped in 130.2s"), or how far it got
    local summary
    summary=$(grep -E '[0-9]+ (passed|failed|error)' "$1" | grep -E ' in [0-9.]+s' | tail -n 1 | tr -d '=')
    if [[ -n ${summary// /} ]]; then
        echo $summary
    else
        echo "no summary; got to $(grep -oE '\[ *[0-9]+%\]' "$1" | tail -n 1 | tr -d ' ')"
    fi
}
key_suite-1rank() { pytest_summary "$1"; }
key_suite-2ranks() { pytest_summary "$1"; }
key_benchmark() {  # each precision's step time, mpimesh eager / PyTorch, and compiled
    awk '$1 == "precision" && $2 == "eager" { t = 1; next }
         t && NF > 10 { s = s sep $1 " " $2 "/" $3 " ms (" $4 "x), compiled " $8 " ms (" $9 "x)"; sep = "; " }
         END { print s }' "$1"
}
key_profile() {  # each precision's and step's kernel time of its wall time, ops and kernels per step
    awk '$1 == "precision" && $2 == "step" { t = 1; next } t && NF < 9 { t = 0 }
         t { s = s sep $1 " " $2 " kernels " $5 " of " $3 " ms, " $7 " ops, " $8 " kernels"; sep = "; " } END { print s }' "$1"
}

files=()  # the GPU paths' files first, then every other, unless the arguments name files
for a in "$@"; do
    [[ $a != -* && -e ${a%%::*} ]] && files=(none)
done
if [[ ${files[*]-} != none ]]; then
    # shellcheck disable=SC2206
    files=(${GPU_CHECK_TESTS:-$GPU_FIRST tests/})
else
    files=()
fi

suite() {  # suite RANKS SECONDS [pytest args]
    local ranks=$1 limit=$2
    shift 2
    MPIMESH_TEST_RANKS=$ranks MPIMESH_TEST_TIMEOUT=$((limit - 15)) step "suite-${ranks}rank$([[ $ranks == 1 ]] || echo s)" \
        "$limit" "$PYTHON" tests/run.py --backend cupy -m "not slow" "$@" ${files[@]+"${files[@]}"}
}

# 110 + 65 + 270 s (the suites side by side), each with up to 5 s to die, and the 20 s check above: under 8 minutes.
step benchmark 110 "$PYTHON" benchmarks/gpu.py --steps 5 --warmup 2
step profile 65 "$PYTHON" benchmarks/gpu.py --profile --precisions tf32,bf16 --steps 3 --warmup 1
suite 1 270 "$@" &
suite 2 270 "$@" &
wait
rows=()
for name in benchmark profile suite-1rank suite-2ranks; do
    rows+=("$(cat "$ROWS/$name")")
done

echo
printf '%-13s  %-9s  %7s  %s\n' step status seconds "key figure"
for row in "${rows[@]}"; do
    IFS='|' read -r name status seconds key <<< "$row"
    printf '%-13s  %-9s  %7s  %s\n' "$name" "$status" "$seconds" "$key"
done
echo "logs: $OUT"
for row in "${rows[@]}"; do
    [[ $row == *"|PASS|"* ]] || exit 1
done
