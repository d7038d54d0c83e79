"""Run transformers' examples/pytorch/text-classification/run_glue.py, unmodified, under transformers 5, offline.

    ANCHOR_PYTHON bench/hf_run_glue_compat.py PATH/run_glue.py [its flags]

bench/bench_glue.py starts transformers' script through this file, in the anchor's virtual environment
(bench/requirements-glue-anchor.txt). The newest version of that script we could read is of transformers'
commit 242e7fc (written for transformers 4.34); three names it uses are gone from transformers 5, and one
call needs the Hub. Rather than edit the script, this file puts back what it calls, then runs it as
__main__. Nothing here changes what is trained or timed:

- transformers.utils.send_example_telemetry (removed in 5): a no-op; it only reported usage to the Hub;
- Trainer(tokenizer=...) (renamed processing_class in 5): passed on as processing_class;
- evaluate.load("accuracy") downloads the metric's script from the Hub: here the fraction of predictions
  equal to their labels, what that metric computes. Other metrics load as before.

The script also reads training_args.overwrite_output_dir (removed in 5) only when --output_dir exists:
bench_glue.py gives each run a new one.
"""

import runpy
import sys


def install_compat():
    import evaluate
    import numpy as np
    import transformers
    import transformers.utils

    if not hasattr(transformers.utils, "send_example_telemetry"):
        transformers.utils.send_example_telemetry = lambda *args, **kwargs: None

    trainer_init = transformers.Trainer.__init__

    def init_with_tokenizer(self, *args, tokenizer=None, **kwargs):
        if tokenizer is not None:
            kwargs.setdefault("processing_class", tokenizer)
        trainer_init(self, *args, **kwargs)

    transformers.Trainer.__init__ = init_with_tokenizer

    class Accuracy:
        def compute(self, predictions, references):
            return {"accuracy": float(np.mean(np.asarray(predictions) == np.asarray(references)))}

    hub_load = evaluate.load

    def load(path, *args, **kwargs):
        return Accuracy() if path == "accuracy" else hub_load(path, *args, **kwargs)

    evaluate.load = load


def main(argv) -> None:
    if not argv or not argv[0].endswith(".py"):
        raise SystemExit("hf_run_glue_compat.py: error: usage: hf_run_glue_compat.py PATH/run_glue.py [flags]")
    install_compat()
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
