"""How well a critic fits the initial policy's returns, per critic learning rate and passes per rollout: the measure
that chose the critic settings of `--preset smollm2` before any method ran (docs/real_model.md).

    OMP_NUM_THREADS=1 python benchmarks/critic_fit.py --lrs 1e-5 5e-5 2e-4 --rollouts 6
    OMP_NUM_THREADS=1 python benchmarks/critic_fit.py --lrs 5e-5 --rollouts 3 --critic-epochs 2   # the time of 2 passes

Each setting runs `ppo.py --preset smollm2` with the actor frozen throughout (--critic-warmup = --rollouts): the
value head on the policy's backbone trains on `--rollouts` rollouts of the initial policy, one after the other. The
explained variance of rollout k is measured before rollout k trains the critic (infra.probes.explained_variance of
the rollout's values against its returns), so it is out of sample: how well the critic trained on rollouts 0..k-1
predicts a fresh one. Printed per setting: the explained variance at each rollout, its mean over rollouts --from to
the last, and the seconds per step of rollout and critic update. Other flags go to every run (e.g. `--dataset
builtin:words2`).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lrs", nargs="+", default=["1e-5", "5e-5", "2e-4"], help="critic learning rates")
    parser.add_argument("--rollouts", type=int, default=6)
    parser.add_argument("--critic-epochs", type=int, default=1, help="critic passes over each rollout")
    parser.add_argument("--from", dest="first", type=int, default=2, help="mean explained variance from rollout N")
    parser.add_argument("--output-dir", default="runs/critic_fit")
    args, extra = parser.parse_known_args()
    rows = []
    for lr in args.lrs:
        name = f"ppo_lr{lr}_epochs{args.critic_epochs}"
        command = [sys.executable, "ppo.py", "--preset", "smollm2", "--steps", str(args.rollouts), "--critic-warmup",
                   str(args.rollouts), "--critic-lr", lr, "--critic-epochs", str(args.critic_epochs),
                   "--eval-datasets", "--output-dir", args.output_dir, "--run-name", name, *extra]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")))
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command[1:])} failed:\n{done.stderr[-3000:]}")
        with open(os.path.join(ROOT, args.output_dir, name, "metrics.jsonl")) as handle:
            records = [json.loads(line) for line in handle]
        evs = [r["explained_variance"] for r in records]
        rows.append((lr, evs, statistics.mean(evs[args.first:]), statistics.mean(r["rollout_s"] for r in records),
                     statistics.mean(r["update_s"] for r in records)))
        print(f"critic lr {lr}, {args.critic_epochs} pass(es): explained variance per rollout "
              f"{', '.join(f'{ev:.2f}' for ev in evs)}; rollout {rows[-1][3]:.0f} s, critic update {rows[-1][4]:.0f} s "
              f"per step (load {os.getloadavg()[0]:.1f})", flush=True)
    print(f"\n| critic lr | passes | explained variance at rollouts 0..{args.rollouts - 1} | mean from rollout "
          f"{args.first} | rollout s | critic update s |\n|---|---:|---|---:|---:|---:|")
    for lr, evs, mean, rollout_s, update_s in rows:
        print(f"| {lr} | {args.critic_epochs} | {', '.join(f'{ev:.2f}' for ev in evs)} | {mean:.2f} | "
              f"{rollout_s:.0f} | {update_s:.0f} |")


if __name__ == "__main__":
    main()
