"""The run's logs: config.json (the settings), metrics.jsonl (one JSON object per step), the step line on stdout
(at most 120 columns), TensorBoard and Weights & Biases when asked.
"""
import dataclasses
import json
import os

import numpy as np

from infra import UserError, dist


class Logger:
    # The step line: what a user acts on, in this order, cut to 120 columns; every metric goes to metrics.jsonl.
    SHOWN = {"reward": "reward", "eval/accuracy": "eval", "response_length": "len", "policy_loss": "loss",
             "value_loss": "vloss", "clip_fraction": "clip", "approx_kl": "kl", "grad_norm": "gnorm",
             "explained_variance": "ev", "probe/sign_acc_tau1": "sign", "mc_tokens": "mc_tok", "tokens_per_s": "tok/s"}

    def __init__(self, run_dir, args, resume_record=None):
        """Writes the run's settings: config.json for a new run; a resumed run never overwrites them, it writes its
        own record (config.resume_<step>.json: the checkpoint, the flags changed, the settings in effect)."""
        self.path, self.tensorboard, self.wandb, self.records = os.path.join(run_dir, "metrics.jsonl"), None, None, 0
        if dist.rank() > 0:  # under torchrun rank 0 writes for all
            return
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, "config.json")
        if resume_record is not None:
            path = os.path.join(run_dir, f"config.resume_{resume_record['step']:06d}.json")
            for again in range(2, 1000):  # resumed from the same step before: keep that record too
                if not os.path.exists(path):
                    break
                path = os.path.join(run_dir, f"config.resume_{resume_record['step']:06d}_{again}.json")
        with open(path, "w") as handle:
            json.dump(resume_record or dataclasses.asdict(args), handle, indent=1)
        if args.tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tensorboard = SummaryWriter(run_dir)
        if args.wandb_project:
            import wandb
            try:
                self.wandb = wandb.init(project=args.wandb_project, name=os.path.basename(run_dir),
                                        config=dataclasses.asdict(args))
            except Exception as error:  # not logged in, no network, ...
                raise UserError(f"--wandb-project: wandb.init failed ({type(error).__name__}: "
                                f"{str(error).splitlines()[0] if str(error) else ''}); run `wandb login`, or set "
                                "WANDB_MODE=offline")

    def log(self, step, metrics, write=print):
        """Under torchrun every rank calls it: a metric is the mean of the ranks' values (each rank's losses are
        already its estimate of the global one)."""
        shares = dist.gather_objects({k: float(v) for k, v in metrics.items()})
        record = {"step": step, **{k: float(np.mean([s[k] for s in shares if k in s]))
                                   for k in dict.fromkeys(k for s in shares for k in s)}}
        if dist.rank() > 0:
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        self.records += 1
        write(self.step_line(record))
        if self.tensorboard:
            for key, value in record.items():
                if key != "step":
                    self.tensorboard.add_scalar(key, value, step)
        if self.wandb:
            self.wandb.log(record, step=step)


    def step_line(self, record):
        """`step   12 reward 0.461 len 38.4 loss -0.00305 ...`, at most 120 characters; `(critic warm-up)` while
        the actor is frozen."""
        line = f"step {record['step']:4d}" + (" (critic warm-up)" if record.get("actor_frozen") else "")
        for key, label in self.SHOWN.items():
            if key in record:
                value = record[key]
                part = f" {label} {value:.0f}" if abs(value) >= 100 else f" {label} {value:.3g}"
                line += part if len(line) + len(part) <= 120 else ""
        return line
