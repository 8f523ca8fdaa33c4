"""One GRPO update on a fixed batch, in however many processes launched it (python: 1; torchrun: N, gloo on CPU).
Used by test_distributed.py: writes the token-mean loss and the updated (whole) parameters to argv[1].

    python tests/distributed_update.py OUT [MICRO_BATCH_SIZE] [MICRO_BATCH_TOKENS]
    torchrun --standalone --nproc-per-node 2 tests/distributed_update.py OUT [MICRO_BATCH_SIZE] [MICRO_BATCH_TOKENS]
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import grpo  # noqa: E402
import infra.dist
import infra.packing

ROWS, GROUP = 8, 4


def fixed_batch(tokenizer):
    """8 sequences with prompts of 3-6 and responses of 1-9 tokens (one of them is a single EOS), seeded."""
    generator = torch.Generator().manual_seed(0)
    prompts, responses = [], []
    for row in range(ROWS):
        prompts.append(torch.randint(4, 60, (3 + row % 4,), generator=generator).tolist())
        length = [1, 9, 4, 7, 2, 8, 5, 3][row]
        responses.append(torch.randint(4, 60, (length - 1,), generator=generator).tolist() + [tokenizer.eos_token_id])
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    return prompts, responses, rewards


def main():
    out, micro_batch_size = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8
    micro_batch_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    device = infra.dist.init_device("cpu")
    torch.manual_seed(0)
    policy, tokenizer = common.load_model("tiny", "float32", device)
    # SGD: the step is the clipped gradient itself. (Adam's first step is lr * g / (|g| + eps): near-zero gradients
    # turn float32 summation-order noise into steps of +-lr, so it would compare noise, not the gradient.)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    prompts, responses, rewards = fixed_batch(tokenizer)
    advantages = infra.dist.rank_share(grpo.group_advantages(rewards, GROUP))  # as the trainer: the whole rollout's
    local = infra.dist.rank_share(list(range(ROWS)))
    batch = common.sequence_batch([prompts[i] for i in local], [responses[i] for i in local], tokenizer.pad_token_id)
    mask = batch.response_mask
    old_logprobs = common.batched(lambda micro: common.response_logprobs(policy, micro), batch, micro_batch_size,
                                  micro_batch_tokens)
    token_advantages = advantages[:, None].expand_as(old_logprobs)
    rows = list(range(len(local)))
    counts = dict(num_sequences=len(rows), num_tokens=infra.dist.rank_mean(mask.sum()), max_length=16)
    total_loss, groups = 0.0, common.micro_batches(rows, batch.lengths(), micro_batch_size, micro_batch_tokens)
    packed = infra.packing.token_budget_chunks(rows, batch.lengths(), micro_batch_tokens) if micro_batch_tokens \
        else groups
    micro_batch_counts = infra.dist.gather_objects((len(packed), len(groups)))  # per rank: packed, after equalizing
    for micro in groups:
        micro_batch = batch.select(micro)
        width = micro_batch.response_width
        # the ratio is 1 at old_logprobs; shift them so that clipping is active on some tokens
        shifted_old = old_logprobs[micro, :width] + 0.3 * torch.tensor([1.0, -1.0])[torch.arange(width) % 2]
        logprobs = common.response_logprobs(policy, micro_batch)
        loss, _ = grpo.policy_loss(logprobs, shifted_old, token_advantages[micro, :width], micro_batch.response_mask,
                                   0.2, 0.28, "token-mean", **counts)
        loss.backward()
        total_loss += loss.item()
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 0.5)
    optimizer.step()
    weights = {name: tensor.detach().clone() for name, tensor in infra.dist.full_weights(policy)}
    loss = infra.dist.rank_mean(total_loss)  # each rank's loss estimates the global one: their mean is it
    if infra.dist.rank() == 0:
        torch.save({"loss": loss, "grad_norm": float(grad_norm), "weights": weights,
                    "world_size": infra.dist.world_size(), "micro_batch_counts": micro_batch_counts}, out)
    if infra.dist.distributed():
        torch.distributed.barrier()  # no rank tears its connections down while another still uses them
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
