#!/bin/bash
# bench/gpu.py on a machine with one NVIDIA GPU that has torch, transformers and peft but no package
# registry (docs/benchmarks.md §GPU). From the checkout's root:
#
#   bash bench/gpu.sh wheels      # here, with PyPI: the wheels bench/gpu.py needs beyond that image -> .whl/
#   bash bench/gpu.sh trl-wheels  # here too, for the row group trl: TRL and what it needs -> .whl-trl/
#   bash bench/gpu.sh [ARGS...]   # there, with .whl/ (and .whl-trl/) carried: installs them aside, runs
#                                 # python -m bench.gpu (with .whl-trl/, $TRL_SITE points at its site)
#
# Which wheels: bench/gpu-wheels.txt, the one list (<folder> <distribution>[==<version>]; no version:
# the one in this checkout's .venv, so pydantic_core matches pydantic). tests/test_gpu_wheels.py checks
# that it covers every distribution the benchmark imports that the image (bench/results-gpu/) lacks.
set -euo pipefail
PY=${PYTHON:-python3}
LIST=bench/gpu-wheels.txt

fetch() {  # fetch FOLDER: download the list's wheels for FOLDER into it (cp312 manylinux x86_64 or pure)
  local folder=$1 venv_py=${VENV_PY:-.venv/bin/python} spec name
  mkdir -p "$folder"
  rm -f "$folder"/*.whl  # a stale version beside the listed one would clash in pip --target
  for spec in $(sed 's/#.*//' "$LIST" | awk -v f="$folder" '$1 == f {print $2}'); do
    if [[ $spec != *==* ]]; then
      name=$spec
      spec="$name==$("$venv_py" -c "import importlib.metadata as m; print(m.version('$name'))")"
    fi
    "$venv_py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$folder" "$spec"
  done
  du -sh "$folder"
}

install_aside() {  # install_aside FOLDER SITE: pip --target, no index, no dependency resolution
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$2" "$1"/*.whl
}

case "${1:-}" in
  wheels) fetch .whl; exit 0 ;;
  trl-wheels) fetch .whl-trl; exit 0 ;;
esac

if compgen -G ".whl/*.whl" > /dev/null; then
  SITE="${TMPDIR:-/tmp}/bench-gpu-site"
  install_aside .whl "$SITE"
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
if compgen -G ".whl-trl/*.whl" > /dev/null && [ -z "${TRL_SITE:-}" ]; then
  export TRL_SITE="${TMPDIR:-/tmp}/bench-gpu-trl-site"
  install_aside .whl-trl "$TRL_SITE"
fi
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m bench.gpu "$@"
