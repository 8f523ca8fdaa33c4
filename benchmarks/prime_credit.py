"""Where PRIME's implicit process rewards put the credit on the built-in task (docs/methods.md, PRIME on the testbed).

    OMP_NUM_THREADS=1 python benchmarks/prime_credit.py --steps 20 --seed 0 --out docs/testbed_runs/prime_credit_s0.jsonl

Runs prime.py (the demo preset; other flags go to it) and, at each rollout, from the rewards the loop hands
prime_returns: the leave-one-out token reward (the released masked_rloo) at the carry digit of each column after one
that sums to 10 or more, kept (1) or dropped (0), with their counts, and at the carry digit after a smaller sum
(a carry there is spurious); and the PRM's ranking accuracy as the released trainer logs it (compute_dpo_accuracy):
within each group, the share of (correct, wrong) pairs whose implicit reward sums are in the outcome's order (0.5 for
a group of equal outcomes), averaged over the groups. One JSON line per rollout, printed and written to --out.
"""
import argparse
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402
import prime  # noqa: E402

COLUMN = re.compile(r"(\d)\+(\d)\+(\d)=\d+")  # one column of the built-in task's worked addition: a+b+carry=sum


def carry_rewards(tokenizer, responses, token_rewards):
    """{kind: [token rewards]} at the carry digit of each column: kept or dropped after a column summing to 10 or
    more, spurious or none after a smaller one (characters mapped to their tokens)."""
    found = {"kept": [], "dropped": [], "spurious": [], "none": []}
    for row, token_ids in enumerate(responses):
        pieces = [tokenizer.decode([token], skip_special_tokens=True) for token in token_ids]
        token_at = [position for position, piece in enumerate(pieces) for _ in piece]  # each character's token
        previous = None
        for column in COLUMN.finditer("".join(pieces)):
            if previous is not None:
                kind = ("kept", "dropped") if previous >= 10 else ("spurious", "none")
                found[kind[column.group(3) != "1"]].append(token_rewards[row, token_at[column.start(3)]].item())
            previous = sum(int(digit) for digit in column.groups())
    return found


def rank_accuracy(sums, rewards, group_size):
    """The released compute_dpo_accuracy: per group, the share of pairs with different outcomes whose sums are in
    the outcomes' order (0.5 without such a pair), averaged over the groups."""
    accuracies = []
    for group_sums, group_rewards in zip(sums.view(-1, group_size), rewards.view(-1, group_size)):
        pairs = [(a, b) for a in range(group_size) for b in range(group_size) if group_rewards[a] > group_rewards[b]]
        accuracies.append(sum(float(group_sums[a] > group_sums[b]) for a, b in pairs) / len(pairs) if pairs else 0.5)
    return sum(accuracies) / len(accuracies)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="", help="also write the records here (JSON lines)")
    options, argv = parser.parse_known_args()  # the other flags go to prime.py
    tokenizer, responses, records = common.load_model("tiny", "float32", "cpu")[1], [], []
    real_batch, real_returns = common.sequence_batch, prime.prime_returns

    def sequence_batch(prompts, response_ids, pad_id):  # the loop's batch: keep its responses
        responses[:] = response_ids
        return real_batch(prompts, response_ids, pad_id)

    def prime_returns(rewards, process_rewards, mask, group_size, *rest):
        loo = prime.leave_one_out(process_rewards, mask, group_size)
        found = carry_rewards(tokenizer, responses, loo)
        record = {"step": len(records), "reward": rewards.mean().item(),
                  "rank_accuracy": rank_accuracy(process_rewards.sum(1), rewards, group_size)}
        for kind, values in found.items():
            record.update({kind: len(values), f"{kind}_reward": sum(values) / len(values) if values else None})
        records.append(record)
        print(json.dumps(record), flush=True)
        if options.out:  # as it goes: a stopped run keeps its rollouts
            with open(options.out, "a" if records[1:] else "w") as handle:
                handle.write(json.dumps(record) + "\n")
        return real_returns(rewards, process_rewards, mask, group_size, *rest)

    common.sequence_batch, prime.prime_returns = sequence_batch, prime_returns
    sys.argv = ["prime.py", "--eval-every", "0", "--eval-problems", "8", "--output-dir", "runs/prime_credit", *argv]
    prime.main()


if __name__ == "__main__":
    main()
