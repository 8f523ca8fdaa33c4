"""Every loss term a flag switches on in a trainer's update, run through that trainer's own loop (one step, in-process,
a scripted rollout) with that term alone, checked for its direction and its scale against the rule computed here.

The terms, read from each file's Args and main() (none of the six has an entropy bonus or a value coefficient):
- the k3 KL to the frozen reference, beta = --kl-coef, in all of them: reduced like the policy loss in grpo.py,
  prime.py and the ppo.py family (token-mean; ppo.py's and sp3o.py's published seq-mean), by SPO's released rule in spo.py (kl_loss:
  k3 summed over each sequence's probability-masked tokens, averaged over the sequences);
- the critic's value loss in ppo.py, sp3o.py (dense in the warm-up, at the anchors after), tppo.py, sppo.py, vapo.py:
  always on, its own model and optimizer, no coefficient flag (its step size is --critic-lr's), so only its direction.
(vapo.py's positive-example LM loss, --nll-coef: tests/test_vapo.py, through this file's run_one_step; prime.py's
implicit PRM, its own model and loss: tests/test_prime.py.)

KL. The reference is the checkpoint; the policy starts from it perturbed (every weight times 1 + 0.05 N(0, 1), a
fixed seed), so the KL is not 0 before the first update (with policy = reference it and its gradient are 0). Every
response is the scripted engine's, cut at the length limit: every reward 0, so every advantage is exactly 0 (GRPO:
equal rewards in a group; PRIME, its process rewards off: R's leave-one-out, 0; SPO: R = 0 and Monte Carlo values 0; PPO and SP3O: a critic head set to 0 reads V = 0;
SPPO: a head reading f(x) = -1e4, V(x) = 0; TPPO: V = 1/2 everywhere, whitened to 0). The policy loss then has no
gradient and the update is beta x the KL's alone. Checked against the KL computed here with a plain forward pass:
- direction: after one optimizer step the KL to the reference (the same tokens, the same reduction) is lower;
- scale: the logged loss is beta x that KL (a flipped sign logs -beta KL) and the logged gradient norm (before
  clipping) is beta x the norm of the KL's gradient computed here; with 2 beta both double. (AdamW's first step is
  about lr x sign(g) per weight whatever beta is: the weights' change does not double, the gradient does.)
Value losses: --critic-warmup 1 freezes the actor at step 0 (SP3O's anchors: --critic-warmup 0; the critic is its own
model, the actor's loss never reaches it); every response is correct (reward 1). The logged value loss is the rule's
loss of the critic as it starts (computed here), and one critic step lowers it.
SPO-tree and SPO-chain share the update: chain (the default) is run."""
import copy
import importlib
import math
import os
import sys

import pytest
import torch

import common
import infra.run
from helpers import records, with_forks
from scripted_engine import ScriptedEngine

RESPONSE_TOKENS = 20  # every scripted response has exactly this many tokens (a boxed 7-digit sum: 15)
ONE_UPDATE = ["--steps", 1, "--mini-batches", 1, "--epochs", 1, "--prompts-per-step", 2, "--samples-per-prompt", 4,
              "--micro-batch-size", 4, "--max-response-tokens", RESPONSE_TOKENS, "--eval-problems", 1, "--eval-n", 1,
              "--eval-max-tokens", 8, "--temperature", 1.0, "--lr", 3e-5, "--weight-decay", 0.0, "--seed", 0]
CRITIC = ["--critic-epochs", 1, "--critic-warmup", 0]
SPPO = ["--samples-per-prompt", 1, "--prompts-per-step", 8]  # SPPO: one sample per prompt

# trainer: (its flags, the critic head's bias (its weights set to 0) that makes every advantage 0 at reward 0, or None
# to leave it, the KL's reduction). ppo.py and sp3o.py at their published seq-mean, TPPO with its published whitening.
KL_CASES = with_forks({
    "grpo": (["--aggregation", "token-mean"], None, "token-mean"),
    "ppo": (CRITIC + ["--aggregation", "seq-mean"], 0.0, "seq-mean"),
    "sp3o": (CRITIC + ["--aggregation", "seq-mean"], 0.0, "seq-mean"),
    "tppo": (CRITIC + ["--aggregation", "token-mean", "--whiten-advantages"], None, "token-mean"),
    "sppo": (CRITIC + SPPO + ["--aggregation", "token-mean"], -1e4, "token-mean"),
    "spo": (["--aggregation", "token-mean", "--mc-samples", 3, "--lr-schedule", "constant", "--whiten-advantages"],
            None, "spo"),
    # PRIME: the PRM's process rewards are not 0 even at R = 0 (the PRM learns from the rollout): the outcome alone
    "prime": (["--aggregation", "token-mean", "--process-coef", 0.0], None, "token-mean"),
})
BETAS = {"spo": 1e-4}  # SPO's published beta; the others publish none (the KL is off): 1e-3


def perturb(model, scale=0.05, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1 + scale * torch.randn(parameter.shape, generator=generator))
    return model


def run_one_step(monkeypatch, output_dir, trainer, argv, finish, perturb_policy=False, critic_bias=None):
    """One step of `trainer` with every rollout from ScriptedEngine(finish). Returns (step 0's record, models) with
    models: the policy, reference and critic objects after the run, the policy and critic as they started (copies),
    and the rollout (each sample's prompt, the batch, the rewards by finish: 1 stopped, 0 cut)."""
    models, rollouts = {}, []

    def load_model(name, *args, value_head=0, **kwargs):
        model, tokenizer = real_load_model(name, *args, value_head=value_head, **kwargs)
        if value_head:
            if critic_bias is not None:
                with torch.no_grad():
                    model.score.weight.zero_()
                    model.score.bias.fill_(critic_bias)
            models["critic"], models["critic_start"] = model, copy.deepcopy(model)
        elif "policy" not in models:  # the trainers load the policy first, then the reference
            models["policy"] = perturb(model) if perturb_policy else model
            models["policy_start"] = copy.deepcopy(model)
        else:
            models["reference"] = model
        return model, tokenizer

    class Engine(ScriptedEngine):
        def generate(self, prompts, n=1, max_tokens=256, *args, **kwargs):
            completions = super().generate(prompts, n, max_tokens, *args, **kwargs)
            if max_tokens == RESPONSE_TOKENS and not rollouts:  # the rollout (evaluation: 8 tokens; Monte Carlo:
                rollouts.append((prompts, completions))  # after the rollout)
            return completions

    real_load_model = common.load_model
    monkeypatch.setattr(common, "load_model", load_model)
    monkeypatch.setattr(infra.run, "make_generator", lambda kind, model, tokenizer, *a, **k: Engine(tokenizer, finish))
    monkeypatch.setattr(sys, "argv", [f"{trainer}.py", *map(str, argv), "--run-name", "run", "--output-dir",
                                      str(output_dir)])
    importlib.import_module(trainer).main()
    (prompts, completions), = rollouts
    models["prompts"] = [prompts[c.prompt_index] for c in completions]
    models["batch"] = common.sequence_batch(models["prompts"], [c.token_ids for c in completions],
                                            models["policy"].config.pad_token_id)
    models["rewards"] = torch.tensor([float(c.finish_reason == "stop") for c in completions])
    return records(os.path.join(output_dir, "run"))[0], models


def plain_outputs(model, batch):
    """[B, T, ...] a plain full forward pass's outputs at the states before each response token (column P - 1 + t)."""
    prompt_width = batch.input_ids.shape[1] - batch.response_width
    logits = model(**batch.model_inputs()).logits.float()
    return logits[:, prompt_width - 1:prompt_width - 1 + batch.response_width]


def plain_logprobs(model, batch):
    """[B, T] log pi(y_t | s_t) at temperature 1, from a plain forward pass and log-softmax."""
    logprobs = torch.log_softmax(plain_outputs(model, batch), -1)
    return logprobs.gather(-1, batch.response_ids[..., None])[..., 0]


def kl_by_rule(logprobs, reference_logprobs, mask, reduction):
    """The KL term by its rule: k3 = exp(d) - d - 1, d = log ref - log pi, per token (Schulman 2020), reduced as the
    trainer's loss: token-mean, seq-mean (each sequence's token mean, then the mean), or SPO's released sum over each
    sequence's tokens, then the mean over sequences."""
    d = reference_logprobs - logprobs
    k3 = (torch.exp(d) - d - 1) * mask
    if reduction == "token-mean":
        return k3.sum() / mask.sum()
    if reduction == "seq-mean":
        return (k3.sum(1) / mask.sum(1)).mean()
    assert reduction == "spo"
    return k3.sum(1).mean()


@pytest.fixture(scope="module")
def kl_run(tmp_path_factory):
    """kl_run(trainer, beta) -> (step 0's record, the KL by the rule before and after the step, the norm of its
    gradient at the start); cached: the tests share runs."""
    cache = {}

    def run(trainer, beta):
        if (trainer, beta) not in cache:
            flags, critic_bias, reduction = KL_CASES[trainer]
            with pytest.MonkeyPatch.context() as monkeypatch:
                record, models = run_one_step(monkeypatch, tmp_path_factory.mktemp(trainer), trainer.removesuffix(
                    ".py"), ONE_UPDATE + flags + ["--kl-coef", beta], "length", True, critic_bias)
            batch, start, policy = models["batch"], models["policy_start"], models["policy"]
            assert torch.all(models["rewards"] == 0)  # every response cut at the limit: every advantage 0
            with torch.no_grad():
                reference = plain_logprobs(models["reference"], batch)
                start_logprobs = plain_logprobs(start, batch)
                mask = batch.response_mask
                if reduction == "spo":  # SPO's probability mask: p < 0.9 under the policy that sampled (old)
                    mask = mask & (start_logprobs.exp() < 0.9)
                after = kl_by_rule(plain_logprobs(policy, batch), reference, mask, reduction).item()
            before = kl_by_rule(plain_logprobs(start, batch), reference, mask, reduction)
            gradients = torch.autograd.grad(before, [p for p in start.parameters()])
            gradient_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in gradients])).item()
            cache[trainer, beta] = record, before.item(), after, gradient_norm, int(mask.sum())
        return cache[trainer, beta]
    return run


@pytest.mark.parametrize("trainer", list(KL_CASES))
def test_one_step_of_the_kl_term_alone_lowers_the_kl_to_the_reference(kl_run, trainer):
    beta = BETAS.get(trainer, 1e-3)
    record, before, after, gradient_norm, tokens = kl_run(trainer, beta)
    assert tokens >= 8 and before > 1e-3, (tokens, before)  # a KL worth moving, on enough tokens
    assert after < before, f"{trainer}: one step of beta x KL moved the KL to the reference from {before} to {after}"
    # The step is about lr x sign(gradient) on each of ~0.5M weights: a first-order drop of a visible share
    assert after < 0.99 * before, (before, after)
    # The logged loss is beta x KL (the policy loss is 0 at zero advantages), its gradient beta x the KL's
    assert record["policy_loss"] == pytest.approx(beta * before, rel=1e-4), (record["policy_loss"], beta * before)
    assert record["grad_norm"] == pytest.approx(beta * gradient_norm, rel=1e-3), (record["grad_norm"],
                                                                                 beta * gradient_norm)


@pytest.mark.parametrize("trainer", list(KL_CASES))
def test_twice_the_kl_coefficient_doubles_the_term(kl_run, trainer):
    beta = BETAS.get(trainer, 1e-3)
    once, twice = kl_run(trainer, beta)[0], kl_run(trainer, 2 * beta)[0]
    assert twice["policy_loss"] == pytest.approx(2 * once["policy_loss"], rel=1e-5)
    assert twice["grad_norm"] == pytest.approx(2 * once["grad_norm"], rel=1e-5)
    assert once["policy_loss"] > 0  # beta x a KL, >= 0 by construction of k3: a flipped sign logs it negative


def value_loss_by_rule(critic, batch, prompts, rewards, rule):
    """The critic's loss by its rule, on the rollout, with values from a plain forward pass: (V_t - R)^2 (gamma =
    lambda = 1: every return is R) on every valid token (dense) or at SP3O's anchors, each sequence's mean, then the
    mean over sequences; TPPO's BCE(sigmoid(z_t), R), z_t = z_0 + the increments up to t (the shared head's outputs
    at s_0 .. s_t), token-mean; SPPO's BCE(sigmoid(f(x)), R), f(x) the output at the prompt's last token."""
    with torch.no_grad():
        if rule == "sppo":
            prompt_batch = common.sequence_batch(prompts, [[] for _ in prompts], critic.config.pad_token_id)
            logits = plain_outputs(critic, prompt_batch)[:, 0, 0]
            return torch.nn.functional.binary_cross_entropy_with_logits(logits, rewards).item()
        outputs, mask = plain_outputs(critic, batch)[..., 0], batch.response_mask
        assert mask.all()  # every scripted response has RESPONSE_TOKENS tokens: no padding to skip below
        targets = rewards[:, None].expand_as(outputs)
        if rule == "tppo":
            return torch.nn.functional.binary_cross_entropy_with_logits(outputs.cumsum(1), targets).item()
        squares = (outputs - targets) ** 2
        if rule == "anchors":  # n = 20 valid tokens, L = 19: round(19 x (0.3, 0.6, 0.9)) = 6, 11, 17 (cap 18)
            squares = squares[:, [6, 11, 17]]
        return squares.mean(1).mean().item()


WARMUP = ["--critic-epochs", 1, "--critic-warmup", 1]  # step 0 trains the critic alone
VALUE_CASES = {  # the ppo.py and sp3o.py critics at their published seq-mean (one sample weighs 1)
    "ppo": ("ppo", WARMUP + ["--aggregation", "seq-mean"], "dense"),
    "sp3o-warmup": ("sp3o", WARMUP + ["--aggregation", "seq-mean"], "dense"),
    "sp3o-anchors": ("sp3o", ["--critic-epochs", 1, "--critic-warmup", 0, "--aggregation", "seq-mean"], "anchors"),
    "tppo": ("tppo", WARMUP, "tppo"),
    "sppo": ("sppo", WARMUP + SPPO, "sppo"),
    "vapo": ("vapo", WARMUP, "dense"),  # value-pretraining: token-mean, every response 20 tokens (= seq-mean here)
}


@pytest.mark.parametrize("case", list(VALUE_CASES))
def test_one_critic_step_lowers_the_value_loss(case, monkeypatch, tmp_path):
    trainer, flags, rule = VALUE_CASES[case]
    record, models = run_one_step(monkeypatch, tmp_path, trainer, ONE_UPDATE + flags, "stop")
    assert record["reward"] == 1.0 and torch.all(models["rewards"] == 1)  # every response correct
    assert "policy_loss" not in record or rule == "anchors"  # the warm-up: the actor waits
    start = models["critic_start"]
    if trainer == "tppo":  # tppo.py starts its head at 0: every z_t = 0, V_t = 1/2, BCE = ln 2
        with torch.no_grad():
            start.score.weight.zero_()
            start.score.bias.zero_()
    rollout = models["batch"], models["prompts"], models["rewards"]
    before, after = (value_loss_by_rule(critic, *rollout, rule) for critic in (start, models["critic"]))
    print(f"{case}: value loss logged {record['value_loss']:.6g}, by the rule {before:.6g} -> {after:.6g}")
    if trainer == "tppo":
        assert before == pytest.approx(math.log(2), rel=1e-6)
    assert record["value_loss"] == pytest.approx(before, rel=1e-4), (record["value_loss"], before)
    assert after < before, f"{case}: one critic step moved its loss from {before} to {after}"
