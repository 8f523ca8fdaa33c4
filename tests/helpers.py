"""Helpers several test files share: reading a run's metrics, comparing two runs' records, killing a run to resume
it, the trainers' tables of flags extended to forks, the checks of the Qwen-like fixture's turn end (with HF
generate and with vLLM), and hub datasets written into a local `datasets` cache."""
import contextlib
import difflib
import glob
import json
import math
import os
import shutil
import signal
import subprocess
import time

import infra.checkpoint
import infra.cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def changed_lines(root, parent, name):
    """Lines `diff parent.py name.py` marks with < or > (GNU diff where there is one, else difflib)."""
    a, b = (os.path.join(root, f"{n}.py") for n in (parent, name))
    if shutil.which("diff"):
        output = subprocess.run(["diff", a, b], capture_output=True, text=True).stdout
        return sum(line[:1] in "<>" for line in output.splitlines() if line)
    with open(a) as x, open(b) as y:
        return sum(line[:1] in "+-" for line in difflib.unified_diff(x.readlines(), y.readlines(), n=0)
                   if not line.startswith(("+++", "---")))


def with_forks(table, root=REPO):
    """A test's {trainer: flags} table (keys `ppo` or `ppo.py`) for every trainer found (infra.cli.trainers): a fork
    the table lacks takes the flags of the trainer in it whose file it differs from least, so no fork is left out."""
    stems = {key[:-3] if key.endswith(".py") else key: key for key in table}
    extended = dict(table)
    for name in infra.cli.trainers(root):
        if name not in stems:
            nearest = min(stems, key=lambda known: changed_lines(root, known, name))
            extended[name + ".py" * stems[nearest].endswith(".py")] = table[stems[nearest]]
    return extended


def records(run_dir):
    """The last metrics record of each step (a resumed run logs the steps after its checkpoint again)."""
    by_step = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        for line in handle:
            record = json.loads(line)
            by_step[record["step"]] = record
    return by_step


TIMING_KEYS = {"rollout_s", "update_s", "tokens_per_s"}  # wall-clock figures: never equal between two runs


def assert_same_records(a, b, steps, resumed_from=None, shown=("reward", "policy_loss", "grad_norm")):
    """Records a and b ({step: record}) hold steps 0..steps-1 and, at each step, exactly equal floats under every key
    both have except the timings. Returns a line per step showing the `shown` keys side by side."""
    assert sorted(a) == sorted(b) == list(range(steps))
    lines = []
    for step in range(steps):
        keys = (set(a[step]) & set(b[step])) - TIMING_KEYS
        assert {k: a[step][k] for k in keys} == {k: b[step][k] for k in keys}, step
        lines.append(f"  step {step}: " + "  ".join(f"{key} {a[step][key]:.6g} / {b[step][key]:.6g}" for key in shown)
                     + " (resumed)" * (resumed_from is not None and step >= resumed_from))
    return lines


def kill_then_resume(start, straight, killed, kill_at):
    """Start `straight` and `killed` side by side (start(run_dir, *argv) -> a Popen in its own process group); SIGKILL
    `killed` once its checkpoint step_<kill_at> appears, --resume it to the end, wait for both. Returns the step the
    killed run resumed from (kill_at, or kill_at + 1 if the next checkpoint made it in time)."""
    straight_run, killed_run = start(straight), start(killed)
    with killed_on_exit(straight_run, killed_run):
        checkpoint = os.path.join(killed, "checkpoints", f"step_{kill_at:06d}")
        deadline = time.monotonic() + 600
        while not os.path.exists(checkpoint) and killed_run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert os.path.exists(checkpoint), killed_run.communicate()[0][-3000:]
        os.killpg(killed_run.pid, signal.SIGKILL)  # no chance to save anything
        killed_run.wait(60)
        assert killed_run.returncode == -signal.SIGKILL
        resumed_from = max(infra.checkpoint._checkpoint_steps(os.path.join(killed, "checkpoints")))
        assert resumed_from in (kill_at, kill_at + 1)  # killed as the step began, or just after it ended
        finish_resumed(start(killed, "--resume", killed), straight_run)
    return resumed_from


def finish_resumed(resumed, straight_run):
    """Wait for the resumed run and the straight one beside it; both must exit 0."""
    output = resumed.communicate(timeout=600)[0]
    assert resumed.returncode == 0, output[-3000:]
    assert straight_run.wait(600) == 0, straight_run.communicate()[0][-3000:]


@contextlib.contextmanager
def killed_on_exit(*processes):
    """SIGKILL the process group of each run still going when the block ends: a failed check leaves none behind."""
    try:
        yield
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)


def check_turn_end_paths(generator, tokenizer, rows, max_tokens=64):
    """With the Qwen-like fixture (tests/fixtures/qwen_like.py) and `generator` greedy: its model answers in its own
    turn, closes it with <|im_end|>, then invents a next turn ending in a wrong \\boxed{0} before <|endoftext|>. Every
    engine path, rollout (scored as the trainers score it), evaluation, Monte Carlo values and SPO-tree segments,
    scores the answer of the turn itself: 1 exactly when the text before the first <|im_end|> of the run that stops
    at <|endoftext|> alone (the reference) boxes a + b. Returns how many prompts that is."""
    import common
    import spo
    from infra.evaluate import evaluate
    turn_end, eos = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id
    prompts = [common.prompt_ids(tokenizer, row["question"]) for row in rows]
    stops, generator.stop_ids = generator.stop_ids, [eos]
    try:
        reference = generator.generate(prompts, 1, max_tokens, 0.0)
    finally:
        generator.stop_ids = stops
    own = []
    for completion, row in zip(reference, rows):  # the reference runs on past its turn into a wrong \boxed{0}
        full = tokenizer.decode(completion.token_ids)
        assert completion.token_ids[-1] == eos and "<|im_end|>\n<|im_start|>user" in full, full
        assert common.score(completion.text, row) == 0.0 and common.extract_answer(full) == "0", full
        own.append(float(common.extract_answer(full.split("<|im_end|>")[0]) == str(row["a"] + row["b"])))

    completions = generator.generate(prompts, 1, max_tokens, 0.0)  # rollout
    evaluation = evaluate(generator, tokenizer, {"b": rows}, 1, max_tokens, 0.0, 1.0)
    states = [(prompt, []) for prompt in prompts] + [(prompt, ref.token_ids[:5]) for prompt, ref in
                                                      zip(prompts, reference)]
    values, _ = common.monte_carlo_values(generator, tokenizer, states, rows + rows, 1, max_tokens, 0.0)
    tree = spo.grow_tree(generator, tokenizer, prompts, rows, 2, 1, 8, max_tokens, 0.0, 1.0)
    leaves = [node for node, segment in enumerate(tree.segments) if segment and segment.finish_reason == "stop"]
    scored = {"rollout": [common.score(c.text, rows[c.prompt_index]) if c.finish_reason == "stop" else 0.0
                          for c in completions],  # as the trainers score it
              "evaluation": evaluation["eval/b/avg@1"], "monte_carlo": values.tolist(),
              "spo_tree": [(tree.prompt_index[node], tree.rewards[node]) for node in leaves]}
    expected = {"rollout": own, "evaluation": sum(own) / len(own), "monte_carlo": own + own,
                "spo_tree": list(enumerate(own))}  # one chain per prompt, ending in its second segment
    assert scored == expected, f"scored {scored}, the turns' own answers {expected}"
    for completion, ref in zip(completions, reference):  # the layout: the stop token ends token_ids and logprobs
        cut = ref.token_ids.index(turn_end) + 1
        assert completion.token_ids == ref.token_ids[:cut] and completion.finish_reason == "stop"
        assert len(completion.logprobs) == cut and completion.text == tokenizer.decode(ref.token_ids[:cut],
                                                                                       skip_special_tokens=True)
    assert all(tree.segments[node].token_ids[-1] == turn_end for node in leaves)
    return int(sum(own))


# Two steps of a trainer on the Qwen-like fixture (tests/test_qwen_like.py with HF generate, tests/test_vllm.py with
# vLLM): greedy evaluation of 4 held-out problems at the start and the end.
QWEN_LIKE_RUN = ["--dataset", "builtin:2", "--steps", "2", "--prompts-per-step", "2", "--max-response-tokens", "48",
                 "--eval-datasets", "builtin", "--eval-every", "0", "--eval-problems", "4", "--eval-n", "1",
                 "--eval-temperature", "0", "--eval-max-tokens", "48", "--save-every", "0",
                 "--no-gradient-checkpointing", "--lr", "1e-6"]
QWEN_LIKE_TRAINERS = with_forks({  # ppo: its probe's Monte Carlo values; spo: SPO-tree
    "ppo": ["--samples-per-prompt", "2", "--micro-batch-size", "4", "--probe-every", "1", "--probe-prompts", "2",
            "--probe-continuations", "2", "--critic-warmup", "1"],
    "grpo": ["--samples-per-prompt", "2", "--micro-batch-size", "4"],
    "sppo": ["--prompts-per-step", "4", "--mini-batches", "2", "--micro-batch-size", "2"],
    "sp3o": ["--samples-per-prompt", "2", "--micro-batch-size", "4", "--critic-warmup", "1"],
    "tppo": ["--samples-per-prompt", "2", "--micro-batch-size", "4"],
    "vapo": ["--samples-per-prompt", "2", "--micro-batch-size", "4", "--critic-warmup", "1", "--mini-batches", "2"],
    "spo": ["--mode", "tree", "--tree-prompts", "2", "--tree-depth", "2", "--tree-branching", "2",
            "--tree-segment-tokens", "8", "--micro-batch-size", "4", "--mini-batches", "1"],
})


def check_qwen_like_run(run_dir, stdout):
    """A 2-step run on the Qwen-like fixture: finite metrics, responses that end at their turn end (about 29 tokens;
    running on to <|endoftext|> after the invented turn takes about 46), greedy evaluation scoring the turn's own
    answer (the invented turn's \\boxed{0} would score 0), and the stops printed."""
    steps = records(run_dir)
    assert sorted(steps) == [0, 1]
    for record in steps.values():
        assert all(math.isfinite(value) for value in record.values()), record
        assert record["truncated"] == 0.0 and record["response_length"] < 40, record
    assert steps[0]["eval/accuracy"] > 0, steps[0]
    assert "rollouts stop at <|endoftext|> (339), <|im_end|> (341)" in stdout.splitlines()


def cache_hub_dataset(cache_dir, repo, splits, config="default"):
    """Hub dataset `repo` (org/name) with {split: rows} written into the `datasets` cache `cache_dir` as a download
    leaves it (<org>___<name>/<config>/<version>/<hash>/<name>-<split>.arrow beside its dataset_info.json), by
    `datasets`' own JSON builder: what `datasets.load_dataset(repo)` reads there offline."""
    from datasets.naming import camelcase_to_snakecase
    from datasets.packaged_modules.json.json import Json
    org, name = repo.split("/")
    name = camelcase_to_snakecase(name)  # as `datasets` names the folder and files (MATH-500: math-500)
    work = os.path.join(cache_dir, "..", "hub-sources", org, config)
    os.makedirs(work, exist_ok=True)
    for split, rows in splits.items():
        with open(os.path.join(work, f"{name}-{split}.jsonl"), "w") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)
    builder = Json(cache_dir=work, dataset_name=name, config_name=config, config_id=config, hash="0" * 16,
                   data_files={split: os.path.join(work, f"{name}-{split}.jsonl") for split in splits})
    import datasets
    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # quiet: tests read stderr
    try:
        builder.download_and_prepare()
    finally:
        if shown:
            datasets.enable_progress_bars()
    shutil.copytree(os.path.join(work, name), os.path.join(cache_dir, f"{org}___{name}"), dirs_exist_ok=True)
