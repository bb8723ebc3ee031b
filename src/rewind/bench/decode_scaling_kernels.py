"""The CUDA kernel trace of `rewind bench decode-scaling` (part `kernels`): the developer probe
benchmarks/probes/decode_kernels.py run in a process of its own (torch must load before MLX),
its JSON read back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

# A developer probe outside the installed package: found in a checkout only.
KERNEL_PROBE = Path(__file__).resolve().parents[3] / "benchmarks" / "probes" / "decode_kernels.py"


def run_kernel_trace(folder: Path, out: Path, streams: list[int], prompt_tokens: int,
                     attention_cases: bool, timeout: float) -> dict[str, Any]:
    if not KERNEL_PROBE.exists():
        return {"error": f"no kernel probe at {KERNEL_PROBE} (it runs from a checkout)"}
    argv = [sys.executable, str(KERNEL_PROBE), "--model", str(folder),
            "--json", str(out), "--streams", *map(str, streams),
            "--prompt-tokens", str(prompt_tokens)]
    if not attention_cases:
        argv.append("--no-attention-cases")
    # The probe imports rewind: the same one as this process, installed or not.
    import rewind

    src = str(Path(rewind.__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": src + (os.pathsep + path if path else "")}
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    if done.returncode != 0 or not out.exists():
        return {"error": f"exit {done.returncode}", "log_tail": done.stderr[-3000:]}
    return json.loads(out.read_text())
