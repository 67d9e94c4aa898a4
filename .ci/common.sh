# shellcheck shell=bash
# Shared by .ci/run, .ci/canary and .ci/refresh_pins (sourced, not run): which Python, timed steps, fresh venvs.

distribution_python() {  # /usr/bin/python3 if its prefix is /usr (a distribution's build)
    [[ -x /usr/bin/python3 ]] && [[ $(/usr/bin/python3 -I -c 'import sys; print(sys.prefix)' 2>/dev/null) == /usr ]] &&
        echo /usr/bin/python3
}

ci_python() {  # $PYTHON as an absolute path; by default what a new user's python3 is (see .ci/run)
    local name=${PYTHON:-$(distribution_python || echo python3)}
    command -v "$name" || { echo "[ci] no Python '$name'" >&2; return 1; }
}

step() {  # step NAME CMD...: run CMD, print how long it took; returns CMD's status (under set -e a failure stops)
    local name=$1 t=$SECONDS rc=0
    shift
    echo "[ci] $name: $*"
    "$@" || rc=$?  # (not plain "$@": set -e is off inside a function called from `step ... || ...`)
    echo "[ci] $name took $((SECONDS - t)) s$( ((rc == 0)) || echo ", FAILED (exit $rc)")"
    return "$rc"
}

new_venv() {  # new_venv PYTHON DIR: a fresh venv with the newest pip in DIR, made as install.py makes one:
    # where the distribution left out ensurepip (Debian without python3-venv), without pip, then pip
    # installed into it by the system's pip.
    local python=$1 dir=$2
    rm -rf "$dir"
    if ! "$python" -m venv "$dir" >/dev/null 2>&1; then
        step venv "$python" -m venv --clear --without-pip "$dir"
        step pip-into-venv "$python" -m pip --python "$dir/bin/python" install -q pip
    fi
    step pip "$dir/bin/python" -m pip install -q --upgrade pip
}

use_venv() {  # use_venv DIR: as if DIR were activated (exports VIRTUAL_ENV, its bin/ first on PATH)
    VIRTUAL_ENV=$(cd "$1" && pwd)
    PATH="$VIRTUAL_ENV/bin:$PATH"
    export VIRTUAL_ENV PATH
}
