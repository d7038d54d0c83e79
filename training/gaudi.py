"""Gaudi (HPU) lazy mode: where the training step cuts the graph, as Habana's reference does it.

Follows Model-References 1.9.0 (`PyTorch/nlp/pretraining/deepspeed-bert`, the last release in lazy mode and
the version our launchers mirror). In lazy mode (PT_HPU_LAZY_MODE=1) the bridge accumulates ops until
`htcore.mark_step()`; the reference calls it
- after every micro-batch's backward and after every engine.step();
- for the 5B only (memory workaround SW-109744): also just before and just after the loss, and in a
  backward hook of the LM head (the [tokens x 512040] logits and their gradient are the largest tensors).
"The 5B" is the reference's `args.bert_5b`: the --config_file path contains `bert_5b_config.json`.

Compile mode (PT_HPU_LAZY_MODE=0, the reference from 1.17 on) and every other device get no graph breaks:
there, nothing of this module imports or calls the Habana bridge. The environment of each mode is set by
the launchers (scripts/launch_common.sh, `hpu_environment`), before the bridge is first imported.
`lazy_mode_requested` is that environment's mode, for the checks that run before the bridge is imported;
`wait_for_device` is the HPU's synchronize for timings (hardware.py).
"""

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch

BERT_5B_CONFIG_NAME = "bert_5b_config.json"


def lazy_mode_requested(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether an HPU run of this process is in lazy mode, read from PT_HPU_LAZY_MODE before the bridge is
    imported (the bridge reads it at import): only "0" asks for compile (eager) mode.

    Unset, we assume lazy mode, as the launchers do (scripts/launch_common.sh): Habana's Runtime Flags table
    gives the default as 1 in the releases up to the 1.1x ones our launchers follow and as 0 in recent ones,
    and no check can ask the bridge which one it is before importing it. Assuming lazy errs on the side of
    refusing compile mode, which costs a rerun with PT_HPU_LAZY_MODE=0; assuming compile mode would let
    torch.compile run under lazy mode."""
    return environ.get("PT_HPU_LAZY_MODE", "1") != "0"


def is_bert_5b(config_file: str | os.PathLike[str]) -> bool:
    """The reference's test for the 5B workarounds (it looks at the config file's name, not the sizes)."""
    return BERT_5B_CONFIG_NAME in str(config_file)


class NoGraphBreaks:
    """Compile or eager mode, and any device other than an HPU: the step runs as written."""

    @contextmanager
    def around_loss(self) -> Iterator[None]:
        yield

    def after_backward(self) -> None:
        pass

    def after_step(self) -> None:
        pass


class LazyModeGraphBreaks(NoGraphBreaks):
    """mark_step where the reference (1.9.0) puts it; `bert_5b` adds its memory cuts. The LM head's
    backward hook is registered on `model.cls.predictions` here."""

    def __init__(self, model: torch.nn.Module, bert_5b: bool) -> None:
        import habana_frameworks.torch.core as htcore
        self.mark_step, self.bert_5b = htcore.mark_step, bert_5b
        if bert_5b:
            # The reference uses the legacy register_backward_hook; the full hook fires once the head's
            # input gradient is complete, which is the same cut between the head and the encoder.
            model.get_submodule("cls.predictions").register_full_backward_hook(
                lambda module, grad_input, grad_output: self.mark_step())

    @contextmanager
    def around_loss(self) -> Iterator[None]:
        if self.bert_5b:
            self.mark_step()
        yield
        if self.bert_5b:
            self.mark_step()

    def after_backward(self) -> None:
        self.mark_step()

    def after_step(self) -> None:
        self.mark_step()


def wait_for_device() -> None:
    """Block until the HPU has run the ops queued so far (for timing them). In lazy mode the bridge only
    records ops until mark_step, so cut first: a wait without it would time the recording, not the work."""
    import habana_frameworks.torch.core as htcore
    import habana_frameworks.torch.hpu as hpu
    from habana_frameworks.torch.utils.internal import is_lazy
    if is_lazy():
        htcore.mark_step()
    hpu.synchronize()


def graph_breaks(device: torch.device, model: torch.nn.Module, bert_5b: bool) -> NoGraphBreaks:
    """The step's graph breaks for this device and mode: lazy-mode mark_steps on an HPU in lazy mode (the
    bridge says which mode it runs in), none anywhere else."""
    if device.type != "hpu":
        return NoGraphBreaks()
    from habana_frameworks.torch.utils.internal import is_lazy
    return LazyModeGraphBreaks(model, bert_5b) if is_lazy() else NoGraphBreaks()
