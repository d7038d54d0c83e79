"""Fine-tuning on GLUE and SQuAD, under run_glue.py and run_squad.py: the shared flags and loop (finetuning), the
tasks' readers (glue, squad) and metrics (glue_metrics, squad_metrics), and the Hugging Face interop (hf_interop,
and hf_modeling_pre_ln, the model file an export carries). It imports the model, training/, data/ and common/,
never an entry point."""
