"""Micro-batches behind common.micro_batches: rows packed by padded token count (a dynamic program that computes
the fewest padded tokens), and the same number of micro-batches on every rank under torchrun.
"""
import torch

from infra import UserError, dist

MICRO_BATCH_COST = 512  # a micro-batch's fixed cost counted in padded tokens (launches, FSDP's gathers): assumed


def token_budget_chunks(indices, lengths, max_tokens, overhead=MICRO_BATCH_COST):
    """Split `indices` into micro-batches of at most `max_tokens` padded tokens (rows x width; a row wider than the
    budget goes alone) that compute the fewest padded tokens, each micro-batch counted `overhead` tokens more: rows
    are taken longest response first, and a dynamic program over that order places the cuts. `lengths[i]` is row
    i's length, or a (prompt, response) pair: in a SequenceBatch the width is the longest prompt plus the longest
    response of the micro-batch (SequenceBatch.lengths())."""
    def parts(index):
        value = lengths[index]
        value = value.tolist() if torch.is_tensor(value) else value
        return tuple(int(v) for v in value) if isinstance(value, (tuple, list)) else (int(value),)

    order = sorted(indices, key=lambda i: tuple(reversed(parts(i))), reverse=True)  # stable for equal lengths
    cost, cut = [0] + [float("inf")] * len(order), [0] * (len(order) + 1)  # the best split of order[:end]
    for end in range(1, len(order) + 1):
        widest = parts(order[end - 1])
        for start in range(end - 1, -1, -1):  # order[start:end] as the last micro-batch
            widest = tuple(map(max, widest, parts(order[start])))
            if (end - start) * sum(widest) > max_tokens and start < end - 1:
                break
            if cost[start] + (end - start) * sum(widest) + overhead < cost[end]:
                cost[end], cut[end] = cost[start] + (end - start) * sum(widest) + overhead, start
    groups, end = [], len(order)
    while end:
        groups.append(order[cut[end]:end])
        end = cut[end]
    return groups[::-1]


def same_count_on_every_rank(groups):
    """`groups` (micro-batches of row indices) split until this rank has as many as the rank with the most (FSDP's
    forwards are collective): the largest micro-batch halved, again and again. The identity without torchrun."""
    wanted = max(dist.gather_objects(len(groups)))
    while len(groups) < wanted:
        largest = max(range(len(groups)), key=lambda i: len(groups[i]))
        if len(groups[largest]) < 2:
            raise UserError(f"the ranks need {wanted} micro-batches but this one holds "
                            f"{sum(map(len, groups))} sequences: use the same number of sequences on every rank")
        half = len(groups[largest]) // 2
        groups[largest:largest + 1] = [groups[largest][:half], groups[largest][half:]]
    return groups
