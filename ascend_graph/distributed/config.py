"""How a model is spread over ranks: the tensor-, data- and expert-parallel sizes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor-, data- and expert-parallel layout (vLLM's flag names); the defaults are one process.

    Ranks are laid out tensor-parallel innermost: the TP groups are runs of consecutive ranks
    (``[0, 1], [2, 3]`` for TP=2, DP=2), the DP groups take one rank of each (``[0, 2], [1, 3]``).
    With ``enable_expert_parallel`` the experts are spread over all ``tp * dp`` ranks, as in vLLM.
    """

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelConfig: {name} must be an int >= 1, got {value!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError("ParallelConfig: enable_expert_parallel must be a bool, "
                             f"got {self.enable_expert_parallel!r}")

    @property
    def world_size(self) -> int:
        """The number of ranks this layout needs."""
        return self.tensor_parallel_size * self.data_parallel_size

    @property
    def expert_parallel_size(self) -> int:
        """The ranks the routed experts are spread over (1: every rank holds every expert)."""
        return self.world_size if self.enable_expert_parallel else 1
