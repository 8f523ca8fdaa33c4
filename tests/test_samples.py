"""What the model writes, visible (infra/samples.py: samples.jsonl and the two responses printed after each eval
table), and progress inside a long step (infra/progress.py: the status a long phase shows, on a terminal and in a
log), down to the engine's counts and the run's stdout."""
import io
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import common
import infra.engine
import infra.evaluate
import infra.progress
import infra.samples
from helpers import REPO, with_forks


class Scripted:
    """generate() returns, for prompt i and sample j, the scripted (text, finish_reason) script[i][j]."""
    engine = "scripted"

    def __init__(self, tokenizer, scripts):
        self.tokenizer, self.scripts = tokenizer, scripts

    def generate(self, prompts, n=1, max_tokens=256, temperature=1.0, top_p=1.0):
        out = []
        for i in range(len(prompts)):
            for text, finish in self.scripts[i][:n]:
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                ids += [self.tokenizer.eos_token_id] if finish == "stop" else []
                out.append(common.Completion(i, ids, text, [0.0] * len(ids), finish))
        return out


@pytest.fixture(scope="module")
def tokenizer():
    return common.load_tokenizer("tiny")


ROWS = [{"question": "100+200", "answer": "300"}, {"question": "111+111", "answer": "222"},
        {"question": "5+5", "answer": "10"}]


# ---------------------------------------------------------------- the records of an evaluation
def test_every_eval_sample_is_a_record_whose_rewards_average_to_avg_at_n(tokenizer):
    right, wrong = "1+2=3\n\\boxed{300}", "\\boxed{301}"
    scripts = [[(right, "stop"), (right, "length"), (wrong, "stop")],  # a cut-off right answer scores 0
               [("\\boxed{222}", "stop")] * 3, [(wrong, "stop")] * 3]
    records = []
    metrics = infra.evaluate.evaluate(Scripted(tokenizer, scripts), tokenizer, {"set": ROWS}, n=3, samples=records)
    assert len(records) == 9
    assert [(r["index"], r["sample"]) for r in records] == [(i, j) for i in range(3) for j in range(3)]
    assert [r["reward"] for r in records] == [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert sum(r["reward"] for r in records) / len(records) == pytest.approx(metrics["eval/set/avg@3"]) == 4 / 9
    first = records[0]
    assert first["kind"] == "eval" and first["dataset"] == "set" and first["answer"] == "300"
    assert first["question"] == "100+200" and first["response"] == right and first["finish_reason"] == "stop"
    assert first["prompt"] == tokenizer.decode(common.prompt_ids(tokenizer, "100+200"))  # as the model read it
    assert first["prompt"].startswith("100+200\n") and "\\boxed{}" in first["prompt"]  # our instruction too
    assert first["tokens"] == len(tokenizer(right, add_special_tokens=False)["input_ids"]) + 1  # and the EOS
    assert records[1]["finish_reason"] == "length"
    assert set(first) == {"kind", "dataset", "index", "sample", "reward", "finish_reason", "tokens", "answer",
                          "question", "prompt", "response"}


def test_chat_rows_record_the_last_message_as_the_question(tokenizer):
    rows = [{"question": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
             "answer": "4"}]
    records = []
    infra.evaluate.evaluate(Scripted(tokenizer, [[("\\boxed{4}", "stop")]]), tokenizer, {"chat": rows},
                            samples=records)
    assert records[0]["question"] == "2+2?" and records[0]["reward"] == 1.0


# ---------------------------------------------------------------- the printed responses
def test_two_responses_printed_within_120_columns():
    long_question = "Compute the sum. " * 20 + "What is 7 + 8?"
    response = "First " + "x" * 300 + " so the answer is \\boxed{15}\nDone"
    records = [infra.samples.record("eval", "math", i, j, {"question": long_question, "answer": "15"}, "p",
                                    common.Completion(i, [1] * 7, response, [], "stop"), 1.0)
               for i in range(3) for j in range(2)]
    lines = infra.samples.shown(records)
    assert len(lines) == 4 and max(map(len, lines)) == 120
    assert lines[0].startswith("math #0 reward 1 (stop, 7 tok) | ...") and lines[0].endswith("What is 7 + 8?")
    assert lines[2].startswith("math #1 reward 1")  # the first sample of the first two problems
    assert lines[1].startswith("  -> First xxx") and " ... " in lines[1]
    assert lines[1].endswith("the answer is \\boxed{15}\\nDone")  # the tail, its newline escaped
    short = infra.samples.shown([records[0]])
    escaped = response.replace("\n", "\\n")  # 115 columns after "  -> ": 44 of the head, " ... ", 66 of the tail
    assert short[1] == "  -> " + escaped[:44] + " ... " + escaped[-66:]
    assert infra.samples.shown([]) == []


# ---------------------------------------------------------------- the rollout's samples
def completions_for(prompts, n):
    return [common.Completion(i, [5, 1], f"r{i}.{j}", [0.0, 0.0], "stop") for i in range(prompts) for j in range(n)]


def test_a_rollout_keeps_the_first_sample_of_its_first_four_prompts(tokenizer):
    rows = [{"question": f"{k}+{k}", "answer": str(2 * k)} for k in range(6)]
    completions = completions_for(6, 2)
    rewards = torch.tensor([float(i % 3 == 0) for i in range(12)])
    infra.evaluate.rollout_metrics(completions, rewards, torch.zeros(12, 2), torch.ones(12, 2, dtype=torch.bool))
    args = SimpleNamespace(dataset="builtin")
    records = infra.samples.rollout_records(rows, tokenizer, args)
    assert [(r["index"], r["response"], r["reward"]) for r in records] == [
        (0, "r0.0", 1.0), (1, "r1.0", 0.0), (2, "r2.0", 0.0), (3, "r3.0", 1.0)]
    assert all(r["kind"] == "rollout" and r["dataset"] == "builtin" and r["sample"] == 0 for r in records)
    assert records[2]["question"] == "2+2" and records[2]["answer"] == "4"
    assert infra.samples.rollout_records(rows, tokenizer, args) == []  # taken once


def test_spo_tree_segments_are_not_written_as_responses(tokenizer):
    rows = [{"question": "1+1", "answer": "2"}]
    infra.samples.keep_rollout(completions_for(1, 2), torch.zeros(2))
    assert infra.samples.rollout_records(rows, tokenizer, SimpleNamespace(dataset="d", mode="tree")) == []
    infra.samples.keep_rollout(completions_for(1, 3), torch.zeros(2))  # rewards of leaves, not of the completions
    assert infra.samples.rollout_records(rows, tokenizer, SimpleNamespace(dataset="d", mode="chain")) == []


# ---------------------------------------------------------------- samples.jsonl on resume, under torchrun
def lines(path):
    with open(path) as handle:
        return [json.loads(line) for line in handle]


def test_a_resumed_run_drops_what_the_earlier_run_wrote_after_its_checkpoint(tmp_path):
    log = infra.samples.SampleLog(str(tmp_path))
    for step in range(4):
        log.add(step, [{"kind": "eval", "n": step}])
    with open(tmp_path / "samples.jsonl", "a") as handle:
        handle.write('{"step": 4, "kind": "rol')  # killed mid-line
    resumed = infra.samples.SampleLog(str(tmp_path), resumed_step=2)
    assert len(open(tmp_path / "samples.jsonl").readlines()) == 5  # nothing dropped until it writes
    resumed.add(2, [{"kind": "eval", "n": 20}])
    resumed.add(3, [{"kind": "eval", "n": 30}])
    assert [(r["step"], r["n"]) for r in lines(tmp_path / "samples.jsonl")] == [(0, 0), (1, 1), (2, 20), (3, 30)]


def test_only_rank_zero_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    infra.samples.SampleLog(str(tmp_path)).add(0, [{"kind": "eval"}])
    assert not os.path.exists(tmp_path / "samples.jsonl")


def test_eval_records_of_two_ranks_make_up_the_whole_set(tokenizer, monkeypatch):
    """Under torchrun rank r evaluates rows r, r + 2, ...; rank 0 receives every rank's records, in set order."""
    rows = [{"question": f"{k}+0", "answer": str(k)} for k in range(5)]
    scripts = [[(f"\\boxed{{{k}}}", "stop")] for k in range(5)]
    shares = {}

    def evaluate_as(rank):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setattr(infra.dist, "gather_objects", lambda value: shares.setdefault(rank, value) and [
            shares[r] for r in sorted(shares)])
        generator = Scripted(tokenizer, scripts[rank::2])
        records = []
        infra.evaluate.evaluate(generator, tokenizer, {"s": rows}, samples=records)
        return records

    evaluate_as(1)  # its share first, so that rank 0's gather finds it
    records = evaluate_as(0)
    assert [r["index"] for r in records] == [0, 1, 2, 3, 4]
    assert [r["question"] for r in records] == [f"{k}+0" for k in range(5)] and all(r["reward"] == 1 for r in records)


# ---------------------------------------------------------------- the progress display
class FakeBar:
    def __init__(self):
        self.postfixes = []

    def set_postfix_str(self, text, refresh=True):
        self.postfixes.append(text)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_terminal_shows_the_status_after_the_delay_and_not_before():
    bar, clock, written = FakeBar(), Clock(), []
    display = infra.progress.Display(bar, written.append, terminal=True, clock=clock)
    display.phase("rollout", step=3)
    display.requested = 512
    for second in range(30):  # 10 tokens every 0.1 s until 2.9 s: quiet
        clock.now = 100.0 + second / 10
        display.tokens += 10
        display.tick()
    assert bar.postfixes == [] and written == []
    clock.now = 103.0
    display.tokens, display.finished = 300, 96
    display.tick()
    assert bar.postfixes == ["rollout 96/512 samples, 300 tok, 100 tok/s, 3 s"]
    clock.now = 103.2
    display.tick()  # redrawn at most every 0.5 s
    assert len(bar.postfixes) == 1
    clock.now = 103.5
    display.tick()
    assert len(bar.postfixes) == 2
    display.phase(None)  # the phase ends: its status is cleared
    assert bar.postfixes[-1] == "" and written == []
    display.phase("eval math")
    clock.now = 104.0
    display.tick()
    assert bar.postfixes[-1] == ""  # a new phase starts quiet again


def test_a_log_gets_a_line_every_thirty_seconds_and_no_carriage_returns():
    bar, clock, written = FakeBar(), Clock(), []
    display = infra.progress.Display(bar, written.append, terminal=False, updates_per_step=4, clock=clock)
    display.phase(None, step=7)
    display.phase("update")
    for tenth in range(1, 651):  # 65 s of ticks, every 0.1 s
        clock.now = 100.0 + tenth / 10
        display.updates = tenth // 400  # the first optimizer step done at 40 s
        display.tick()
    assert bar.postfixes == []  # the bar's line is never redrawn for it
    assert written == ["  step 7 update 0/4 optimizer steps, 30 s", "  step 7 update 1/4 optimizer steps, 60 s"]
    display.phase("rollout")
    clock.now += 10
    display.tick()
    assert len(written) == 2  # a short phase writes nothing


def test_status_over_100_seconds_in_minutes_and_an_uncounted_update():
    clock = Clock()
    display = infra.progress.Display(FakeBar(), print, terminal=True, clock=clock)
    display.phase("update")
    display.updates, clock.now = 3, 250.0
    assert display.status() == "update 3 optimizer steps, 2.5 min"


def test_a_tqdm_bar_on_a_terminal_shows_the_status_and_one_on_a_file_does_not(monkeypatch):
    from tqdm import tqdm

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    clock = Clock()
    monkeypatch.setattr(infra.progress.time, "monotonic", clock)
    for stream, terminal in ((Terminal(), True), (io.StringIO(), False)):
        bar = tqdm(range(3), file=stream, desc="run")
        display = infra.progress.for_bar(bar, lambda line: None, SimpleNamespace(epochs=1, mini_batches=2))
        assert display.terminal is terminal and display.updates_per_step == 2
        infra.progress.activate(display)
        try:
            infra.progress.phase("rollout", 0)
            infra.progress.requested(8)
            clock.now += 5
            infra.progress.generated(40, finished=8)
        finally:
            infra.progress.deactivate()
        bar.close()
        assert ("rollout 8/8 samples, 40 tok, 8 tok/s, 5 s" in stream.getvalue()) is terminal
    assert infra.progress.for_bar(tqdm(range(3), disable=True), print) is None  # a rank > 0


def test_no_display_no_reports():
    infra.progress.deactivate()
    infra.progress.requested(4)  # nothing active (tests, benchmarks): nothing happens
    infra.progress.generated(4, 4)
    infra.progress.optimizer_step()


def test_the_engine_reports_every_sampled_token_and_finished_sample(tiny):
    model, tokenizer = tiny
    display = infra.progress.activate(infra.progress.Display(FakeBar(), print, terminal=True))
    try:
        generator = infra.engine.HFGenerator(model, tokenizer, batch_size=5)  # 3 x 4 samples: 3 batches
        prompts = [common.prompt_ids(tokenizer, q) for q in ("1+1", "12+34", "123+456")]
        torch.manual_seed(0)
        completions = generator.generate(prompts, n=4, max_tokens=36, temperature=1.0)
        assert display.requested == display.finished == 12
        assert display.tokens == sum(len(c.token_ids) for c in completions)
    finally:
        infra.progress.deactivate()
    assert {c.finish_reason for c in completions} == {"stop", "length"}  # rows leaving the batch, and the last


def test_the_update_begins_with_a_forward_pass_with_gradients():
    model = torch.nn.Linear(2, 1)
    infra.progress.watch([model])
    display = infra.progress.activate(infra.progress.Display(FakeBar(), print, terminal=True, updates_per_step=2))
    try:
        infra.progress.phase("rollout")
        with torch.no_grad():
            model(torch.ones(1, 2))  # old log-probs, values: still the rollout
        assert display.name == "rollout"
        model(torch.ones(1, 2)).sum().backward()
        infra.progress.optimizer_step()
        assert display.name == "update" and display.status().startswith("update 1/2 optimizer steps")
    finally:
        infra.progress.deactivate()


# ---------------------------------------------------------------- end to end
SMALL = ["--prompts-per-step", "4", "--micro-batch-size", "16", "--eval-problems", "16"]


def trainer_run(*args):
    return subprocess.run([sys.executable, "grpo.py", *args, *SMALL], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))


def check_ok(result):
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]


def test_a_two_step_run_prints_two_responses_and_writes_samples_then_resumes_without_duplicates(tmp_path):
    run_dir = tmp_path / "r"
    first = trainer_run("--steps", "2", "--output-dir", tmp_path, "--run-name", "r")
    check_ok(first)
    out = first.stdout.splitlines()
    table = out.index(next(line for line in out if line.startswith("dataset ") and "avg@1" in line))
    # the step-0 evaluation: its table, then two responses (2 lines each), then the step line
    assert out[table + 1].startswith("builtin ")
    assert out[table + 2].startswith("builtin #0 reward ") and out[table + 3].startswith("  -> ")
    assert out[table + 4].startswith("builtin #1 reward ") and out[table + 5].startswith("  -> ")
    assert out[table + 6].startswith("step    0 ")
    assert max(map(len, out[table:table + 7])) <= 120  # (the summary's commands hold the long temporary paths)
    records, metrics = lines(run_dir / "samples.jsonl"), lines(run_dir / "metrics.jsonl")
    evals = {step: [r for r in records if r["kind"] == "eval" and r["step"] == step] for step in (0, 2)}
    assert [len(evals[0]), len(evals[2])] == [16, 16]  # all of them: 16 problems x 1 sample
    # the step line's eval: step 0's record evaluates the initial weights, the last record the weights after step 1
    assert sum(r["reward"] for r in evals[0]) / 16 == pytest.approx(metrics[0]["eval/builtin/avg@1"])
    assert sum(r["reward"] for r in evals[2]) / 16 == pytest.approx(metrics[1]["eval/builtin/avg@1"])
    assert f"builtin #0 reward {evals[0][0]['reward']:g} ({evals[0][0]['finish_reason']}" in first.stdout
    rollouts = [(r["step"], r["index"]) for r in records if r["kind"] == "rollout"]
    assert rollouts == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]
    # a crash after checkpoint step_2 left a record of the step to repeat, and half a line
    with open(run_dir / "samples.jsonl", "a") as handle:
        handle.write(json.dumps({**records[-1], "step": 2, "kind": "rollout"}) + "\n" + '{"step": 2, "ki')
    check_ok(trainer_run("--steps", "3", "--resume", run_dir))
    again = lines(run_dir / "samples.jsonl")
    assert again[:len(records) - 16] == records[:-16]  # steps 0 and 1 kept as they were
    keys = [(r["step"], r["kind"], r["index"], r["sample"]) for r in again]
    assert len(keys) == len(set(keys)) == 16 + 4 + 4 + 16 + 4 + 16  # evals at 0, 2, 3; rollouts of 0, 1, 2
    assert [r["reward"] for r in again if r["step"] == 2 and r["kind"] == "eval"] == \
        [r["reward"] for r in evals[2]]  # the same weights and eval seed: the same answers


TWO = ["--samples-per-prompt", "2", "--micro-batch-size", "2"]
ALL = with_forks({"ppo": [*TWO, "--critic-warmup", "1"], "grpo": TWO, "sppo": ["--micro-batch-size", "1"],
                  "sp3o": [*TWO, "--critic-warmup", "1"], "tppo": TWO, "spo": [*TWO, "--mc-samples", "2"]})
TREE = ["--mode", "tree", "--tree-prompts", "2", "--tree-depth", "2", "--tree-branching", "2", "--tree-segment-tokens",
        "8", "--micro-batch-size", "4", "--mini-batches", "1"]


@pytest.mark.parametrize("trainer", sorted(ALL) + ["spo-tree"])
def test_every_trainer_writes_samples(trainer, tmp_path, monkeypatch, capsys):
    import importlib
    module = importlib.import_module(trainer.split("-")[0])
    monkeypatch.setattr(sys, "argv", [f"{trainer}.py", "--steps", "2", "--prompts-per-step", "2",
                                      "--max-response-tokens", "24", "--eval-problems", "3", "--eval-max-tokens", "24",
                                      "--save-every", "0", *ALL.get(trainer, TREE), "--output-dir", str(tmp_path),
                                      "--run-name", "r"])
    module.main()
    assert "builtin #0 reward " in capsys.readouterr().out
    records, metrics = lines(tmp_path / "r" / "samples.jsonl"), lines(tmp_path / "r" / "metrics.jsonl")
    for step, row in ((0, 0), (2, 1)):
        rewards = [r["reward"] for r in records if r["kind"] == "eval" and r["step"] == step]
        assert len(rewards) == 3 and math.isclose(sum(rewards) / 3, metrics[row]["eval/builtin/avg@1"])
    rollouts = [(r["step"], r["index"]) for r in records if r["kind"] == "rollout"]
    assert rollouts == ([] if trainer == "spo-tree" else [(0, 0), (0, 1), (1, 0), (1, 1)])  # tree: segments
