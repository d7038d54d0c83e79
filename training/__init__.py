"""The pretraining runtime under the entry points: the command line (command_line), device (device_setup), process
group (distributed), DeepSpeed engine (deepspeed_engine), compile mode, initial weights, log, profiler and progress
display, checkpoints and resume (checkpointing), the answer to a changed LR schedule on resume (schedule_resume),
ZeRO partitions, sizing and device facts, Gaudi's graph cuts, the dllogger fallback, the launchers' preflight and
supervisor, and what a run tells the supervisor (run_status). It imports the model (modeling, lans) and common/,
never an entry point, fine-tuning or data/."""
