# Sourced by .ci/lowest_versions, .ci/verifiers and .ci/readme_install: their venv, built once and reused.
# `ci_venv NAME INSTALL [SCRIPT-ARGS]` builds "$VENV" by calling the script's function INSTALL, unless a finished
# build is there; with --install-only (how .ci/run builds the venvs while the tests run) the script stops after it.
# A build marks the venv twice: .ci-building first, .ci-installed last, so a half-built venv is recognised and built
# again; a folder with neither mark is not ours to delete (a developer's GRPO_CLI_*_VENV made another way): refused.
ci_venv() {
    local name=$1 install=$2
    shift 2
    if [ ! -e "$VENV/.ci-installed" ]; then
        if [ -e "$VENV" ] && [ ! -e "$VENV/.ci-building" ] && [ -n "$(ls -A "$VENV")" ]; then
            echo "$name: $VENV is not a venv .ci built (no .ci-building mark): remove it, or set its variable to a new path" >&2
            exit 1
        fi
        rm -rf "$VENV"
        mkdir -p "$VENV"
        touch "$VENV/.ci-building"
        "$install"
        touch "$VENV/.ci-installed"
    fi
    if [[ ${1:-} == --install-only ]]; then exit 0; fi
}
