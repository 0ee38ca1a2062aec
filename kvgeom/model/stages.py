"""Pipeline-parallel stages: which decoder layers each stage of an engine holds.

With pipeline parallelism (PP) an engine's decoder layers are cut into ``pp_size`` contiguous stages;
every rank of stage ``s`` holds the KV cache and state of that stage's layers only, while the scheduler
(one per engine) gives a request one block list per KV-cache group, shared by all stages. vLLM splits
``L`` layers evenly (``L // pp_size`` per stage) and hands the remainder ``L % pp_size`` out one layer
each to the stages before the last, starting from the second-to-last (the first and last stages also
hold the embeddings, so they get an extra layer last). Example: 10 layers over 4 stages -> 2, 3, 3, 2.
"""

from __future__ import annotations

from kvgeom.errors import ConfigError
from kvgeom.model.layers import Layer
from kvgeom.model.spec import ModelSpec

__all__ = ["stage_partition", "stage_range", "stage_layers"]


def stage_partition(num_layers: int, pp_size: int) -> tuple[int, ...]:
    """Decoder layers per stage (vLLM ``get_pp_indices`` without an explicit partition)."""
    if num_layers < 1 or pp_size < 1:
        raise ConfigError(
            "pp_size",
            f"{num_layers} layers cannot be split over {pp_size} stages",
            value=pp_size,
            expected=num_layers,
        )
    base, extra = divmod(num_layers, pp_size)
    sizes = [base] * pp_size
    for i in range(2, extra + 2):
        sizes[-i] += 1
    return tuple(sizes)


def stage_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """``[start, end)`` decoder layers of stage ``pp_rank``."""
    sizes = stage_partition(num_layers, pp_size)
    if not 0 <= pp_rank < pp_size:
        raise ConfigError("pp_rank", f"{pp_rank} is outside [0, {pp_size})", value=pp_rank, expected=pp_size)
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


def stage_layers(model: ModelSpec, pp_rank: int, pp_size: int) -> tuple[Layer, ...]:
    """The cache-holding layers stage ``pp_rank`` holds (those whose decoder index lies in its range)."""
    if pp_size == 1:
        return model.layers
    start, end = stage_range(model.num_hidden_layers, pp_rank, pp_size)
    return tuple(layer for layer in model.layers if start <= layer.index < end)
