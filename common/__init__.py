"""Leaves shared by the data pipeline (data/) and the training runtime: the one InputError, atomic writes,
S3 storage and the DeepSpeed JSON reader. Nothing here imports training, fine-tuning or data code."""
