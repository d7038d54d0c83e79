"""The reference's compile mode (torch.compile): its flags, their checks, compiling the engine's model, and the
log of the first step."""

import argparse
import os
from collections.abc import Callable
from typing import Any

from common.errors import InputError, one_line
from training import gaudi


def add_compile_arguments(group: argparse.ArgumentParser | argparse._ArgumentGroup,
                          compiles_lans: bool = False) -> None:
    """The compile-mode flags, on a parser or argument group (the same in every entry point). compiles_lans:
    the entry point's LANS update is compiled too (run_pretraining.py's; fine-tuning's AdamW is not)."""
    lans = " and, with inductor, the LANS update" if compiles_lans else ""
    group.add_argument("--enable_torch_compile", action="store_true", help="torch.compile the model (the "
                       f"reference's compile mode; on Gaudi with PT_HPU_LAZY_MODE=0){lans}. Checkpoints are the "
                       "same as in eager mode, so either mode resumes the other's.")
    group.add_argument("--torch_compile_backend", default=None, help="torch.compile backend with "
                       "--enable_torch_compile (default: the DeepSpeed accelerator's: hpu_backend on Gaudi, "
                       "inductor elsewhere).")
    group.add_argument("--torch_compile_mode", default=None, help="torch.compile mode with --enable_torch_compile, "
                       "e.g. max-autotune-no-cudagraphs (default: the backend's default).")


def check_compile_flags(enabled: bool, backend: str | None, mode: str | None, use_hpu: bool = False) -> None:
    """Before any work: the backend and mode flags need compile mode, and the mode must be one of inductor's;
    on Gaudi, compile mode needs lazy mode off (PT_HPU_LAZY_MODE=0): under lazy mode torch.compile would run
    beside the bridge's own lazy graphs and the driver's mark_step cuts, which is no mode of the reference's.
    The backend name is checked in compile_model: Gaudi's registers only once its bridge is imported."""
    if not enabled and (backend or mode):
        raise InputError("--torch_compile_backend and --torch_compile_mode need --enable_torch_compile")
    if enabled and use_hpu and gaudi.lazy_mode_requested():
        value = os.environ.get("PT_HPU_LAZY_MODE")
        now = "unset, read as lazy mode" if value is None else repr(value)
        raise InputError(f"--enable_torch_compile with --use_hpu needs Gaudi's compile mode, PT_HPU_LAZY_MODE=0 "
                         f"(here PT_HPU_LAZY_MODE is {now})")
    if mode is not None:
        import torch._inductor
        modes = sorted(torch._inductor.list_mode_options())
        if mode not in modes:
            raise InputError(f"--torch_compile_mode must be one of {', '.join(modes)}, got {mode!r}")


def compile_backend(backend: str | None) -> str:
    """The torch.compile backend of compile mode: --torch_compile_backend, else the DeepSpeed accelerator's;
    InputError when torch knows no such backend."""
    import torch._dynamo
    from deepspeed.accelerator import get_accelerator
    backend = backend or get_accelerator().get_compile_backend()
    try:
        torch._dynamo.lookup_backend(backend)
    except Exception as err:  # torch raises InvalidBackend, naming the registered ones
        raise InputError(f"--torch_compile_backend: {one_line(err)}") from err
    return backend


def compile_model(engine: Any, backend: str | None, mode: str | None) -> str:
    """torch.compile the engine's model in place (DeepSpeedEngine.compile calls nn.Module.compile): the
    module keeps its class and parameter names, so state_dict keys and checkpoints are those of eager mode
    (no `_orig_mod.` prefix). Compilation itself happens in the first forward and backward. Returns the
    backend used."""
    backend = compile_backend(backend)
    if backend == "inductor":
        # Dropout from torch's own generator, not inductor's: the same masks as eager mode, so losses match
        # and a checkpoint's RNG state resumes the same stream in either mode.
        import torch._inductor.config
        torch._inductor.config.fallback_random = True
    engine.compile(backend=backend, compile_kwargs={"mode": mode} if mode else {})
    return backend


def log_first_step(logger: Any, say: Callable[[str], None], seconds: float) -> None:
    """In compile mode the first step includes the compilation: its time goes to the log."""
    say(f"first step, compilation included: {seconds:.1f} s")
    logger.log(step="PARAMETER", data={"first_step_time_s": seconds})
