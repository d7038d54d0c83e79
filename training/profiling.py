"""The profiler (--profile, --profile_steps): its checks and the torch profiler over the chosen steps."""

from pathlib import Path

import torch

from common.errors import InputError

PROFILERS = ("pt", "pt-full", "hltv")


def parse_profile_steps(text: str) -> tuple[int, int]:
    try:
        start, end = (int(x) for x in text.split(","))
    except ValueError as err:
        raise InputError(f"--profile_steps must be 'start,end' (integers), got {text!r}") from err
    if not 0 <= start <= end:
        raise InputError(f"--profile_steps needs 0 <= start <= end, got {text!r}")
    return start, end


def check_profiler(kind: str | None, steps: str, use_hpu: bool) -> None:
    if kind is not None and kind not in PROFILERS:
        raise InputError(f"unknown --profile {kind!r}: choose one of {', '.join(PROFILERS)}")
    if kind == "hltv" and not use_hpu:
        raise InputError("--profile hltv is the Habana profiler: it needs --use_hpu (use pt or pt-full elsewhere)")
    parse_profile_steps(steps)


def build_profiler(kind: str | None, steps: str, results_dir: Path, use_hpu: bool,
                   no_cuda: bool) -> torch.profiler.profile | None:
    """torch profiler over the micro-steps `steps` ("start,end", inclusive), or None when kind is None."""
    if kind is None:
        return None
    start, end = parse_profile_steps(steps)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if use_hpu and hasattr(torch.profiler.ProfilerActivity, "HPU"):  # Habana's torch build
        activities.append(torch.profiler.ProfilerActivity.HPU)
    elif torch.cuda.is_available() and not no_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    trace_dir = Path(results_dir) / "profile"
    return torch.profiler.profile(
        # One warm-up step before the traced ones when there is one (the reference uses none).
        activities=activities, schedule=torch.profiler.schedule(wait=max(start - 1, 0), warmup=min(start, 1),
                                                                active=end - start + 1, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(str(trace_dir)), with_stack=kind == "pt-full")
