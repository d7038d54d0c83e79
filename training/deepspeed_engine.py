"""The DeepSpeed engine: `initialize_engine` (deepspeed.initialize with a client optimizer and scheduler, the JSON
read and checked by common/deepspeed_config.py), the guard against its zero-gradient step, and its teardown.
DeepSpeed is imported lazily: it picks its accelerator on first import (training/device_setup.py)."""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


@contextmanager
def optimizer_step_suppressed(optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
    """Within this block optimizer.step() does nothing (weights, moments and step counters untouched).

    Used (a) around deepspeed.initialize, where bf16 + ZeRO-0 wraps the optimizer in
    FP16_UnfusedOptimizer, which takes one zero-gradient step (it would apply weight decay and
    shift LANS's step count, and with it the LR schedule); (b) around engine.step() for a step whose
    loss is not finite, so that DeepSpeed's bookkeeping runs but the update does not."""
    if optimizer is None:
        yield
        return
    # the instance's step shadows the class's until the del below
    optimizer.step = lambda closure=None: None  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        del optimizer.step


def initialize_engine(model: torch.nn.Module, ds_config: dict[str, Any], optimizer: torch.optim.Optimizer | None = None,
                      scheduler: Any = None, parameter_groups: Any = None) -> tuple[Any, Any]:
    """deepspeed.initialize with a client optimizer and scheduler (None: the JSON's, over
    parameter_groups); returns (engine, the optimizer that steps: the client's or DeepSpeed's)."""
    import deepspeed
    with optimizer_step_suppressed(optimizer):
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                               model_parameters=None if optimizer else parameter_groups,
                                               config=ds_config)
    return engine, optimizer or engine.optimizer


@contextmanager
def destroyed_on_exit(engine: Any) -> Iterator[Any]:
    """engine.destroy() when the block ends without an error. Trap: under bf16 or ZeRO-1/2, DeepSpeed's
    optimizer registers gradient-accumulation hooks on the parameters that refer back to it; until destroy()
    removes them the engine, the model and the optimizer states stay reachable after the caller returns
    (tens of MiB per tiny run in one process, measured with gc). Not after an error: ZeRO's destroy() synchronizes
    the device, which after a failed collective on a GPU can wait on it, and a failed run's process ends."""
    yield engine
    engine.destroy()
