"""The graph runner (per-size graphs, padding, static inputs, fallback, counters) and parity."""

from .graph_runner import GraphCompileError, GraphCompileWarning, GraphRunner, RecompileError, RunnerStats, SequenceStep
from .parity import ParityReport, compare_step

__all__ = ["GraphCompileError", "GraphCompileWarning", "GraphRunner", "ParityReport", "RecompileError", "RunnerStats",
           "SequenceStep", "compare_step"]
