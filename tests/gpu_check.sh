#!/usr/bin/env bash
# The GPU checks in one call of at most 5 minutes, on a GPU machine's image as it is: installs nothing,
# runs `python3` (PYTHON replaces it) with its CuPy, PyTorch, mpi4py and MPI; pytest-mpi need not be there
# (tests/run.py then loads its stand-in, tests/mpi_marks.py).
#   tests/gpu_check.sh                          # logs in a new temporary folder
#   OUT=/tmp/gpu tests/gpu_check.sh -k einsum   # logs in /tmp/gpu; arguments go to pytest (both test steps)
# Steps, each cut off after its share (`timeout`), all of them inside GPU_CHECK_SECONDS (default 270; the
# check for a GPU first takes up to 20 more):
#   tests-1rank   tests/run.py --backend cupy on 1 rank, the tests that need a GPU (GPU_TESTS below; the
#                 file arguments, or GPU_CHECK_TESTS, replace that list): the one-kernel rows, widened GEMMs
#                 through cuBLAS, fused elementwise kernels, CUDA graphs, the GPU transports, the GPU pool's peak
#   tests-2ranks  the same on 2 ranks sharing the GPU (NCCL refuses that: the meshes take the staged
#                 transport), beside tests-1rank
#   benchmark     python benchmarks/gpu.py --profile (tf32 and bf16 against PyTorch eager, then where one
#                 step's time goes; GPU_CHECK_BENCH_ARGS replaces the arguments), alone on the GPU
# A test file whose top-level imports are not installed here is left out, with one line. JAX runs on the
# CPU (JAX_PLATFORMS=cpu: its GPU backend would take 75% of the GPU beside CuPy's pool). Open MPI runs as
# root (as on the project's GPU machines), oversubscribed. Each step's output goes to $OUT/<step>.log, its
# row (step|status|seconds|key figure) to $OUT/rows.txt as the step ends; the table of those rows is
# printed last, also when the script is stopped (TERM, INT: the step under way is stopped too, and its row
# reads KILLED); killed outright, the rows written so far stay in $OUT/rows.txt.
# Without a usable GPU it stops at once: one line, exit status 2. Otherwise the exit status is 0 only if
# every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export JAX_PLATFORMS=cpu XLA_PYTHON_CLIENT_PREALLOCATE=false

# The reason CuPy cannot be used here (tests/run.py's own check, in a child process), or nothing.
why=$(timeout 20 "$PYTHON" -c 'import sys; sys.path.insert(0, "tests"); import run; print(run.check_backend("cupy") or "")' \
    2>&1 | tail -n 1)
if [[ -n $why ]]; then
    echo "tests/gpu_check.sh: no usable GPU here, nothing checked: $why" >&2
    exit 2
fi

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_mpi_yield_when_idle=1  # (two test steps side by side: waiting ranks give up their cores)
OUT=${OUT:-$(mktemp -d -t mpimesh-gpu-check.XXXXXX)}
mkdir -p "$OUT"
ROWS=$OUT/rows.txt
: > "$ROWS"
DEADLINE=$((SECONDS + ${GPU_CHECK_SECONDS:-270}))
STEPS=(tests-1rank tests-2ranks benchmark)
GPU_TESTS="tests/test_layers.py::test_one_kernel_layer_norm_on_a_gpu tests/test_nn.py::test_one_kernel_rows_on_a_gpu
           tests/test_einsum.py::test_sums_of_elementwise_products_take_multiply_and_sum_on_a_gpu
           tests/test_collectives_out.py::test_host_buffers_on_a_gpu_mesh_are_compared_by_numpy
           tests/test_fusion.py::test_fused_kernels_on_a_gpu
           tests/test_gemm.py tests/test_graphs.py tests/test_gpu_transports.py tests/test_gpu_memory_peak.py"

pytest_summary() {  # rank 0's pytest summary ("41 passed, 20 skipped in 30.2s"), or how far it got
    local summary
    summary=$(grep -E '[0-9]+ (passed|failed|error|skipped)' "$1" | grep -E ' in [0-9.]+s' | tail -n 1 | tr -d '=')
    if [[ -n ${summary// /} ]]; then
        echo $summary
    else  # (pytest -q's progress: a character per test)
        awk '/^[.FEsxX]+( +\[ *[0-9]+%\])?$/ { n += length($1); f += gsub(/[FE]/, "", $1) }
             END { print "no summary; " n + 0 " tests run, " f + 0 " failed" }' "$1"
    fi
}
key_tests-1rank() { pytest_summary "$1"; }
key_tests-2ranks() { pytest_summary "$1"; }
key_benchmark() {  # each precision's step time (mpimesh eager/PyTorch, compiled) and kernel share of the wall time
    awk '$1 == "precision" && $2 == "eager" { t = 1; next } $1 == "precision" && $2 == "step" { t = 2; next }
         t && NF < 9 { t = 0 }
         t == 1 && NF > 10 { s = s sep $1 " " $2 "/" $3 " ms (" $4 "x), compiled " $8 " ms (" $9 "x)"; sep = "; " }
         t == 2 { s = s sep $1 " " $2 " kernels " $5 " of " $3 " ms, " $7 " ops, " $8 " kernels" }
         /^\[[a-z0-9]+\] step \(median/ { got = got gsep $0; gsep = "; " }
         END { print (s != "" ? s : got != "" ? "no table; " got : "") }' "$1"
}

declare -A PID  # the steps under way
row() {  # row NAME STATUS BEGUN: NAME's row, appended to $ROWS (one short write: steps side by side may append)
    echo "$1|$2|$((SECONDS - $3))|$("key_$1" "$OUT/$1.log")" >> "$ROWS"
}

# start NAME SECONDS CMD...: CMD in the background for at most SECONDS (cut to what the budget leaves), its
# output into $OUT/NAME.log, its row written as it ends (TERM: CMD stopped, the row KILLED).
start() {
    local name=$1 limit=$2 left=$((DEADLINE - SECONDS - 5))
    shift 2
    ((limit > left)) && limit=$left
    ((limit < 1)) && limit=1
    echo "== $name (at most ${limit} s): $(printf '%q ' "$@")> $OUT/$name.log"
    (
        begun=$SECONDS
        timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.log" 2>&1 &
        child=$!
        trap 'kill -TERM $child 2> /dev/null; wait $child; row "$name" KILLED $begun; exit 143' TERM
        wait $child
        code=$?
        case $code in
            0) row "$name" PASS "$begun" ;;
            124 | 137) row "$name" TIMEOUT "$begun" ;;
            *) row "$name" "FAIL($code)" "$begun" ;;
        esac
    ) &
    PID[$name]=$!
}

finish() {  # finish NAME: wait for NAME's step to end
    wait "${PID[$1]}"
    unset "PID[$1]"
}

table() {  # the rows written so far; exit status 1 unless every step passed
    local name status seconds key passed=0
    echo
    printf '%-13s  %-9s  %7s  %s\n' step status seconds "key figure"
    while IFS='|' read -r name status seconds key; do
        printf '%-13s  %-9s  %7s  %s\n' "$name" "$status" "$seconds" "$key"
        [[ $status == PASS ]] && ((passed += 1))
    done < "$ROWS"
    echo "logs: $OUT"
    ((passed == ${#STEPS[@]}))
}

stopped() {  # TERM or INT: the steps under way stopped (their rows KILLED), the table
    trap - EXIT TERM INT
    local pid
    for pid in "${PID[@]}"; do
        kill -TERM "$pid" 2> /dev/null
    done
    for pid in "${PID[@]}"; do
        wait "$pid"
    done
    table
    exit 143
}
trap stopped TERM INT
trap 'table; exit $?' EXIT

# The test files (and file::test ids) to run: GPU_CHECK_TESTS or GPU_TESTS, less those whose top-level
# imports are missing here; none where the arguments name files of their own.
files=() named=
for a in "$@"; do
    [[ $a != -* && -e ${a%%::*} ]] && named=yes
done
if [[ -z $named ]]; then
    # shellcheck disable=SC2086
    mapfile -t files < <("$PYTHON" - ${GPU_CHECK_TESTS:-$GPU_TESTS} <<'PROBE'
import ast, importlib.util, os, sys


def missing(path, seen):  # the modules `path` and its helpers beside it import at their top, not installed here
    if path in seen:
        return set()
    seen.add(path)
    body = ast.parse(open(path).read()).body
    roots = {n.name.split(".")[0] for s in body if isinstance(s, ast.Import) for n in s.names}
    roots |= {s.module.split(".")[0] for s in body if isinstance(s, ast.ImportFrom) and s.level == 0 and s.module}
    out = set()
    for root in roots:
        helper = os.path.join(os.path.dirname(path), root + ".py")
        if os.path.exists(helper):
            out |= missing(helper, seen)
        elif not any(os.path.exists(os.path.join(d, root + ".py")) for d in ("apps", "benchmarks", "examples")) \
                and importlib.util.find_spec(root) is None:  # (the apps' modules: put on sys.path by the tests)
            out.add(root)
    return out


for target in sys.argv[1:]:
    path = target.split("::")[0]
    try:
        lost = missing(path, set())
    except (OSError, SyntaxError, UnicodeDecodeError):  # (a folder, or a file pytest will report on)
        lost = set()
    if lost:
        print(f"left out {path}: no module {', '.join(sorted(lost))} here", file=sys.stderr)
    else:
        print(target)
PROBE
    )
fi

# tests/run.py on RANKS ranks: a pytest that can end its session in time (pytest-timeout's
# --session-timeout) prints its summary; else the launcher's timeout ends it a little before `timeout` does.
session_timeout=$("$PYTHON" -m pytest --help 2> /dev/null | grep -q -- --session-timeout && echo yes)
tests() {  # tests RANKS SECONDS [pytest args]
    local ranks=$1 limit=$2 name=tests-$1rank$([[ $1 == 1 ]] || echo s)
    shift 2
    ((limit > DEADLINE - SECONDS - 5)) && limit=$((DEADLINE - SECONDS - 5))
    MPIMESH_TEST_RANKS=$ranks MPIMESH_TEST_TIMEOUT=$((limit > 40 ? limit - 20 : limit)) \
        start "$name" "$limit" "$PYTHON" tests/run.py --backend cupy -m "not slow" \
        ${session_timeout:+--session-timeout=$((limit > 60 ? limit - 35 : limit))} "$@" ${files[@]+"${files[@]}"}
}

if [[ -z $named && ${#files[@]} == 0 ]]; then  # (each file left out: tests/run.py would run all of tests/)
    for name in tests-1rank tests-2ranks; do
        echo "$name|NO FILES|0|every test file was left out" >> "$ROWS"
    done
else
    tests 1 140 "$@"
    tests 2 140 "$@"
    finish tests-1rank
    finish tests-2ranks
fi
BENCH_ARGS=${GPU_CHECK_BENCH_ARGS:---profile --precisions tf32,bf16 --steps 3 --warmup 1}
# shellcheck disable=SC2086
start benchmark 120 "$PYTHON" benchmarks/gpu.py $BENCH_ARGS
finish benchmark
