"""Learning-rate schedules with linear warm-up, driven by the optimizer's own step counter.

Each schedule is a pure function ``factor(t, ...) -> float`` of the 1-based optimizer step t that
will use the LR, with ``p = t / total_steps`` and warm-up fraction ``w``; the LR of a group is its
base LR (the group's ``lr`` when the scheduler was built) times the factor. All factors are 0 for
t > total_steps and never negative.

Step index rule: the LR applied by optimizer step number k (1-based) is base * f(k). The schedulers
read ``t = optimizer.param_groups[0]['step'] + 1`` when constructed and on every ``step()``,
so a freshly built scheduler sets f(1), and after k completed optimizer steps the LR is f(k + 1).
Reading the optimizer's counter (rather than counting ``step()`` calls) keeps the LR right after a
resume and under DeepSpeed, which calls ``step()`` once per optimizer step. This fixes the
reference, where the first two steps both ran with f(1) without ZeRO. For optimizers without a
group counter (torch's Adam and AdamW keep theirs per parameter) t counts the scheduler's own
``step()`` calls instead, which is the same number when ``step()`` follows every optimizer step;
the reference used a fixed step 1 there (its `schedulers.py`, Model-References 1.9.0 deepspeed-bert).

Differences from the reference (Habana deepspeed-bert ``schedulers.py``):
- every parameter group is updated, each from its own base LR;
- the polynomial and linear decays stop at 0 after ``total_steps`` (the reference goes negative);
- the cosine decay is ``0.5 * (1 + cos(pi * (p - w) / (1 - w)))`` after warm-up (1 at the end of
  warm-up, 0 at T); the reference computes ``0.5 * (1 + cos(pi + p))``, which is not a decay;
- the constant schedule also drops to 0 after ``total_steps``, like the others.
"""

import math
from typing import Any, Protocol


class ParamGroupOwner(Protocol):
    """What a schedule needs of its optimizer: the parameter groups (torch.optim.Optimizer has them)."""

    param_groups: list[dict[str, Any]]


def _validate(warmup: float, total_steps: int, constant: float = 0.0, degree: float = 1.0) -> None:
    if not (isinstance(total_steps, int) and total_steps > 0):
        raise ValueError(f"total_steps must be a positive int, got {total_steps!r}")
    if not 0.0 <= warmup <= 1.0:
        raise ValueError(f"warmup must be a fraction of total_steps in [0, 1], got {warmup}")
    if not 0.0 <= constant <= 1.0 - warmup:
        raise ValueError(f"constant must be in [0, 1 - warmup] = [0, {1.0 - warmup}], got {constant}")
    if degree <= 0.0:
        raise ValueError(f"degree must be > 0, got {degree}")


def poly_warmup_factor(t: int, total_steps: int, warmup: float, constant: float = 0.0,
                       degree: float = 1.0) -> float:
    """Linear warm-up to 1 over ``warmup * T`` steps, flat until ``(warmup + constant) * T``, then
    ``((1 - p) / (1 - warmup - constant)) ** degree`` down to 0 at T; 0 after T."""
    p = t / total_steps
    if p < warmup:
        return p / warmup
    if p < warmup + constant:
        return 1.0
    if p >= 1.0:
        return 0.0
    return float(((1.0 - p) / (1.0 - warmup - constant)) ** degree)  # float ** float is typed Any: it may be complex


def linear_warmup_factor(t: int, total_steps: int, warmup: float) -> float:
    """Linear warm-up, then linear decay to 0 at T (the polynomial schedule, degree 1, no plateau)."""
    return poly_warmup_factor(t, total_steps, warmup)


def constant_warmup_factor(t: int, total_steps: int, warmup: float) -> float:
    """Linear warm-up, then 1 until T; 0 after T."""
    p = t / total_steps
    if p > 1.0:
        return 0.0
    return p / warmup if p < warmup else 1.0


def cosine_warmup_factor(t: int, total_steps: int, warmup: float) -> float:
    """Linear warm-up, then half a cosine from 1 (end of warm-up) to 0 (T); 0 after T."""
    p = t / total_steps
    if p < warmup:
        return p / warmup
    if p >= 1.0:
        return 0.0
    return 0.5 * (1.0 + math.cos(math.pi * (p - warmup) / (1.0 - warmup)))


class WarmUpScheduler:
    """Base of the schedulers: sets every group's ``lr`` to ``base_lr * factor(t)``.

    Not a ``torch.optim.lr_scheduler.LRScheduler``: that class counts its own ``step()`` calls and
    wraps ``optimizer.step``; here the optimizer's counter is the single source of truth. Provides
    what DeepSpeed and the torch scheduler protocol use: ``step()``, ``get_lr()``,
    ``get_last_lr()``, ``state_dict()`` and ``load_state_dict()``.
    """

    def __init__(self, optimizer: ParamGroupOwner, warmup: float, total_steps: int):
        _validate(warmup, total_steps, **self._schedule_kwargs())
        self.optimizer = optimizer
        self.warmup = warmup
        self.total_steps = total_steps
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.last_step = 0
        self.step()

    def _schedule_kwargs(self) -> dict[str, float]:
        """Extra keyword arguments of the factor function (validated with the rest)."""
        return {}

    def factor(self, t: int) -> float:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        """The LRs for the next optimizer step, one per group."""
        scale = self.factor(self.last_step)
        return [base_lr * scale for base_lr in self.base_lrs]

    def get_last_lr(self) -> list[float]:
        return self.get_lr()

    def step(self) -> None:
        """Read the optimizer's step counter and set every group's LR for its next step."""
        counters = self.optimizer.param_groups[0]
        # torch's Adam/AdamW keep no group counter: then count our own step() calls instead.
        self.last_step = counters["step"] + 1 if "step" in counters else self.last_step + 1
        for group, lr in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
            group["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        """Plain ints/floats/lists only, so torch.load(weights_only=True) reads it."""
        return {"base_lrs": list(self.base_lrs), "last_step": self.last_step,
                "warmup": self.warmup, "total_steps": self.total_steps, **self._schedule_kwargs()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the schedule and base LRs (as torch's schedulers do); the optimizer's own state
        carries the step counter and current LRs."""
        expected = set(self.state_dict())
        if set(state_dict) != expected:
            raise ValueError(f"{type(self).__name__} state_dict keys {sorted(state_dict)} "
                             f"!= expected {sorted(expected)}")
        if len(state_dict["base_lrs"]) != len(self.optimizer.param_groups):
            raise ValueError(f"state_dict has {len(state_dict['base_lrs'])} base LRs for "
                             f"{len(self.optimizer.param_groups)} parameter groups")
        for key, value in state_dict.items():
            setattr(self, key, list(value) if key == "base_lrs" else value)
        _validate(self.warmup, self.total_steps, **self._schedule_kwargs())


class PolyWarmUpScheduler(WarmUpScheduler):
    """Warm-up, constant plateau, polynomial decay (the schedule the BERT-1.5B/5B runs use)."""

    def __init__(self, optimizer: ParamGroupOwner, warmup: float, total_steps: int, degree: float = 1.0,
                 constant: float = 0.0):
        self.degree = degree
        self.constant = constant
        super().__init__(optimizer, warmup, total_steps)

    def _schedule_kwargs(self) -> dict[str, float]:
        return {"constant": self.constant, "degree": self.degree}

    def factor(self, t: int) -> float:
        return poly_warmup_factor(t, self.total_steps, self.warmup, self.constant, self.degree)


class LinearWarmUpScheduler(WarmUpScheduler):
    def factor(self, t: int) -> float:
        return linear_warmup_factor(t, self.total_steps, self.warmup)


class ConstantWarmUpScheduler(WarmUpScheduler):
    def factor(self, t: int) -> float:
        return constant_warmup_factor(t, self.total_steps, self.warmup)


class CosineWarmUpScheduler(WarmUpScheduler):
    def factor(self, t: int) -> float:
        return cosine_warmup_factor(t, self.total_steps, self.warmup)
