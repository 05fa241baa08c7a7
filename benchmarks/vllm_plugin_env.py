"""Making a checkout's vLLM plugin visible to a vLLM venv's python, without installing it there.

vLLM finds general plugins through the ``vllm.general_plugins`` entry point group of the
installed distributions. ``plugin_path(dir)`` writes a minimal ``dist-info`` declaring the entry
point ``pyproject.toml`` declares (``ascend_graph = ascend_graph.vllm:register``) into ``dir``;
with ``dir`` and a checkout's root on ``PYTHONPATH`` (``pythonpath``), that python imports the
checkout's ``ascend_graph`` and vLLM runs its plugin in every process it starts.
"""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIST_INFO = "ascend_graph-0.1.0.dist-info"
ENTRY_POINTS = "[vllm.general_plugins]\nascend_graph = ascend_graph.vllm:register\n"


def plugin_path(directory: str) -> str:
    """Write the entry point's ``dist-info`` under ``directory`` (once); return ``directory``."""
    dist = os.path.join(directory, DIST_INFO)
    os.makedirs(dist, exist_ok=True)
    with open(os.path.join(dist, "METADATA"), "w", encoding="utf-8") as f:
        f.write("Metadata-Version: 2.1\nName: ascend-graph\nVersion: 0.1.0\n")
    with open(os.path.join(dist, "entry_points.txt"), "w", encoding="utf-8") as f:
        f.write(ENTRY_POINTS)
    return directory


def pythonpath(directory: str, root: str = ROOT) -> str:
    """A ``PYTHONPATH`` of the checkout at ``root`` and the entry point written under ``directory``."""
    return os.pathsep.join([os.path.abspath(root), plugin_path(directory)])
