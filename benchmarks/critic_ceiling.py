"""How much of the reward's variance a critic could explain on the built-in task, and how much ppo.py's critic
construction learns offline (issue 17: PPO's logged explained_variance stays near 0).

    OMP_NUM_THREADS=1 python benchmarks/critic_ceiling.py                      # the shipped tiny model
    OMP_NUM_THREADS=1 python benchmarks/critic_ceiling.py --policy runs/<run>/checkpoints/step_000060/policy \
        --critic runs/<run>/checkpoints/step_000060/critic                    # a trained policy and its critic
    OMP_NUM_THREADS=1 python benchmarks/critic_ceiling.py --dataset builtin:3-7   # problems of 3 to 7 digits, mixed
    OMP_NUM_THREADS=1 python benchmarks/critic_ceiling.py --dataset builtin:horizon-k1-h256 --mc-responses 0
                                                                   # the horizon task (docs/horizon.md), its model

Samples --train + --test responses of the policy at temperature 1 to distinct training problems of the task
(rollouts' settings: 96 tokens, H + 64 on the horizon task; reward R = common.score at the last token), then reports
explained variance (infra.probes.explained_variance over all response tokens, as ppo.py logs it; returns = R since
gamma = lam = 1), pooled and by token position, of:
  perfect: Monte Carlo values V(s_t) = mean reward of --continuations completions of every 2nd state of
           --mc-responses test responses (the noise p(1-p)/K lowers it slightly: an estimate of what a perfect
           critic attains);
  fit:     a fresh critic built as ppo.py builds it (common.load_model(value_head=1), AdamW with ppo.py's betas
           and weight decay, gradients clipped at 1) regressed by plain MSE of every token's value on R, for
           --epochs passes over the training responses in mini-batches of --batch, at each --lrs;
  critic:  a given critic checkpoint (--critic), e.g. the one a ppo.py run saved.
Runs on one CPU thread in minutes (the Monte Carlo part: about 2 minutes for 64 responses, K = 16).
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
import infra.data  # noqa: E402
import infra.horizon  # noqa: E402
import infra.probes  # noqa: E402
from infra.engine import HFGenerator  # noqa: E402

BUCKETS = ((0, 1), (1, 10), (10, 30), (30, 50), (50, 60), (60, 10 ** 6))
MAX_TOKENS = 96  # the tiny preset's max_response_tokens (the horizon preset's: H + LENGTH_SLACK)


def by_position(values, returns, mask):
    """Explained variance over each BUCKETS range of response positions t (the state before token t)."""
    position = torch.arange(mask.shape[1])[None].expand_as(mask)
    return {f"{lo}-{hi if hi < 1000 else ''}": infra.probes.explained_variance(
        values, returns, mask & (position >= lo) & (position < hi)) for lo, hi in BUCKETS}


def report(name, values, rewards, mask):
    returns = rewards[:, None].expand_as(values) * mask
    ev = infra.probes.explained_variance(values, returns, mask)
    positions = " ".join(f"[{k}) {v:.3f}" for k, v in by_position(values, returns, mask).items())
    print(f"{name}: EV {ev:.3f}   by position: {positions}", flush=True)


def fit_critic(args, lr, batch, rewards, train, test):
    torch.manual_seed(args.seed)
    critic = common.load_model(args.critic_base, "auto", "cpu", value_head=1)[0]
    optimizer = torch.optim.AdamW(critic.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.1)  # ppo.py's
    test_batch, start = batch.select(test), time.time()
    for epoch in range(args.epochs):
        order = [train[i] for i in torch.randperm(len(train)).tolist()]
        for rows in common.chunks(order, args.batch):
            micro = batch.select(rows)
            mask = micro.response_mask
            loss = (((common.critic_outputs(critic, micro) - rewards[rows][:, None]) ** 2) * mask).sum() / mask.sum()
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
            optimizer.step()
        values = common.batched(lambda m: common.critic_outputs(critic, m), test_batch, 64)
        report(f"fit lr {lr:g} epoch {epoch + 1} ({(epoch + 1) * -(-len(train) // args.batch)} steps, "
               f"{time.time() - start:.0f}s)", values, rewards[test], test_batch.response_mask)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policy", default="", help="default: tiny, or horizon on the horizon task")
    parser.add_argument("--critic", default="", help="a critic checkpoint to evaluate on the test responses")
    parser.add_argument("--critic-base", default="", help="the backbone of the fitted critics (default: --policy's)")
    parser.add_argument("--dataset", default="builtin", help="builtin[:N | :A-B | :horizon-k<K>-h<H>[-late]]")
    parser.add_argument("--train", type=int, default=1024)
    parser.add_argument("--test", type=int, default=1024)
    parser.add_argument("--mc-responses", type=int, default=64, help="0: skip the Monte Carlo values")
    parser.add_argument("--continuations", type=int, default=16)
    parser.add_argument("--lrs", type=float, nargs="*", default=[5e-4])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    try:
        digits = infra.data.builtin_digits(args.dataset)
        rows = infra.data.load_rows(args.dataset, "train", args.train + args.test, 1000 + args.seed)
    except infra.UserError as error:
        parser.error(str(error))
    horizon = str(digits).startswith("horizon")
    max_tokens = infra.horizon.parse_spec(digits)[1] + infra.horizon.LENGTH_SLACK if horizon else MAX_TOKENS
    args.policy = args.policy or ("horizon" if horizon else "tiny")
    args.critic_base = args.critic_base or args.policy
    policy, tokenizer = common.load_model(args.policy, "auto", "cpu")
    generator = HFGenerator(policy, tokenizer, batch_size=512)
    prompts = [common.prompt_ids(tokenizer, row["question"]) for row in rows]
    completions = generator.generate(prompts, 1, max_tokens, 1.0, 1.0)
    rewards = torch.tensor([common.score(c.text, rows[c.prompt_index]) if c.finish_reason == "stop" else 0.0
                            for c in completions])
    batch = common.sequence_batch(prompts, [c.token_ids for c in completions], tokenizer.pad_token_id)
    train, test = list(range(args.train)), list(range(args.train, args.train + args.test))
    print(f"policy {args.policy}: success at temperature 1 {rewards.mean():.3f} (train {rewards[train].mean():.3f}, "
          f"test {rewards[test].mean():.3f})", flush=True)
    if args.mc_responses:
        chosen = test[:args.mc_responses]
        states = [(prompts[i], completions[i].token_ids[:t]) for i in chosen
                  for t in range(0, len(completions[i].token_ids), 2)]
        state_rows = [rows[i] for i in chosen for _ in range(0, len(completions[i].token_ids), 2)]
        mc_values, _ = common.monte_carlo_values(generator, tokenizer, states, state_rows, args.continuations,
                                                 max_tokens)
        mc_batch = batch.select(chosen)
        values, k = torch.zeros(mc_batch.response_ids.shape), 0
        mask = torch.zeros(mc_batch.response_ids.shape, dtype=torch.bool)
        for row, i in enumerate(chosen):
            for t in range(0, len(completions[i].token_ids), 2):
                values[row, t], mask[row, t], k = float(mc_values[k]), True, k + 1
        report(f"perfect (Monte Carlo, K={args.continuations}, {len(chosen)} responses, every 2nd state)", values,
               rewards[chosen], mask)
    if args.critic:
        critic = common.load_model(args.critic, "auto", "cpu", value_head=1)[0]
        test_batch = batch.select(test)
        report(f"critic {args.critic}", common.batched(lambda m: common.critic_outputs(critic, m), test_batch, 64),
               rewards[test], test_batch.response_mask)
    for lr in args.lrs:
        fit_critic(args, lr, batch, rewards, train, test)


if __name__ == "__main__":
    main()
