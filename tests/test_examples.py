"""The examples run from a fresh process with small arguments (aot_eager keeps compiling quick)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_compile_deepseek_layer_matches_eager_outputs_and_cache():
    out = run_example("compile_deepseek_layer.py", "--backend", "aot_eager", "--rounds", "3", "--batch", "3")
    diffs = dict(re.findall(r"(output|kv_c|k_pe) ([0-9.e+-]+)", out.split("max |diff|:")[1].splitlines()[0]))
    assert set(diffs) == {"output", "kv_c", "k_pe"} and all(float(v) < 1e-5 for v in diffs.values()), out
    assert "step time (median of 3): eager" in out


def test_generate_example_runs_graph_mode_without_recompiles():
    out = run_example("generate.py", "--backend", "aot_eager", "--capture-sizes", "1,2", "--max-new-tokens", "4")
    assert out.count("  -> [") == 3 and "recompiles 0" in out
    assert int(re.search(r"graph steps (\d+)", out).group(1)) > 0


def test_pd_example_decodes_the_prefill_processs_blocks_to_the_single_process_tokens():
    out = run_example("pd_disaggregation.py", "--capture-sizes", "1,2", "--max-new-tokens", "6", "--temperature", "0.8")
    assert "tokens equal to a single-process engine: True" in out and "recompiles 0" in out
    assert "eager steps 0" in out and "0 held" in out
