"""The entry points' flags keep their names, defaults and parsed values whatever their --help looks like.

tests/flags_snapshot.json holds, for run_pretraining.py, run_squad.py and run_glue.py, every argparse action
(options, dest, default, type, nargs, choices, ...) and the Namespace that parse_arguments returns for a
minimal and a typical command line. It was written by this file (`PYTHONPATH=. python tests/test_flags.py >
tests/flags_snapshot.json`) from the parsers of commit 6a8fcf4, before --help was grouped (issue 19 defect 6).
Rewrite it only for a deliberate change of a flag, and say so in the commit.
"""
import json
import os
from pathlib import Path

import pytest

SNAPSHOT = Path(__file__).resolve().parent / "flags_snapshot.json"

PRETRAINING_REQUIRED = ["--input_dir", "D", "--config_file", "C", "--output_dir", "O"]
ARGVS = {
    "run_pretraining": [
        PRETRAINING_REQUIRED,
        # the demo's command line, the reference's ignored flags and a few of ours
        PRETRAINING_REQUIRED + [
            "--no_cuda", "--disable_progress_bar", "--optimizer", "lans", "--use_lr_scheduler", "--deepspeed",
            "--deepspeed_config", "ds.json", "--json-summary", "J", "--max_predictions_per_seq", "20",
            "--seed", "12439", "--learning_rate", "0.02", "--warmup_proportion", "0.1", "--max_steps", "120",
            "--num_steps_per_checkpoint", "60", "--log_freq", "10", "--bert_model", "bert-large-uncased",
            "--do_train", "--max_seq_length", "128", "--betas", "0.9", "0.98", "--phase2", "--phase1_end_step",
            "10", "--resume_from_checkpoint", "--lans_blocks", "partition", "--s3_cache_gb", "5", "--profile", "pt",
            "--constant_proportion", "0.25", "--steps_this_run", "7", "--enable_torch_compile"],
    ],
    "run_squad": [
        ["--vocab_file", "V", "--output_dir", "O"],
        # scripts/run_squad.sh's command line
        ["--no_cuda", "--resume_from_checkpoint", "--disable-progress-bar", "--init_checkpoint", "I",
         "--vocab_file", "V", "--do_lower_case", "--train_file", "T", "--predict_file", "P", "--do_train",
         "--do_predict", "--do_eval", "--version_2_with_negative", "--output_dir", "O", "--json-summary", "J",
         "--train_batch_size", "32", "--learning_rate", "4.6e-5", "--num_train_epochs", "2",
         "--warmup_proportion", "0.2", "--max_seq_length", "384", "--doc_stride", "128", "--seed", "1",
         "--deepspeed", "--deepspeed_config", "ds.json", "--gradient_accumulation_steps", "2"],
    ],
    "run_glue": [
        ["--task_name", "sst-2", "--data_dir", "D", "--vocab_file", "V", "--output_dir", "O"],
        # scripts/run_glue.sh's command line
        ["--use_hpu", "--task_name", "MRPC", "--data_dir", "D", "--init_checkpoint", "I", "--vocab_file", "V",
         "--do_lower_case", "--do_train", "--do_eval", "--output_dir", "O", "--train_batch_size", "32",
         "--learning_rate", "2e-5", "--num_train_epochs", "3", "--max_seq_length", "128", "--seed", "2",
         "--eval_batch_size", "16", "--skip_checkpoint", "--log_freq", "5"],
    ],
}


def parse(name, argv):
    """The Namespace that the entry point's own parse_arguments returns."""
    if name == "run_pretraining":
        import run_pretraining
        return run_pretraining.parse_arguments(argv)
    from finetune import flags
    module = __import__(name)
    return flags.parse_arguments(module.build_parser(), argv)


def parser_of(name):
    import deepspeed
    module = __import__(name)
    parser = module.build_parser()
    deepspeed.add_config_arguments(parser)
    return parser


def describe(parser) -> list:
    """Every action of the parser with what decides its parsing (not its help text or group)."""
    return [{"options": action.option_strings, "dest": action.dest, "default": action.default,
             "type": getattr(action.type, "__name__", None), "nargs": action.nargs, "const": action.const,
             "choices": list(action.choices) if action.choices is not None else None,
             "required": action.required, "action": type(action).__name__} for action in parser._actions]


def snapshot() -> dict:
    return json.loads(json.dumps({
        name: {"actions": describe(parser_of(name)),
               "namespaces": [{"argv": argv, "namespace": vars(parse(name, argv))} for argv in argvs]}
        for name, argvs in ARGVS.items()}))


@pytest.fixture(autouse=True)
def cpu_accelerator(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


@pytest.mark.parametrize("name", sorted(ARGVS))
def test_flags_keep_their_names_defaults_and_parsed_values(name):
    expected, current = json.loads(SNAPSHOT.read_text())[name], snapshot()[name]
    by_dest = {action["dest"]: action for action in current["actions"]}
    for action in expected["actions"]:
        assert by_dest.get(action["dest"]) == action, action["dest"]
    assert len(current["actions"]) == len(expected["actions"])
    for case, now in zip(expected["namespaces"], current["namespaces"]):
        assert now == case


GROUPS = {
    "run_pretraining": ["data", "model", "schedule and optimizer", "checkpoints", "devices and distribution", "S3",
                        "logging", "held-out evaluation", "ignored", "DeepSpeed"],
    "run_squad": ["what to run", "data", "model", "schedule and optimizer", "prediction", "checkpoints",
                  "devices and distribution", "logging", "ignored", "refused", "DeepSpeed"],
}
GROUPS["run_glue"] = GROUPS["run_squad"]


def collapsed(text: str) -> str:
    """Whitespace as one space, and no break after a hyphen (argparse may wrap "non-finite" after its hyphen)."""
    return " ".join(text.split()).replace("- ", "-")


@pytest.mark.parametrize("name", sorted(ARGVS))
def test_help_groups_the_flags_and_gives_every_default(name):
    """--help lists the flags under their groups, in this order, and says the default of every flag that
    takes a value (the DeepSpeed group is DeepSpeed's own), with its value or in words."""
    parser = parser_of(name)
    text = collapsed(parser.format_help())
    titles = [group.title for group in parser._action_groups if group._group_actions and group.title != "options"]
    assert titles == GROUPS[name]
    positions = [text.index(f" {title}: ") for title in titles]
    assert positions == sorted(positions)
    for group in parser._action_groups:
        if group.title == "DeepSpeed":
            continue
        for action in group._group_actions:
            if action.nargs == 0 or action.required:  # switches, -h and required flags have no default to give
                continue
            shown = parser._get_formatter()._expand_help(action)
            assert "(default: " in shown and "(default: None)" not in shown, (action.dest, shown)
            assert collapsed(shown) in text, action.dest
    assert "Flags without a value are switches: off unless given." in text


def test_the_entries_that_confused_users_say_what_they_mean():
    pretraining = {action.dest: action.help for action in parser_of("run_pretraining")._actions}
    assert "HDF5 shards" in pretraining["max_seq_length"] and "Does nothing" not in pretraining["max_seq_length"]
    assert "none =" not in pretraining["optimizer"]
    assert "DeepSpeed JSON's \"optimizer\" section" in pretraining["optimizer"]
    for name in ("run_squad", "run_glue"):
        helps = {action.dest: action.help for action in parser_of(name)._actions}
        assert "per process (device) and optimizer step" in collapsed(helps["train_batch_size"]).replace(
            "Sequences per process", "per process"), helps["train_batch_size"]


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    print(json.dumps(snapshot(), indent=1, sort_keys=True))
