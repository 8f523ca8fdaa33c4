"""Bugs planted into a trainer run through the GPU check's harness (benchmarks/gpu_check_runs.observe), to show that
the check fails on each (tests/test_gpu_check.py). Nothing here is in the product code: each plant monkeypatches
the trainer's policy_loss, common.response_logprobs, the optimizers or the Hugging Face engine in this process
before the trainer runs; the harness measures with the unplanted common.response_logprobs.

    python tests/gpu_check_plants.py PLANT TRAINER REPORT -- TRAINER_FLAGS...

PLANT (PLANTS): none; sign-advantage (the loss gets -A); sign-loss (the loss is negated); shift (every trainer log-prob
is of the token one position on: log p(y_{t+1} | y_<t+1)); shift-update (only the update's log-probs, not the old
ones); temperature (every trainer log-prob at 0.7 x the sampling temperature); temperature-update (only the update's);
noop (every optimizer step at lr 0: an update that changes nothing); stale (the old log-probs of the policy one update
behind: the previous rollout's weights); mask-leak (the policy loss over every position of the response width, the
padding after shorter responses included); top-p-ignored (the engine samples from the nucleus but records the
log-probs of the whole distribution); no-clip (the policy loss with its clip range set to 1e9: never clipped).
"""
import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WRONG_TEMPERATURE = 0.7  # the planted log-prob temperature, as a multiple of the sampling temperature
PLANTS = ("none", "sign-advantage", "sign-loss", "shift", "shift-update", "temperature", "temperature-update", "noop",
          "stale", "mask-leak", "top-p-ignored", "no-clip")


def plant(name, trainer):
    """Install the bug `name` into this process (the trainer module `trainer` is imported here). Returns the
    unplanted common.response_logprobs, for the harness to measure with."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    import common
    import infra.engine
    module = __import__(trainer)
    policy_loss, response_logprobs, sequence_batch = module.policy_loss, common.response_logprobs, common.sequence_batch
    load_model, generate = common.load_model, infra.engine.HFGenerator.generate
    update_only = name.endswith("-update")  # the update's forward has gradients; the old log-probs' (batched) not
    kept = dict(policy=None, steps=0, seen=-1, current=None, previous=None)

    def planted_logprobs(model, batch, temperature=1.0):
        if update_only and not torch.is_grad_enabled():
            return response_logprobs(model, batch, temperature)
        if name.startswith("shift"):  # the target tokens read one position on (the last one kept)
            ids = batch.response_ids
            batch = dataclasses.replace(batch, response_ids=torch.cat([ids[:, 1:], ids[:, -1:]], 1))
            return response_logprobs(model, batch, temperature)
        return response_logprobs(model, batch, temperature * WRONG_TEMPERATURE)

    def stale_logprobs(model, batch, temperature=1.0):
        """The policy's old log-probs (no gradients) from the weights of the previous rollout."""
        if torch.is_grad_enabled() or model is not kept["policy"]:
            return response_logprobs(model, batch, temperature)
        if kept["seen"] != kept["steps"]:  # a new rollout: the weights it was sampled with are kept for the next
            kept["seen"], kept["previous"] = kept["steps"], kept["current"]
            kept["current"] = {key: value.detach().clone() for key, value in model.state_dict().items()}
        if kept["previous"] is None:
            return response_logprobs(model, batch, temperature)
        now = {key: value.detach().clone() for key, value in model.state_dict().items()}
        model.load_state_dict(kept["previous"])
        try:
            return response_logprobs(model, batch, temperature)
        finally:
            model.load_state_dict(now)

    def remembered_load_model(*args, **kwargs):
        loaded = load_model(*args, **kwargs)
        kept["policy"] = kept["policy"] or loaded[0]  # the six files load the policy first
        return loaded

    def counted(optimizer, args, kwargs):
        kept["steps"] += 1

    def zero_lr(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            group["lr"] = 0.0

    def whole_distribution(self, prompts, n=1, max_tokens=256, temperature=1.0, top_p=1.0):
        """The engine's completions with the log-probs of the policy at the temperature, top-p left out."""
        completions = generate(self, prompts, n, max_tokens, temperature, top_p)
        if top_p >= 1 or temperature <= 0:  # no nucleus: the right numbers already
            return completions
        batch = sequence_batch([prompts[c.prompt_index] for c in completions], [c.token_ids for c in completions],
                               self.tokenizer.pad_token_id).to(self.model.device)
        with torch.no_grad():
            full = common.batched(lambda micro: response_logprobs(self.model, micro, temperature), batch, 16)
        return [dataclasses.replace(c, logprobs=full[row, :len(c.token_ids)].tolist())
                for row, c in enumerate(completions)]

    if name == "sign-advantage":
        module.policy_loss = lambda lp, old, advantages, *rest, **kw: policy_loss(lp, old, -advantages, *rest, **kw)
    elif name == "sign-loss":
        def negated(*args, **kwargs):
            loss, *rest = policy_loss(*args, **kwargs)
            return (-loss, *rest)
        module.policy_loss = negated
    elif name == "noop":
        register_optimizer_step_pre_hook(zero_lr)
    elif name == "stale":
        common.load_model, common.response_logprobs = remembered_load_model, stale_logprobs
        register_optimizer_step_pre_hook(counted)
    elif name == "mask-leak":
        module.policy_loss = lambda lp, old, adv, mask, *rest, **kw: policy_loss(lp, old, adv, torch.ones_like(mask),
                                                                                 *rest, **kw)
    elif name == "no-clip":
        module.policy_loss = lambda lp, old, adv, mask, low, high, *rest, **kw: policy_loss(
            lp, old, adv, mask, 1e9, 1e9, *rest, **kw)
    elif name == "top-p-ignored":
        infra.engine.HFGenerator.generate = whole_distribution
    elif name != "none":
        common.response_logprobs = planted_logprobs
    return response_logprobs


if __name__ == "__main__":
    from benchmarks.gpu_check_runs import observe
    name, trainer, report = sys.argv[1:4]
    if name not in PLANTS:
        sys.exit(f"unknown plant {name!r}: one of {', '.join(PLANTS)}")
    measure = plant(name, trainer)
    observe(trainer, report, sys.argv[sys.argv.index("--") + 1:], measure=measure)
