"""Where each model parameter lies in DeepSpeed's ZeRO-1/2 flat fp32 partitions, from DeepSpeed's own
metadata; the LANS wiring (per-tensor blocks) and the checkpoint re-partitioning both read it here.

DeepSpeed 0.19.8 links every model parameter of a ZeRO-1/2 optimizer to the piece of this rank's flat
fp32 partition that holds it (``link_hp_params``): ``param._hp_mapping`` is None when this rank holds
none of it, else a ``tensor_fragment`` whose ``hp_fragment_address`` is (start, numel) in the
partition and ``lp_fragment_address`` the same piece's start in the flattened parameter. Both
optimizers that ZeRO-1/2 use on CPU keep the same shape of data: ``DeepSpeedZeroOptimizer``
(``bit16_groups`` / ``single_partition_of_fp32_groups``: fp32, and bf16 by default) and
``BF16_Optimizer`` (``bf16_groups`` / ``fp32_groups_flat_partition``: bf16 + ZeRO-1 with
``data_types.grad_accum_dtype: fp32``). ZeRO-0 has no partitions: :func:`group_partitions` is None.

:func:`planned_layout` computes the same layout from the parameter sizes and the world size alone, without a
process group (tests/test_zero_partitions.py compares it with a live engine's at several world sizes):
scripts/plan_zero_layout.py uses it for 128 devices.
"""

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist

from lans import AdaptiveMomentOptimizer, TensorSegments


class Fragment(NamedTuple):
    """The piece of one model parameter that this rank's partition holds."""
    param_index: int      # position of the parameter in its group (DeepSpeed's order, = tensor id)
    param: torch.Tensor   # the model parameter (training dtype)
    partition_start: int  # offset of the piece in the flat partition
    param_start: int      # offset of the piece in the flattened parameter
    numel: int


class GroupPartition(NamedTuple):
    """One param group on this rank: its flat fp32 partition (the client optimizer's parameter)."""
    flat: torch.Tensor
    params: list[torch.Tensor]  # every model parameter of the group, on all ranks together, in order
    fragments: list[Fragment]   # Fragment for each parameter this rank holds a piece of


class PlannedFragment(NamedTuple):
    """A Fragment as planned, without the tensor: the piece of parameter ``param_index`` that one rank holds."""
    param_index: int
    partition_start: int
    param_start: int
    numel: int


class GroupLayout(NamedTuple):
    """One param group cut into ``world_size`` equal partitions of ``partition_size`` values."""
    numels: tuple[int, ...]          # the group's parameter sizes, in order
    partition_size: int
    ranks: tuple[tuple[PlannedFragment, ...], ...]  # the fragments each rank holds, rank 0 first

    @property
    def padding(self) -> int:
        """Zeros after the last parameter, so that the flat group divides into aligned partitions."""
        return self.partition_size * len(self.ranks) - sum(self.numels)


# DeepSpeed 0.19.8 pads a group's flat buffer to a multiple of this times the world size, in both optimizers
# (``nccl_start_alignment_factor``: partitions start on 4 bytes for 2-byte elements), then cuts it into
# equal partitions. Parameters are not padded one by one (``zero_optimization.parameter_alignment``, off)
# nor reordered (``round_robin_gradients``, off): neither is set by this repository's configs.
ALIGNMENT_FACTOR = 2


def planned_layout(numels: Sequence[int], world_size: int) -> GroupLayout:
    """DeepSpeed's ZeRO-1/2 layout of one param group of parameters of ``numels`` values over ``world_size``
    data-parallel ranks: the parameters end to end, cut into equal partitions (see ALIGNMENT_FACTOR)."""
    alignment = ALIGNMENT_FACTOR * world_size
    partition_size = -(-sum(numels) // alignment) * alignment // world_size
    ranks: list[list[PlannedFragment]] = [[] for _ in range(world_size)]
    start = 0
    for index, numel in enumerate(numels):
        end = start + numel
        for rank in range(start // partition_size, -(-end // partition_size)):
            low, high = max(start, rank * partition_size), min(end, (rank + 1) * partition_size)
            ranks[rank].append(PlannedFragment(index, low - rank * partition_size, low - start, high - low))
        start = end
    return GroupLayout(tuple(numels), partition_size, tuple(tuple(fragments) for fragments in ranks))


_LAYOUTS = (("bit16_groups", "single_partition_of_fp32_groups"),  # DeepSpeedZeroOptimizer
            ("bf16_groups", "fp32_groups_flat_partition"))         # BF16_Optimizer


def group_partitions(engine_optimizer: object) -> list[GroupPartition] | None:
    """The GroupPartition of every param group, or None when the engine's optimizer partitions nothing
    (ZeRO-0: the client optimizer itself or a wrapper holding whole tensors)."""
    for params_attr, flat_attr in _LAYOUTS:
        if hasattr(engine_optimizer, params_attr) and hasattr(engine_optimizer, flat_attr):
            groups = zip(getattr(engine_optimizer, params_attr), getattr(engine_optimizer, flat_attr))
            return [GroupPartition(flat, list(params), _fragments(params)) for params, flat in groups]
    return None


def _fragments(params: Iterable[torch.Tensor]) -> list[Fragment]:
    fragments = []
    for index, param in enumerate(params):
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is not None:
            hp, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
            fragments.append(Fragment(index, param, hp.start, lp.start, hp.numel))
    return fragments


def tensor_segments(partitions: list[GroupPartition]) -> dict[torch.Tensor, TensorSegments]:
    """{flat partition: TensorSegments} for lans.AdaptiveMomentOptimizer.set_tensor_segments."""
    return {part.flat: TensorSegments(len(part.params), tuple((f.partition_start, f.numel, f.param_index)
                                                              for f in part.fragments))
            for part in partitions}


class DataParallelOptimizer(Protocol):
    """A DeepSpeed ZeRO optimizer (DeepSpeedZeroOptimizer, BF16_Optimizer), as far as this module reads it."""
    dp_process_group: dist.ProcessGroup


def data_parallel_sum(engine_optimizer: DataParallelOptimizer) -> Callable[[torch.Tensor], None]:
    """all_reduce_sum for the client optimizer: one all-reduce (SUM) over the data-parallel group."""
    group = engine_optimizer.dp_process_group

    def all_reduce_sum(tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)

    return all_reduce_sum


def use_tensor_blocks(engine_optimizer: DataParallelOptimizer, client_optimizer: AdaptiveMomentOptimizer) -> bool:
    """Make a LANS/NVLAMB client optimizer compute its norms per model tensor under ZeRO-1/2.
    Returns False (nothing to do) when nothing is partitioned: its blocks are whole tensors already."""
    partitions = group_partitions(engine_optimizer)
    if partitions is None:
        return False
    client_optimizer.set_tensor_segments(tensor_segments(partitions), data_parallel_sum(engine_optimizer))
    return True
