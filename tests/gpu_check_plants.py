"""Bugs planted into a trainer run through the GPU check's harness (benchmarks/gpu_check_runs.observe), to show that
the check fails on each (tests/test_gpu_check.py). Nothing here is in the product code: each plant monkeypatches
the trainer's policy_loss or common.response_logprobs in this process before the trainer runs.

    python tests/gpu_check_plants.py PLANT TRAINER REPORT -- TRAINER_FLAGS...

PLANT (PLANTS): none; sign-advantage (the loss gets -A); sign-loss (the loss is negated); shift (every trainer log-prob
is of the token one position on: log p(y_{t+1} | y_<t+1)); shift-update (only the update's log-probs, not the old
ones); temperature (every trainer log-prob at 0.7 x the sampling temperature); temperature-update (only the update's).
"""
import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WRONG_TEMPERATURE = 0.7  # the planted log-prob temperature, as a multiple of the sampling temperature
PLANTS = ("none", "sign-advantage", "sign-loss", "shift", "shift-update", "temperature", "temperature-update")


def plant(name, trainer):
    """Install the bug `name` into this process (the trainer module `trainer` is imported here)."""
    import torch

    import common
    module = __import__(trainer)
    policy_loss, response_logprobs = module.policy_loss, common.response_logprobs
    update_only = name.endswith("-update")  # the update's forward has gradients; the old log-probs' (batched) not

    def planted_logprobs(model, batch, temperature=1.0):
        if update_only and not torch.is_grad_enabled():
            return response_logprobs(model, batch, temperature)
        if name.startswith("shift"):  # the target tokens read one position on (the last one kept)
            ids = batch.response_ids
            batch = dataclasses.replace(batch, response_ids=torch.cat([ids[:, 1:], ids[:, -1:]], 1))
            return response_logprobs(model, batch, temperature)
        return response_logprobs(model, batch, temperature * WRONG_TEMPERATURE)

    if name == "sign-advantage":
        module.policy_loss = lambda lp, old, advantages, *rest, **kw: policy_loss(lp, old, -advantages, *rest, **kw)
    elif name == "sign-loss":
        def negated(*args, **kwargs):
            loss, *rest = policy_loss(*args, **kwargs)
            return (-loss, *rest)
        module.policy_loss = negated
    elif name != "none":
        common.response_logprobs = planted_logprobs


if __name__ == "__main__":
    from benchmarks.gpu_check_runs import observe
    name, trainer, report = sys.argv[1:4]
    if name not in PLANTS:
        sys.exit(f"unknown plant {name!r}: one of {', '.join(PLANTS)}")
    plant(name, trainer)
    observe(trainer, report, sys.argv[sys.argv.index("--") + 1:])
