"""A training run's plumbing around a trainer's loop (Run): the run folder and its logs, the evaluation schedule,
checkpoints and resume, skipped non-finite updates, stopping on Ctrl-C or SIGTERM at a safe point, whole steps saved
(stop.py), and the summary at the end. Every check that can be made runs before the run folder exists; a start that
finishes no step leaves no folder behind (run_main).
"""
import contextlib
import os
import shutil
import sys
import time

import torch
from tqdm import tqdm

from infra import UserError, data, dist, memory, progress, threads, verifier
from infra.checkpoint import _checkpoint_steps, load_checkpoint, rng_state, save_checkpoint, seed_everything
from infra.checks import check_integrations
from infra.engine import check_generator, make_generator, stop_token_ids
from infra.evaluate import eval_table, evaluate
from infra.hub import check_dataset_sources, check_model_source
from infra.log import Logger
from infra.resume import command, continue_hint, resume_point, resume_record, run_directory, summary
from infra.samples import SampleLog, rollout_records, shown
from infra.stop import StopNow, StopSignals, safe_point


def run_main(main):
    """Run a trainer's main(): a UserError becomes a one-line message and exit code 2, a second Ctrl-C code 130, a
    stop at a safe point (StopNow) the run's summary (Run.stop_now) and code 0. On the way out the run is closed
    (Run.close): a start that finished no step leaves no folder behind."""
    hint, finished = True, False  # hint: after an interrupt or a crash, say how to continue
    try:
        main()
        hint, finished = False, True
    except UserError as error:
        hint = False
        if dist.rank() == 0:
            print(f"{os.path.basename(sys.argv[0])}: error: {error}", file=sys.stderr)
        sys.exit(2)
    except StopNow:
        hint, finished = False, True
        for run in list(_OPEN_RUNS):
            run.stop_now()
    except KeyboardInterrupt:
        sys.exit(130)
    finally:
        for run in list(_OPEN_RUNS):
            run.close(hint)
        if dist.sharded() and torch.distributed.is_initialized():
            if finished and dist.distributed():  # finished: no rank tears down while another still uses the group
                torch.distributed.barrier()  # (after a crash the others may never get here)
            torch.distributed.destroy_process_group()


_OPEN_RUNS = []  # runs whose folder this process opened: run_main closes them on the way out


class Run:
    """One training run around a trainer's loop:

        run = Run(args, __file__)                 # devices, run folder, data: bad input fails before any model loads
        generator = run.start(models, optimizers, tokenizer)   # logging, --resume, the rollout engine
        for step, metrics in run.steps():         # metrics holds the evaluation when one is due
            ...                                   # rollout, reward, advantages, update
            run.end_step(step, metrics)           # last evaluation, log line, checkpoint (Ctrl-C: infra.stop)
    """

    def __init__(self, args, trainer_file):
        self.args = args
        check_integrations(args)  # --device, --output-dir; --tensorboard, --wandb-project: importable
        self.device = dist.init_device(args.device, args.offload_optimizer and not args.plan_only)  # a process group
        if not args.plan_only:  # --generator vllm: runnable here (--plan-only plans it anywhere)
            check_generator(args.generator, self.device)
        check_model_source(args.model)  # a missing --model fails in one line, in seconds (offline too)
        if getattr(args, "critic_model", ""):  # PPO-family: the critic's backbone, checked the same way
            check_model_source(args.critic_model, "--critic-model")
        if not args.plan_only:  # torch's threads, from what the cores can give now: the run's first line
            threads.use_threads(args.threads)
        data_error = None
        try:  # the data before the plan: its prompts' lengths (--plan-only plans without it if it cannot be read)
            check_dataset_sources("" if args.eval_only else args.dataset, args.eval_datasets,  # offline: one line
                                  [f"--answer-format {args.answer_format}"] * (args.answer_format != "auto"))
            self.train_rows = [] if args.eval_only else data.load_rows(
                args.dataset, "train", n_builtin=65536, seed=args.seed, skip_bad_rows=args.skip_bad_rows,
                question_field=args.question_field, answer_field=args.answer_field, answer_format=args.answer_format)
            self.eval_sets = data.load_eval_sets(args.eval_datasets, args.eval_problems, args.skip_bad_rows,
                                                args.dataset)
            known = (self.train_rows, self.eval_sets)
        except UserError as error:  # the plan is made all the same (from an allowance): both refusals come at once
            data_error, known = error, f"the data could not be read, its prompts are not known ({error})" * \
                args.plan_only
        try:  # the memory plan per GPU, refused if it cannot fit (--plan-only exits); vLLM's share (auto: what is left)
            self.gpu_share = memory.check(args, trainer_file, self.device, known)
        except UserError as error:
            raise UserError(f"{data_error}; also, {error}" if data_error else str(error)) from None
        if data_error:
            raise data_error
        if self.device.startswith("cpu") or args.offload_optimizer:  # host memory: freed blocks reused, not re-faulted
            memory.keep_freed_host_memory()
        self.dir = run_directory(args, trainer_file)  # a clash with an existing run fails before any model loads
        self.resume_path, self.resumed_step = resume_point(args.resume)[1:] if args.resume else (None, 0)
        if dist.rank() == 0:  # what was chosen, by whom, and what auto decided, before any model loads
            print(*data.choices(args, os.path.basename(trainer_file)), *[data.describe(args.dataset, self.train_rows)]
                  * bool(self.train_rows), *(data.describe(name, rows) for name, rows in self.eval_sets.items()),
                  sep="\n")
            if not self.eval_sets:
                print(data.NO_EVAL_SETS)
        self.probe_rows = next(iter(self.eval_sets.values()), [])  # probes' prompts (--probe-every needs held-out sets)
        self.skipped_in_a_row, self.stopping, self.saved, self.evaluations = 0, False, False, []  # (step, metrics)
        self.step_rng, self.updated_step = None, None  # the RNG states as the current step began; its last update
        self.trainer, self.started = os.path.basename(trainer_file), time.time()
        seed_everything(args.seed)

    def start(self, models, optimizers, tokenizer):
        """Open the run folder's logs, restore --resume's checkpoint, build the rollout engine (returned)."""
        self.models, self.optimizers, self.tokenizer = models, optimizers, tokenizer
        self.entries_before = os.listdir(self.dir) if os.path.isdir(self.dir) else None  # None: this run makes it
        _OPEN_RUNS.append(self)  # run_main closes it on the way out
        self.logger = Logger(self.dir, self.args, resume_record(self.args, self.dir, self.resume_path,
                                                                self.resumed_step))  # a resume: its own record
        self.start_step = load_checkpoint(self.resume_path, models, optimizers) if self.resume_path else 0
        self.samples = SampleLog(self.dir, self.start_step if self.resume_path else None)  # samples.jsonl
        progress.watch(models.values())  # the update's start and pace, for the progress display
        self.generator = make_generator(self.args.generator, models["policy"], tokenizer,
                                        self.gpu_share, self.args.seed, self.args.vllm_kv_cache_gib,
                                        [self.train_rows, *self.eval_sets.values()],  # vLLM: max_model_len
                                        max(getattr(self.args, "max_response_tokens", 0), self.args.eval_max_tokens),
                                        self.args.hf_batch_size)
        if dist.rank() == 0:  # EOS, generation_config's EOS ids, the chat template's turn end: both engines' stops
            print("rollouts stop at " + ", ".join(f"{tokenizer.convert_ids_to_tokens(i)} ({i})"
                                                   for i in stop_token_ids(models["policy"], tokenizer)))
        if not all(name.startswith("builtin") for name in (self.args.dataset, *self.args.eval_datasets)):
            verifier.CHECKER.prestart()  # the answer checker starts beside the first rollout, not in its first check
            # (the built-in task's answers are numbers, compared in-process: it seldom needs the checker at all)
        return self.generator

    def close(self, hint=False):
        """On the way out (run_main calls it, before it destroys the process group): the rollout engine shuts down;
        a start that logged no step and saved nothing removes what it wrote in the run folder (the folder too, if it
        made it), so no folder blocks a restart; with `hint` (after an interrupt or a crash) says which command
        continues the run."""
        if self in _OPEN_RUNS:
            _OPEN_RUNS.remove(self)
        generator, self.generator = getattr(self, "generator", None), None
        if generator is not None:  # a vLLM engine shuts down while the process group it joined is still there
            generator.close()
        if dist.rank() > 0:
            return
        logger = getattr(self, "logger", None)
        if logger is not None and logger.tensorboard:
            logger.tensorboard.close()
        if logger is not None and logger.wandb:
            logger.wandb.finish()
        if not (logger and logger.records) and not self.saved and os.path.isdir(self.dir):
            for name in set(os.listdir(self.dir)) - set(self.entries_before or ()):
                path = os.path.join(self.dir, name)
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.remove(path)
            if self.entries_before is None and not os.listdir(self.dir):
                os.rmdir(self.dir)
        if hint:
            print(continue_hint(self.dir), file=sys.stderr)

    def training_rows(self, step):
        """This rank's share of the prompts of rollout `step` (a function of the step: exact resume), x --oversample."""
        count = self.args.prompts_per_step * getattr(self.args, "oversample", 1)  # prime.py's filter keeps 1/oversample
        return dist.rank_share(data.step_rows(self.train_rows, step, count, self.args.seed))

    def evaluate(self, step):
        """Held-out evaluation with the --eval-* flags (its own seed: training randomness is untouched) of the
        weights after `step` steps; prints the table and two responses; every sample goes to samples.jsonl."""
        a, records = self.args, []
        if not self.eval_sets:  # no --eval-datasets: nothing to evaluate
            return {}
        metrics = evaluate(self.generator, self.tokenizer, self.eval_sets, a.eval_n, a.eval_max_tokens,
                           a.eval_temperature, a.eval_top_p, samples=records)
        progress.phase(None)
        self.write("\n".join([eval_table(metrics), *shown(records)]))
        self.samples.add(step, records)
        self.evaluations.append((step, metrics))  # those that ran, for the summary
        return metrics

    def evaluate_only(self):
        """--eval-only: evaluate the loaded policy, log it as the current step, and return the metrics."""
        self.write = print
        with progress.shown_alone():
            metrics = self.evaluate(self.start_step)
        self.logger.log(self.start_step, metrics, lambda line: None)
        self.close()
        return metrics

    def steps(self):
        """(step, metrics) for each remaining step, under a progress bar; metrics starts with the held-out
        evaluation at the first step and every --eval-every steps. The first Ctrl-C or SIGTERM stops at the next safe
        point (infra.stop): in this evaluation too (stop_now)."""
        self.signals = StopSignals()
        self.bar = bar = tqdm(range(self.start_step, self.args.steps), desc=os.path.basename(self.dir),
                              initial=self.start_step, total=self.args.steps, disable=dist.rank() > 0)
        self.write = bar.write
        progress.activate(progress.for_bar(bar, bar.write, self.args))  # what a long step has done so far
        try:
            for step in bar:
                progress.phase(None, step)
                self.step, self.step_rng, self.signals.safe = step, None, True  # no optimizer step yet: may stop
                due = step == self.start_step or (self.args.eval_every and step % self.args.eval_every == 0)
                try:
                    metrics = self.evaluate(step) if due else {}
                except StopNow:  # a Ctrl-C in this evaluation
                    self.stop_now()
                    self.close()
                    return
                self.step_rng = rng_state()  # what a checkpoint of this step's start holds (update_ok, stop_now)
                progress.phase("rollout")
                yield step, metrics
                if self.stopping:
                    break
            bar.close()
            if dist.rank() == 0:
                print(summary(self, step + 1))
            self.close()  # finished: its logs are closed here (run_main closes a run that did not finish)
        finally:
            progress.deactivate()
            self.signals.restore()

    def update_ok(self, step, *grad_norms):
        """Whether an optimizer step may be taken: all gradient norms finite. After --max-skipped-updates
        non-finite ones in a row the run stops with the state of the step's start, the last whole one: saved as
        checkpoint step_<step> (weights, optimizers and the RNG states as the step began: a resume repeats the step
        exactly) if no update of this step was taken; else it is gone (keeping a copy would cost the weights and
        optimizer states again), nothing is saved, and the message names the latest checkpoint to resume from."""
        if self.signals.safe:  # the step's first optimizer step: the last point where it may stop with nothing lost
            safe_point(lockstep=True)
            self.signals.safe = False
        progress.optimizer_step()
        finite = all(bool(torch.isfinite(norm)) for norm in grad_norms)
        self.skipped_in_a_row = 0 if finite else self.skipped_in_a_row + 1
        self.updated_step = step if finite else self.updated_step
        if self.skipped_in_a_row < self.args.max_skipped_updates:
            return finite
        rates = ", ".join(f"--{name.replace('_', '-')} {getattr(self.args, name):g}" for name in ("lr", "critic_lr")
                          if hasattr(self.args, name))
        stop = f"{self.skipped_in_a_row} non-finite updates in a row at step {step} (the likely cause: a learning " \
               f"rate too high, {rates})"
        if self.updated_step != step:
            raise UserError(f"{stop}; the last good state is saved in {self.save(step, self.step_rng)} (as step "
                            f"{step} began)")
        steps = [done for done in _checkpoint_steps(os.path.join(self.dir, "checkpoints")) if done <= step]
        latest = os.path.join(self.dir, "checkpoints", f"step_{steps[-1]:06d}") if steps else None
        again = command("--resume", self.dir) if self.logger.records else command(*sys.argv[1:])  # no folder left
        raise UserError(f"{stop}, after updates of that step, so the weights hold part of it and nothing is saved; "
                        + (f"the last good state is {latest}: continue with {command('--resume', latest)}" if latest
                           else f"no checkpoint was saved before it; to start again: {again}"))

    def end_step(self, step, metrics):
        """After a step's update: the evaluation after the last one, the log line and record, the checkpoint
        (every --save-every steps, at the end, and on Ctrl-C or SIGTERM, which then stops the run)."""
        progress.phase(None)
        self.signals.safe = True  # the update is whole: a stop in the last evaluation skips it, saving the step
        self.samples.add(step, rollout_records(self.training_rows(step), self.tokenizer, self.args))
        if step == self.args.steps - 1:
            with contextlib.suppress(StopNow):
                metrics.update(self.evaluate(step + 1))
        if self.device.startswith("cuda"):  # this process's allocations so far (not vLLM's own pool), against the plan
            metrics["gpu_peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2 ** 30
        self.logger.log(step, metrics, self.write)
        self.stopping = self.signals.requested
        if self.args.save_every and (step + 1) % self.args.save_every == 0 or step == self.args.steps - 1 \
                or self.stopping:
            self.save(step + 1)
        if self.stopping:
            self.write(f"{self.signals.signalled or 'another rank was signalled'}: stopped after step {step}, "
                       f"saved as step_{step + 1:06d}")

    def stop_now(self):
        """After StopNow in step self.step (no optimizer step taken): the state the step began with is saved, unless
        a checkpoint holds it already, and the summary printed; the step's work is dropped (a resume repeats it
        exactly). A new run stopped in step 0 keeps nothing (Run.close removes its folder)."""
        self.bar.close()
        progress.deactivate()
        self.signals.restore()
        step, signal = self.step, self.signals.signalled or "another rank was signalled"
        if step > self.start_step and step not in _checkpoint_steps(os.path.join(self.dir, "checkpoints")):
            self.save(step, self.step_rng or rng_state())
        if dist.rank() > 0:
            return
        if step == 0 and not self.resume_path and not self.logger.records:
            print(f"{signal}: stopped in step 0, nothing to keep; to start again: {command(*sys.argv[1:])}")
            return
        print(f"{signal}: stopped in step {step}, before its update, which a resume repeats", summary(self, step),
              sep="\n")

    def save(self, step, rng=None):
        self.saved = True
        signals = getattr(self, "signals", None)
        with signals.writing() if signals else contextlib.nullcontext():
            return save_checkpoint(self.dir, step, self.models, self.optimizers, self.tokenizer,
                                   self.args.keep_checkpoints, rng)
