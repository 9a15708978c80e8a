#!/bin/bash
# bench/gpu.py on a machine with one NVIDIA GPU that has torch, transformers and peft but no package
# registry (docs/benchmarks.md §GPU). Two steps, both from the checkout's root:
#
#   bash bench/gpu.sh wheels     # here, with PyPI: the pure/cp312 wheels that machine lacks -> .whl/ (~4 MB)
#   bash bench/gpu.sh [ARGS...]  # there, with .whl/ carried: installs them aside, runs python -m bench.gpu
#
# The wheels are pydantic and its helpers at the versions of this checkout's .venv (pydantic_core
# must match pydantic exactly); nothing else the benchmark imports is missing on a torch + transformers
# + peft image (tests/test_bench.py checks it never imports Prefect, DuckDB, MLflow, pandera, vLLM or Ray).
set -euo pipefail
PY=${PYTHON:-python3}
WHEELS=(pydantic pydantic_core annotated-types typing-inspection typing_extensions)

if [ "${1:-}" = "wheels" ]; then
  VENV_PY=${VENV_PY:-.venv/bin/python}
  mkdir -p .whl
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude  # never committed
  for name in "${WHEELS[@]}"; do
    version=$("$VENV_PY" -c "import importlib.metadata as m; print(m.version('$name'))")
    "$VENV_PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .whl "$name==$version"
  done
  du -sh .whl
  exit 0
fi

if compgen -G ".whl/*.whl" > /dev/null; then
  SITE="${TMPDIR:-/tmp}/bench-gpu-site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m bench.gpu "$@"
