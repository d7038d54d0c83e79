"""The fine-tuning layer that run_glue.py and run_squad.py share: weights, tokenizer, the DeepSpeed training
loop and the prediction loop (their common flags and typed Config: finetune/flags.py). The task scripts keep
their data, heads' losses, metrics and outputs.

Interface, in the order an entry point's main() calls it:

    parser, groups = flags.build_parser("...", usage)  # finetune/flags.py: common flags (NVIDIA's names) in
                                                 # their groups; add the task's own to groups["data"], ...
    args = flags.parse_arguments(parser, argv)  # picks the accelerator before DeepSpeed is imported
    config = flags.build_config(args, GlueConfig)  # the entry point's Config subclass, with its own flags:
                                                 # common checks + the DeepSpeed settings; InputError
    model_config, weights = finetuning.load_pretrained(config.init_checkpoint, config.config_file)  # any source
    tokenizer = finetuning.load_tokenizer(config.vocab_file, config.do_lower_case, model_config)  # vocab == model's
    make_model = lambda model_config: BertForSequenceClassification(model_config, 2)  # the task's head model
    finetuning.check_weights(make_model, model_config, weights, fine_tune=config.do_train)  # before any output
    session = finetuning.start(config, "run_glue", job)  # device, process group, seed + rank, dllogger
    model = finetuning.build_model(make_model, model_config, weights, session,
                                   fine_tune=config.do_train)  # built under --seed on every rank
    summary = finetuning.train_then_evaluate(session, model, features, loss_fn, evaluate)
    #   = train(session, model, features, loss_fn)  (DeepSpeed; resume; SIGTERM -> checkpoint), then, unless
    #     stopped, evaluate(), which calls predict(session, model, features, batch_size, forward_fn); logged

- features: dict name -> tensor [N, ...] (all the same N); a batch is the same dict cut to B rows, on the
  device. loss_fn(engine, batch) -> scalar loss (the DeepSpeed engine, called like the model);
  forward_fn(model, batch) -> tensor or tuple of tensors [B, ...] (called under torch.no_grad, eval mode).
- train() mutates `model` (the engine's module) and returns {"e2e_train_time", "training_sequences_per_second",
  "final_loss", "global_step", "stopped_by_signal"}; "stopped_by_signal": the run saved a checkpoint in
  <output_dir>/checkpoints on SIGTERM/SIGINT and a rerun with --resume_from_checkpoint continues it exactly.
  Unless --skip_checkpoint, the final weights are a checkpoint there too (`--init_checkpoint <output_dir>/
  checkpoints` evaluates it later; `python -m training.checkpointing export` and
  `python -m finetune.hf_interop export` read it).
- predict() returns, on every rank, a tuple of float32 CPU tensors [N, ...] in the order of `features`
  (each rank computes every world-th batch; the pieces are gathered).
- Batches: the global batch is train_micro_batch_size_per_gpu x gradient_accumulation_steps x ranks, taken
  in a seeded permutation per epoch; the incomplete last global batch of an epoch is dropped. One rank
  with 2 accumulation steps sees the same samples per step as two ranks with one.
"""

import hashlib
import importlib
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from common import storage
from common.errors import InputError
from finetune.flags import CHECKPOINT_SUBDIR, Config, checkpoint_dir
from finetune.hf_interop import StateDict, read_config_file, read_pretrained_weights
from modeling import BertConfig, BertForQuestionAnswering, BertForTokenClassification, BertPreTrainedModel
from optimization import get_parameter_groups
from schedulers import LinearWarmUpScheduler
from training import (
    checkpoint_resume,
    checkpoint_s3,
    checkpointing,
    command_line,
    compile_mode,
    deepspeed_engine,
    device_setup,
    distributed,
    init_weights,
    logs,
    progress_display,
    schedule_resume,
)

if TYPE_CHECKING:  # deepspeed is imported only after device_setup.choose_accelerator has picked the device
    import dllogger
    from deepspeed import DeepSpeedEngine
    from tokenizers import Tokenizer

# A task's tensors: name -> [N, ...], all of the same N (a batch: the same names, B rows, on the device).
Features: TypeAlias = dict[str, torch.Tensor]
# loss_fn(engine, batch) -> scalar loss; the DeepSpeed engine is called like the model.
LossFn: TypeAlias = Callable[["DeepSpeedEngine", Features], torch.Tensor]
# forward_fn(model, batch) -> a tensor or a tuple of tensors [B, ...].
ForwardFn: TypeAlias = Callable[[nn.Module, Features], torch.Tensor | tuple[torch.Tensor, ...]]
Model = TypeVar("Model", bound=BertPreTrainedModel)

POOLER_PREFIX = "bert.pooler."
# Heads that never read the pooler's output: a checkpoint without a pooler (transformers' QA and MLM saves)
# evaluates them as it is.
POOLER_UNUSED = (BertForQuestionAnswering, BertForTokenClassification)


def load_pretrained(init_checkpoint: str | Path | None,
                    config_file: str | Path | None) -> tuple[BertConfig, StateDict | None]:
    """(BertConfig, weights or None): from init_checkpoint (--init_checkpoint, any weight source; checked
    against config_file, --config_file, if given), else config_file with fresh weights."""
    if init_checkpoint is None:
        assert config_file is not None  # build_config refuses a run with neither
        return read_config_file(config_file), None
    if storage.is_s3_url(str(init_checkpoint)):
        with tempfile.TemporaryDirectory(prefix="init-checkpoint-") as local:
            return read_pretrained_weights(fetch_s3_checkpoint(str(init_checkpoint), Path(local)), config_file)
    return read_pretrained_weights(init_checkpoint, config_file)


def fetch_s3_checkpoint(url: str, local: Path) -> Path:
    """The checkpoint of a run_pretraining.py s3:// output (the one resume would use) or of one tag of it
    (s3://bucket/prefix/<tag>), downloaded and verified into `local`; returns its tag directory."""
    try:
        tag = checkpoint_s3.fetch_checkpoint(storage.S3Store(url), local)
        if tag is None:  # not a run's prefix: the URL may name one tag of it
            parent, _, tag = url.rstrip("/").rpartition("/")
            checkpoint_s3.fetch_checkpoint(storage.S3Store(parent), local, tag)  # CheckpointError without it
    except (storage.StorageError, checkpointing.CheckpointError) as err:
        raise InputError(f"--init_checkpoint {url}: {err}") from err
    return local / tag


def load_tokenizer(vocab_file: str, do_lower_case: bool, config: BertConfig) -> "Tokenizer":
    """The WordPiece tokenizer of vocab_file (--vocab_file); its size must be the model's vocab_size."""
    from data.tokenization import load_tokenizer as load
    tokenizer, vocab_size, _ = load(vocab_file, do_lower_case)
    if vocab_size != config.vocab_size:
        raise InputError(f"--vocab_file {vocab_file} has {vocab_size} tokens, but the model has "
                         f"vocab_size {config.vocab_size}: use the pretrained model's vocab")
    return tokenizer


# ============================================================================ session, model

@dataclass(frozen=True, kw_only=True)
class Session:
    """A started run: device, process group, dllogger, and the Config that train() and predict() follow."""
    config: Config
    device: torch.device
    rank: int
    world: int
    logger: "dllogger.Logger"  # logs.build_logger's
    say: Callable[[str], None]  # prints on rank 0, nothing elsewhere
    progress_bar: bool  # rank 0 without --disable-progress-bar

    @property
    def output_dir(self) -> Path:
        return Path(self.config.output_dir)


def start(config: Config, name: str, job: distributed.Job | None = None) -> Session:
    """Device and process group, seed + rank, dllogger (rank 0) with the run's parameters. job: run_cli's
    (default: a new one)."""
    device = distributed.setup_device_and_distributed(job if job is not None else distributed.Job(), config.use_hpu,
                                                      config.no_cuda, config.local_rank, ds_config=config.ds_config)
    rank, world = dist.get_rank(), dist.get_world_size()
    device_setup.seed_everything(config.seed + rank)
    # A resumed run adds to the interrupted one's records, as run_pretraining.py does.
    logger = logs.build_logger(config.json_summary, rank, append=config.resume_from_checkpoint)
    logger.log(step="PARAMETER", data={"Config": str(config.flags()), "SEED": config.seed,
                                       "deepspeed_config": config.ds_config})
    Path(config.output_dir).mkdir(parents=True, exist_ok=True)
    say = (lambda text: print(f"[{name}] {text}", flush=True)) if rank == 0 else (lambda text: None)
    return Session(config=config, device=device, rank=rank, world=world, logger=logger, say=say,
                   progress_bar=rank == 0 and not config.disable_progress_bar)


def check_weights(make_model: Callable[[BertConfig], nn.Module], config: BertConfig, weights: StateDict | None, *,
                  fine_tune: bool) -> None:
    """build_model's checks of `weights` (InputError), before the run writes anything: the model is built on
    the meta device (names and shapes, no memory, no random numbers)."""
    if weights is None:
        return
    with torch.device("meta"):
        model = make_model(config)
    _check_fit(model, config, weights, fine_tune=fine_tune)


def _check_fit(model: nn.Module, config: BertConfig, weights: StateDict, *, fine_tune: bool) -> None:
    """Every encoder weight (bert.*) of `model` is in `weights` with its shape, and nothing else of bert.*;
    the task head (and the pooler it reads) only when not fine_tune. InputError otherwise."""
    own = model.state_dict()
    pooler = sorted(key for key in own if key.startswith(POOLER_PREFIX))
    pooler_absent = bool(pooler) and not any(key in weights for key in pooler)  # as in a QA or MLM save
    encoder = [key for key in own if key.startswith("bert.") and not (pooler_absent and key in pooler)]
    missing = sorted(key for key in encoder if key not in weights)
    unknown = sorted(key for key in weights if key.startswith("bert.") and key not in own)
    wrong = sorted(key for key in own if key in weights and weights[key].shape != own[key].shape)
    head_wrong = [key for key in own if key in wrong and not key.startswith("bert.")]  # in the model's order
    if head_wrong and len(head_wrong) == len(wrong):  # the encoder fits: the head is another task's
        key = head_wrong[0]
        raise InputError(f"--init_checkpoint's task head does not fit this task's: {key} "
                         f"{list(weights[key].shape)} in the checkpoint, {list(own[key].shape)} in the model "
                         f"(a head for another number of labels or outputs)")
    if wrong:  # the encoder's tensors only: the head is the task's
        misfit = init_weights.describe_misfit({key: own[key] for key in encoder},
                                              {key: value for key, value in weights.items() if key.startswith("bert.")})
        raise InputError(f"--init_checkpoint does not fit the model config (hidden {config.hidden_size}, "
                         f"{config.num_hidden_layers} layers): {misfit}")
    if missing or unknown:
        raise InputError(f"--init_checkpoint does not hold this model's encoder: missing keys {missing[:3]}"
                         f"{f' (of {len(missing)})' if len(missing) > 3 else ''}, unexpected keys {unknown[:3]}"
                         f"{f' (of {len(unknown)})' if len(unknown) > 3 else ''}")
    head_missing = sorted(key for key in own if not key.startswith("bert.") and key not in weights)
    if pooler_absent and not isinstance(model, POOLER_UNUSED):
        head_missing = pooler + head_missing  # the classifier reads the pooler's output
    if head_missing and not fine_tune:
        raise InputError(f"--init_checkpoint has no task head ({', '.join(head_missing)}): evaluation without "
                         f"--do_train needs fine-tuned weights, e.g. <output_dir>/{CHECKPOINT_SUBDIR} of a "
                         f"--do_train run")


def build_model(make_model: Callable[[BertConfig], Model], config: BertConfig, weights: StateDict | None,
                session: Session, *, fine_tune: bool) -> Model:
    """make_model(config) -> a head model of modeling.py, with `weights` loaded: every encoder weight
    (bert.*) must be there; head weights are used when present (a fine-tuned checkpoint), else the head
    starts fresh, which only fine-tuning (fine_tune: --do_train) may do; the pretraining heads (cls.*) are
    not used. A checkpoint without a pooler (bert.pooler.*: transformers' question-answering and masked-LM
    saves) gets a fresh one, as transformers does; evaluation may use it so only with a head that does
    not read it (POOLER_UNUSED). The model is built under the run's seed, the same on every rank (a fresh
    head is one head, not one per rank); seed + rank is in force again afterwards, for dropout and the like.
    The entry points call check_weights first, before start(): bad weights stop the run before it writes."""
    device_setup.seed_everything(session.config.seed)
    model = make_model(config)
    device_setup.seed_everything(session.config.seed + session.rank)
    if weights is None:
        session.say("no --init_checkpoint: the encoder starts from random weights")
        return model
    _check_fit(model, config, weights, fine_tune=fine_tune)
    own = model.state_dict()
    loaded = {key: weights[key].float() for key in own if key in weights}
    model.load_state_dict(loaded, strict=False)
    fresh = sorted({POOLER_PREFIX.rstrip(".") if key.startswith(POOLER_PREFIX) else key.split(".")[0]
                    for key in own if key not in loaded})
    session.say(f"loaded {len(loaded)} tensors from --init_checkpoint"
                + (f"; fresh: {', '.join(fresh)}" if fresh else ""))
    return model


# ============================================================================ training

@dataclass
class Plan:
    """Batch geometry and schedule length of a training run."""
    micro: int
    gas: int
    world: int
    num_examples: int

    @property
    def global_batch(self) -> int:
        return self.micro * self.gas * self.world

    @property
    def steps_per_epoch(self) -> int:
        return self.num_examples // self.global_batch

    def total_steps(self, max_steps: float, num_train_epochs: float) -> int:
        """--max_steps when positive, else --num_train_epochs epochs (at least one step)."""
        if max_steps > 0:
            return int(max_steps)
        return max(1, math.ceil(num_train_epochs * self.steps_per_epoch))

    def micro_batch_indices(self, step: int, micro: int, rank: int, seed: int) -> torch.Tensor:
        """Rows of optimizer step `step` (0-based), micro-step `micro`, rank `rank`."""
        epoch, within = divmod(step, self.steps_per_epoch)
        order = torch.randperm(self.num_examples, generator=torch.Generator().manual_seed(seed + epoch))
        start = within * self.global_batch + (micro * self.world + rank) * self.micro
        return order[start:start + self.micro]


def training_plan(ds_config: dict[str, Any], world: int, num_examples: int, what: str = "training examples") -> Plan:
    """The batch geometry of training on num_examples rows (`what` they are, for the error) on `world` ranks;
    InputError when they do not fill one global batch."""
    plan = Plan(ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"], world,
                num_examples)
    if plan.steps_per_epoch == 0:
        raise InputError(f"{num_examples} {what}, fewer than one global batch of {plan.global_batch} (micro-batch "
                         f"{plan.micro} x {plan.gas} accumulation steps x {world} ranks): lower --train_batch_size")
    return plan


def check_training_data(ds_config: dict[str, Any] | None, num_examples: int | None,
                        what: str = "training examples") -> None:
    """training_plan's check before start() writes anything; the ranks are the launcher's WORLD_SIZE, as in
    build_config(). Nothing to check without training (ds_config or num_examples None)."""
    if ds_config is not None and num_examples is not None:
        training_plan(ds_config, int(os.environ.get("WORLD_SIZE", "1")), num_examples, what)


def train(session: Session, model: BertPreTrainedModel, features: Features, loss_fn: LossFn) -> dict[str, Any]:
    # The first torch.optim optimizer built in a process imports torch._dynamo (seconds on a 2-core CPU): that is
    # start-up, so it happens before the training clock starts (transformers' Trainer imports it before train()).
    importlib.import_module("torch._dynamo")
    started = time.perf_counter()
    config, ds_config = session.config, session.config.ds_config
    assert ds_config is not None  # build_config makes it with --do_train
    plan = training_plan(ds_config, session.world, len(next(iter(features.values()))))
    total_steps = plan.total_steps(config.max_steps, config.num_train_epochs)
    # The fused kernel, as transformers' Trainer uses: on the CPU the default is a per-tensor loop, and the step
    # took most of a fine-tuning step's time (docs/results.md, bench_glue). Gaudi has its own fused optimizers.
    fused = session.device.type in ("cpu", "cuda")
    optimizer = torch.optim.AdamW(get_parameter_groups(model), lr=config.learning_rate, eps=1e-6, fused=fused)
    scheduler = LinearWarmUpScheduler(optimizer, warmup=config.warmup_proportion, total_steps=total_steps)
    engine, _ = deepspeed_engine.initialize_engine(model, ds_config, optimizer, scheduler)
    # destroyed when training ends without an error: DeepSpeed's gradient hooks (bf16, ZeRO-1/2) would otherwise
    # keep the engine and the optimizer states alive after main returns
    with deepspeed_engine.destroyed_on_exit(engine):
        if config.torch_compile is not None:
            compile_mode.compile_model(engine, *config.torch_compile)
        setup = training_setup(plan, config.seed, features)
        step = resume(session, engine, model.config, setup) if config.resume_from_checkpoint else 0
        session.say(f"{plan.num_examples} examples, global batch {plan.global_batch}, {total_steps} steps"
                    + (f", resumed at step {step}" if step else ""))
        progress = progress_display.progress_bar(session.progress_bar, total_steps, step, "fine-tuning steps",
                                                 config.log_freq)
        first_step, losses, stopped = step, [], False
        with command_line.stop_requests() as stop_event:
            while step < total_steps and not stopped:
                step_started = time.perf_counter()
                loss, stopped = train_step(session, engine, plan, features, loss_fn, step, stop_event)
                if config.torch_compile is not None and step == first_step:
                    compile_mode.log_first_step(session.logger, session.say, time.perf_counter() - step_started)
                step += 1
                losses.append(loss)
                progress.update(1)
                if step % config.log_freq == 0 or step == total_steps:
                    session.logger.log(step=(step * plan.global_batch // plan.num_examples, step),
                                       data={"step_loss": loss, "learning_rate": optimizer.param_groups[0]["lr"]})
                if stopped or (config.num_steps_per_checkpoint and step % config.num_steps_per_checkpoint == 0):
                    save(session, engine, step, setup)
        progress.close()
        train_time = time.perf_counter() - started
        if not config.skip_checkpoint and not stopped and step > first_step:
            save(session, engine, step, setup)
        if stopped:
            session.say(f"stop requested (SIGTERM/SIGINT): checkpoint {step} saved; --resume_from_checkpoint continues")
        return {"e2e_train_time": train_time,
                "training_sequences_per_second": (step - first_step) * plan.global_batch / train_time,
                "final_loss": losses[-1] if losses else float("nan"), "global_step": step, "stopped_by_signal": stopped}


def train_step(session: Session, engine: "DeepSpeedEngine", plan: Plan, features: Features, loss_fn: LossFn, step: int,
               stop_event: threading.Event) -> tuple[float, bool]:
    """One optimizer step over GAS micro-batches; returns (loss averaged over micro-batches and ranks,
    whether any rank asked to stop)."""
    engine.train()
    losses = []
    for micro in range(plan.gas):
        rows = plan.micro_batch_indices(step, micro, session.rank, session.config.seed)
        loss = loss_fn(engine, to_device(features, rows, session.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().float())
    stats = torch.stack([torch.stack(losses).mean(), torch.tensor(float(stop_event.is_set()), device=session.device)])
    dist.all_reduce(stats)
    loss_sum, stop = stats.tolist()
    return loss_sum / session.world, stop > 0


def to_device(features: Features, rows: torch.Tensor, device: torch.device) -> Features:
    return {name: tensor[rows].to(device) for name, tensor in features.items()}


# What decides the samples of every step (Plan.micro_batch_indices) and where each is set.
SETUP_FLAGS = {"micro_batch": "--train_batch_size, --gradient_accumulation_steps or the DeepSpeed JSON",
               "accumulation_steps": "--gradient_accumulation_steps or the DeepSpeed JSON",
               "examples": "the training file", "seed": "--seed",
               "data_sha256": "the training file, --max_seq_length or the vocab"}
# Fine-tuning's total steps come from --num_train_epochs too (Plan.total_steps).
SCHEDULE_FLAGS = {**schedule_resume.SCHEDULE_FLAGS, "total_steps": "the steps of --max_steps/--num_train_epochs"}


def training_setup(plan: Plan, seed: int, features: Features) -> dict[str, int | str]:
    """What decides the samples of every step, saved in each checkpoint: a resume with other values would
    take other samples from the step reached on."""
    digest = hashlib.sha256()
    for name in sorted(features):
        digest.update(name.encode())
        digest.update(features[name].contiguous().numpy().data)
    return {"micro_batch": plan.micro, "accumulation_steps": plan.gas, "examples": plan.num_examples, "seed": seed,
            "data_sha256": digest.hexdigest()}


def save(session: Session, engine: "DeepSpeedEngine", step: int, setup: dict[str, int | str]) -> None:
    """Collective. The optimizer, scheduler and RNG states come along, and the training setup
    (training_setup), so a resume continues exactly."""
    client_state = {"global_step": step, "model_config": engine.module.config.to_dict(), "training_setup": setup}
    checkpointing.save_checkpoint(engine, checkpoint_dir(session.output_dir), str(step), client_state,
                                  {"rng": checkpointing.capture_rng_state(session.device)})
    session.say(f"saved checkpoint {step} in {checkpoint_dir(session.output_dir)}")


def resume(session: Session, engine: "DeepSpeedEngine", config: BertConfig, setup: dict[str, int | str]) -> int:
    """The step of the newest checkpoint in <output_dir>/checkpoints, loaded into engine (0 without one). A
    checkpoint of another training setup is refused: the run would go on with other samples (checkpoints saved
    before the setup was saved are not checked). Other LR schedule flags are followed from the step reached
    on, as in pretraining (training/schedule_resume.py)."""
    directory = checkpoint_dir(session.output_dir)
    tag = checkpointing.find_resume_tag(directory, model_config=config.to_dict())
    if tag is None:
        session.say(f"no checkpoint in {directory}: starting from step 0")
        return 0
    schedule = engine.lr_scheduler.state_dict()
    client, rank_state = checkpoint_resume.load_checkpoint(engine, directory, tag, session.rank, session.world)
    if rank_state is None:  # resuming fine-tuning on another world size is untested: keep refusing it
        raise checkpointing.CheckpointError(f"checkpoint {tag} in {directory} was written by another number of "
                                            f"ranks than this run's {session.world}; resume fine-tuning on that number")
    differences = [(key, saved, setup[key], flag) for key, flag in SETUP_FLAGS.items()
                   if (saved := client.get("training_setup", setup)[key]) != setup[key]]
    if differences:
        key, then, now, flag = differences[0]
        raise InputError(f"checkpoint {tag} in {directory} was saved with another training setup: {key} {then!r} "
                         f"then, {now!r} now (set by {flag}); resume with the same data and flags, or start in "
                         f"another --output_dir")
    checkpointing.restore_rng_state(rank_state["rng"], session.device)
    schedule_resume.follow_changed_schedule(engine.lr_scheduler, schedule, session.say, SCHEDULE_FLAGS)
    return int(client["global_step"])


def train_then_evaluate(session: Session, model: BertPreTrainedModel, train_features: Features | None, loss_fn: LossFn,
                        evaluate: Callable[[], dict[str, Any]] | None) -> dict[str, Any]:
    """An entry point's work after start(): train() when train_features is given, then evaluate() -> dict
    (when given) unless a stop request ended training; logs the merged summary (dllogger step ()) and
    returns it."""
    summary: dict[str, Any] = {}
    if train_features is not None:
        summary.update(train(session, model, train_features, loss_fn))
    if evaluate is not None and not summary.get("stopped_by_signal"):
        summary.update(evaluate())
    session.logger.log(step=(), data=summary)
    session.logger.flush()
    return summary


# ============================================================================ prediction

@torch.no_grad()
def predict(session: Session, model: nn.Module, features: Features, batch_size: int,
            forward_fn: ForwardFn) -> tuple[torch.Tensor, ...]:
    """forward_fn over every row, batches spread over the ranks; every rank gets all outputs, in order."""
    if batch_size < 1:
        raise InputError(f"the prediction batch size must be at least 1, got {batch_size}")
    model.to(session.device)
    was_training = model.training
    model.eval()
    num_examples = len(next(iter(features.values())))
    mine: list[tuple[int, tuple[torch.Tensor, ...]]] = []  # (first row, outputs) of each of this rank's batches
    starts = range(session.rank * batch_size, num_examples, session.world * batch_size)
    progress = progress_display.progress_bar(session.progress_bar, len(starts), 0, "predicting",
                                             max(1, len(starts) // 10))
    for start in starts:
        rows = torch.arange(start, min(start + batch_size, num_examples))
        outputs = forward_fn(model, to_device(features, rows, session.device))
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        mine.append((start, tuple(output.float().cpu() for output in outputs)))
        progress.update(1)
    progress.close()
    model.train(was_training)
    gathered: list[list[tuple[int, tuple[torch.Tensor, ...]]]] = [[] for _ in range(session.world)]
    dist.all_gather_object(gathered, mine)
    pieces = sorted((piece for rank_pieces in gathered for piece in rank_pieces), key=lambda piece: piece[0])
    if not pieces:
        return ()
    return tuple(torch.cat([outputs[i] for _, outputs in pieces]) for i in range(len(pieces[0][1])))


def run_cli(main: Callable[..., dict[str, Any]], argv: Sequence[str] | None) -> int:
    """An entry point's cli(): one error line instead of a traceback, and an exit status of training/run_status.py's
    contract, as run_pretraining.cli's: bad input is final (NO_RESTART, 2; the line says [no restart]), since a
    restart would meet it again; a checkpoint that cannot be saved or resumed from is a FAILED run (1); STOPPED (3)
    when a stop request ended training."""
    return command_line.run_cli(main, argv, (checkpointing.CheckpointError,), final=(InputError,))
