"""Held-out evaluation of a pretraining model: masked-LM loss and accuracy, next-sentence loss and accuracy.

The same figures at any world size, ZeRO stage and accumulation. The held-out samples are a fixed list (the
first --num_eval_examples samples of the held-out shards in file order; their masks are in the shards, so no
random number is drawn), cut into fixed chunks of --eval_batch_size samples. Rank r evaluates chunks r, r + W,
...; each chunk's sums (loss sums in float64, correct and total counts) are computed alike wherever it runs,
because a chunk is the same batch on every world size. The ranks then exchange the sums per chunk (one
all_gather_object of a few numbers per chunk), and every rank adds them up in chunk order. An all-reduce of
each rank's subtotals would instead add in an order that depends on the world size, and float64 addition is
not associative: the last bits would differ between 1 and 8 ranks. The cost is one forward pass of every
held-out sample, split between the ranks, and no backward pass; the exchange is negligible.

The model runs in eval mode (no dropout, so no training random stream is drawn) under torch.no_grad(), and is
put back in train mode afterwards: training goes on bitwise as it would without the evaluation.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from modeling import BertPretrainingCriterion

# The figures, as the driver logs them (dllogger keys; TensorBoard tags Eval/<key>).
EVAL_KEYS = ("eval_loss", "eval_mlm_loss", "eval_mlm_accuracy", "eval_nsp_loss", "eval_nsp_accuracy")
SUMS = ("mlm_loss_sum", "mlm_correct", "mlm_count", "nsp_loss_sum", "nsp_correct", "nsp_count")
ChunkSums = dict[str, float | int]  # one chunk's SUMS (BertPretrainingCriterion.sums)


@dataclass(kw_only=True)
class HeldOutSet:
    """This rank's chunks of the held-out list (data.dataset.fixed_chunks) and how many there are in all."""
    # [(chunk index, (input_ids, segment_ids, input_mask, masked_lm_labels, nsp_labels))]
    chunks: list[tuple[int, tuple[torch.Tensor, ...]]]
    num_chunks: int
    num_samples: int


def evaluate(model: torch.nn.Module, held_out: HeldOutSet, device: torch.device,
             all_gather_object: Callable[[list[Any], object], object], world_size: int,
             after_batch: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Collective: the EVAL_KEYS figures of `model` on the held-out set, the same on every rank.
    all_gather_object: torch.distributed's (a test may pass one that stands in for the other ranks).
    after_batch: called after each chunk's forward (an HPU in lazy mode cuts its graph there)."""
    was_training = model.training
    model.eval()
    own: dict[int, ChunkSums] = {}
    try:
        with torch.no_grad():
            for index, tensors in held_out.chunks:
                input_ids, segment_ids, input_mask, labels, nsp_labels = (t.to(device) for t in tensors)
                scores, nsp_scores = model(input_ids, token_type_ids=segment_ids, attention_mask=input_mask,
                                           masked_lm_labels=labels)
                own[index] = BertPretrainingCriterion.sums(scores, nsp_scores, labels, nsp_labels)
                after_batch()
    finally:
        model.train(was_training)
    gathered: list[dict[int, ChunkSums]] = [{} for _ in range(world_size)]
    all_gather_object(gathered, own)
    per_chunk = {index: sums for rank_sums in gathered for index, sums in rank_sums.items()}
    if sorted(per_chunk) != list(range(held_out.num_chunks)):
        raise RuntimeError(f"held-out evaluation: the ranks evaluated chunks {sorted(per_chunk)}, "
                           f"not 0..{held_out.num_chunks - 1}")
    return figures([per_chunk[index] for index in range(held_out.num_chunks)])


def figures(chunk_sums: list[ChunkSums]) -> dict[str, float]:
    """EVAL_KEYS from the sums of each chunk (BertPretrainingCriterion.sums), added in list order."""
    total = {key: sum(sums[key] for sums in chunk_sums) for key in SUMS}
    mlm_loss = total["mlm_loss_sum"] / total["mlm_count"] if total["mlm_count"] else float("nan")
    nsp_loss = total["nsp_loss_sum"] / total["nsp_count"]
    return {"eval_loss": mlm_loss + nsp_loss, "eval_mlm_loss": mlm_loss,
            "eval_mlm_accuracy": total["mlm_correct"] / total["mlm_count"] if total["mlm_count"] else float("nan"),
            "eval_nsp_loss": nsp_loss, "eval_nsp_accuracy": total["nsp_correct"] / total["nsp_count"]}
