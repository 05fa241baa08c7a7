"""Several processes, one model: process groups over ``torch.distributed`` (``state``), the
collectives a captured step holds (``collectives``), and the decisions the ranks take together on
the host (``agreement``). Without ``init_parallel`` everything here is the single-process case.
"""

from .agreement import AgreementTimeout, RankFailure, agree, all_or_none, wait_within
from .collectives import all_gather, all_reduce, all_to_all, reduce_scatter
from .config import ParallelConfig
from .step_context import dp_padded_tokens, dp_step
from .state import (Group, ParallelState, adopt_parallel, backend_for, destroy_parallel, get_parallel_state, group_ranks,
                    init_parallel, local_size)

__all__ = [
    "AgreementTimeout", "Group", "ParallelConfig", "ParallelState", "RankFailure", "adopt_parallel", "agree",
    "all_gather", "all_or_none", "all_reduce", "all_to_all", "backend_for", "destroy_parallel", "dp_padded_tokens", "dp_step",
    "get_parallel_state", "group_ranks", "init_parallel", "local_size", "reduce_scatter", "wait_within",
]
