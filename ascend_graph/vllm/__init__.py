"""ascend_graph as a vLLM plugin: graph mode switched on by vllm-ascend's flag on vLLM's CPU
platform (docs/vllm.md).

``register`` is the ``vllm.general_plugins`` entry point; vLLM calls it once in every
process. It is inert unless ``LLM(..., additional_config=...)`` holds
``torchair_graph_config`` or ``ascend_graph``, and on any platform but CPU it leaves
``torchair_graph_config`` to that platform's plugin (our own section there is an error).
``runner_stats(llm)`` reads the runner's counters from the LLM's workers (``per_worker=True``: each one's). vLLM is imported
only inside these functions: importing ``ascend_graph`` or this package never imports it.
"""

from __future__ import annotations

from typing import Any

from .flags import ARCHITECTURES, OWN_SECTION, has_flag, parse_additional_config

__all__ = ["ARCHITECTURES", "OWN_SECTION", "has_flag", "parse_additional_config", "register", "runner_stats"]


def register() -> None:
    """Register our model classes (lazily, by name) and the flag's check; safe to call repeatedly."""
    from .plugin import install

    install()


def runner_stats(llm: Any, per_worker: bool = False) -> dict | list[dict]:
    """The ``RunnerStats.to_dict()`` counters of ``llm``'s graph runner, read from its workers:
    the first worker's (tensor-parallel workers run the same steps), or, with ``per_worker``,
    one dict per worker in rank order (``plugin.runner_stats``)."""
    from .plugin import runner_stats as read

    return read(llm, per_worker)
