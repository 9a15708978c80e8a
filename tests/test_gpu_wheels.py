"""bench/gpu-wheels.txt carries what the lent GPU image lacks: the quick GPU benchmark runs with every
other distribution refused, as on that image (bench/results-gpu/image-packages.txt).

No network, no GPU: the run is the CPU --quick one, in a fresh interpreter whose imports from the
project or a carried wheel of a distribution neither on the image nor in the list fail as there."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
IMAGE_LIST = REPO / "bench" / "results-gpu" / "image-packages.txt"
WHEEL_LIST = REPO / "bench" / "gpu-wheels.txt"
# iteration and lora import everything the trainer and generate rows import (checked once with
# sys.modules dumps), plus the rollout, rewards, LoRA and checkpoint modules; about 5 s of rows
ROWS = "iteration,lora"

# Runs in the child: a meta-path finder and an importlib.util.find_spec wrapper that answer "absent"
# for a distribution outside ALLOWED when the importer is this project or a carried distribution
# (the image's own distributions bring their own dependencies, at the image's versions, so their
# imports are let through), then the benchmark. Refusals are printed: optional imports (e.g.
# jsonschema's format checkers) may be refused and the run still pass, as on the image.
PROGRAM = r'''
import importlib.metadata, importlib.util, json, re, sys
allowed, carried, own = (set(json.loads(a)) for a in sys.argv[1:4])
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
owners = {top: {norm(d) for d in dists} for top, dists in importlib.metadata.packages_distributions().items()}
refused, real_find_spec = set(), importlib.util.find_spec

def importer(frame):
    while frame is not None:  # the first frame not importlib's, the stdlib's or this program's
        top = frame.f_globals.get("__name__", "").partition(".")[0]
        if (not frame.f_code.co_filename.startswith("<frozen") and top not in sys.stdlib_module_names
                and frame.f_globals is not globals()):
            return top
        frame = frame.f_back
    return ""

def refuse(name, frame):
    top = name.partition(".")[0]
    if top in sys.stdlib_module_names or top in own or top not in owners or owners[top] & allowed:
        return False
    by = importer(frame)
    if by not in own and not owners.get(by, set()) & carried:
        return False
    refused.add(f"{top} ({', '.join(sorted(owners[top]))}; imported by {by})")
    return True

class Image:
    def find_spec(self, name, path=None, target=None):
        if refuse(name, sys._getframe(1)):
            raise ModuleNotFoundError(f"No module named {name!r} (not on the GPU image)", name=name)

def find_spec(name, package=None):
    return None if refuse(name, sys._getframe(1)) else real_find_spec(name, package)

sys.meta_path.insert(0, Image())
importlib.util.find_spec = find_spec
try:
    from bench import gpu
    code = gpu.main(sys.argv[4:])
finally:
    used = {norm(d) for m in list(sys.modules) for d in owners.get(m.partition(".")[0], ())} & carried
    print("REFUSED", json.dumps(sorted(refused)), "USED", json.dumps(sorted(used)))
sys.exit(code)
'''


def normalise(name: str) -> str:
    """A distribution's name as pip compares them: lower case, runs of -_. as one '-'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def image_distributions() -> set[str]:
    return {normalise(line) for line in IMAGE_LIST.read_text().split() if line}


def listed(folder: str) -> dict[str, str | None]:
    """bench/gpu-wheels.txt's entries for `folder`: normalised name -> pinned version (None: .venv's)."""
    found = {}
    for line in WHEEL_LIST.read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) == 2 and fields[0] == folder:
            name, _, version = fields[1].partition("==")
            found[normalise(name)] = version or None
    return found


def test_the_lists_name_what_gpu_sh_can_fetch():
    image, bench, trl = image_distributions(), listed(".whl"), listed(".whl-trl")
    assert {"torch", "transformers", "peft", "numpy"} <= image and "pydantic" not in image
    assert {"pydantic", "pydantic-core", "bm25s", "jsonschema", "rpds-py"} <= set(bench)
    for name, version in bench.items():  # no version: gpu.sh takes .venv's, so it must be installed here
        assert version or importlib.metadata.version(name), name
    assert trl.get("trl") == "1.16.0" and "datasets" in trl
    assert all(trl.values()), f"pin every .whl-trl wheel: {trl}"


@pytest.mark.slow  # imports the whole GPU bench in a fresh interpreter (~15-20 s)
def test_every_distribution_the_gpu_bench_imports_is_on_the_image_or_carried(tmp_path):
    image, carried = image_distributions(), set(listed(".whl"))
    own = ["__main__", "agent_core", "bench", "schemas", "tasks", "flows", "configs"]
    args = [json.dumps(sorted(image | carried)), json.dumps(sorted(carried)), json.dumps(own),
            "--quick", "--only", ROWS, "--out", str(tmp_path / "gpu.json")]
    done = subprocess.run([sys.executable, "-c", PROGRAM, *args], capture_output=True, text=True, timeout=300,
                          cwd=REPO)
    report = done.stdout.rsplit("REFUSED", 1)[-1]
    assert done.returncode == 0, (f"with only the image's distributions and bench/gpu-wheels.txt's .whl ones, "
                                  f"the quick GPU bench failed; refused: {report}\n{done.stderr[-2000:]}")
    used = set(json.loads(report.split("USED", 1)[1]))
    assert {"pydantic", "bm25s", "jsonschema", "rpds-py"} <= used, used
