# Shared by ci/setup_env.sh and ci/setup_bench_env.sh (sourced, not run): a virtual environment
# whose installation is redone only when a fingerprint of what it installs changes.
# The sourcing script sets VENV (where), STAMP (the fingerprint file), WANT (the fingerprint) and
# LABEL (its progress prefix), then: venv_is_current && exit 0; venv_create; pip_install ...; venv_done

venv_is_current() { [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; }

step() { echo "$LABEL [$(date +%H:%M:%S)]: $*"; }

venv_create() {  # Python >= 3.11 (PYTHON overrides), then the venv itself
  PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
  "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
    echo "$LABEL: Python >= 3.11 is required, $PYTHON is $("$PYTHON" --version 2>&1); set PYTHON=..." >&2; exit 2; }
  VENV_START=$(date +%s)
  step "virtual environment at $VENV"
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
}

pip_install() {  # pip into the venv, minus the noise of this machine's index settings; pip's status is kept
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@" 2>&1 | {
    grep -vE "is ignored: it is neither a file nor a directory|^sglang [0-9.]+ requires|dependency resolver does not currently" || true; }
}

venv_done() {
  echo "$WANT" > "$STAMP"
  step "done in $(( $(date +%s) - VENV_START )) s"
}
