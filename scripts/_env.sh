# Shared by scripts/demo and scripts/test: create .venv if missing and install
# the project into it, with the extras the caller names in ZEPHON_EXTRAS (the
# demo: only what it runs; the tests: dev, which pulls every integration).
# Sourced, not executed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
EXTRAS="${ZEPHON_EXTRAS:-}"
# torch first, pinned, so that the open range in pyproject.toml takes the build
# installed here instead of the newest release of the index (which build a pin
# gets, CPU or CUDA, is the index's choice: see the README). Override with
# ZEPHON_TORCH_SPEC (e.g. "torch" to take whatever your index serves).
TORCH_SPEC="${ZEPHON_TORCH_SPEC:-torch==2.13.0}"
# One stamp per set of extras, so that each script installs its own once (the
# test environment is a superset of the demo's).
STAMP="$VENV/.zephon-installed${EXTRAS:+-$EXTRAS}"
# What the install depends on: its configuration, the C sources of the optional
# placement kernel (built in place by the editable install) and this script.
WANT="$(cat "$ROOT/pyproject.toml" "$ROOT/setup.py" "$ROOT"/zephon_torch/_native/*.c \
    "$ROOT/scripts/_env.sh" | sha256sum | cut -c1-16) $TORCH_SPEC"
if [ ! -x "$PY" ]; then
    echo "[zephon] creating virtual environment in .venv" >&2
    python3 -m venv "$VENV"
fi
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "[zephon] installing $TORCH_SPEC and the project${EXTRAS:+ [$EXTRAS]} (first run only)" >&2
    "$PY" -m pip install --quiet --upgrade pip setuptools wheel
    "$PY" -m pip install --quiet "$TORCH_SPEC"
    "$PY" -m pip install --quiet -e "$ROOT${EXTRAS:+[$EXTRAS]}"
    echo "$WANT" > "$STAMP"
fi
cd "$ROOT"
