"""samples.jsonl in the run folder: what the model wrote. Every evaluation's samples, all of them, and a few of each
rollout's (ROLLOUT_SAMPLES), one JSON object a line:

    {"step": 0, "kind": "eval", "dataset": "builtin", "index": 3, "sample": 0, "reward": 1.0, "finish_reason": "stop",
     "tokens": 66, "answer": "1079", "question": "...", "prompt": "...", "response": "..."}

`step`: the training steps taken before it was sampled (its weights are checkpoint step_<step>'s; the evaluation
after the last update has step N, as in the summary); `index`: the problem's row in its set (for a rollout: its
prompt's place in the step's prompts); `sample`: which of that prompt's samples; `question`: the row's question (of
chat messages, the last one's content); `prompt`: the prompt as the model read it (instruction, chat template and
special tokens included); `response`: the text scored (special tokens removed); `reward`:
the score, 0 for a response cut off at the length limit; `tokens`: the response's tokens, its stop token included.
After each evaluation's table the first sample of the first set's first SHOWN problems is printed, shortened to
WIDTH columns a line (the question's tail, the response's head and tail). Under torchrun rank 0 writes.
"""
import json
import os

from common import prompt_ids
from infra import dist

ROLLOUT_SAMPLES = 4  # a rollout writes the first sample of each of its first 4 prompts (rank 0's share)
SHOWN = 2  # responses printed after each evaluation's table
WIDTH = 120  # columns of a printed line

_rollout = {}  # the latest rollout, as infra.evaluate.rollout_metrics saw it (rollout_records takes it)


def record(kind, dataset, index, sample, row, prompt, completion, reward):
    """One line of samples.jsonl (without its step) for `completion` (a common.Completion) to dataset row `row`."""
    question = row["question"] if isinstance(row["question"], str) else row["question"][-1]["content"]
    return {"kind": kind, "dataset": dataset, "index": index, "sample": sample, "reward": float(reward),
            "finish_reason": completion.finish_reason, "tokens": len(completion.token_ids),
            "answer": row.get("answer"), "question": question, "prompt": prompt, "response": completion.text}


def keep_rollout(completions, rewards):
    """Called by rollout_metrics (the six trainers' step end): the rollout whose samples end_step writes."""
    _rollout.update(completions=completions, rewards=rewards)


def rollout_records(rows, tokenizer, args):
    """The first sample of each of the first ROLLOUT_SAMPLES prompts of the rollout kept last (then forgotten), its
    prompts `rows` (this rank's share of the step's). None for SPO-tree (--mode tree): its rollout is a tree of
    segments, each completion part of a response and its rewards the leaves'."""
    completions, rewards = _rollout.pop("completions", None), _rollout.pop("rewards", None)
    if completions is None or getattr(args, "mode", "chain") == "tree" or len(completions) != len(rewards):
        return []
    rewards, out, seen = rewards.tolist(), [], set()
    for completion, reward in zip(completions, rewards):
        index = completion.prompt_index
        if index in seen or index >= ROLLOUT_SAMPLES:
            continue
        seen.add(index)
        prompt = tokenizer.decode(prompt_ids(tokenizer, rows[index]["question"]))
        out.append(record("rollout", args.dataset, index, 0, rows[index], prompt, completion, reward))
    return sorted(out, key=lambda r: r["index"])


def one_line(text):
    """`text` on one line: newlines and other unprintable characters as escapes (\\n)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def shorten(text, room, tail_only=False):
    """`text` in at most `room` characters: its tail (`...` + tail), or its head and tail (`head ... tail`)."""
    if len(text) <= room:
        return text
    if tail_only:
        return "..." + text[len(text) - room + 3:]
    head = (room - 5) * 2 // 5  # the answer is at the end: the tail gets the larger part
    return text[:head] + " ... " + text[len(text) - (room - 5 - head):]


def shown(records, width=WIDTH):
    """The printed lines: for the first sample of each of the first SHOWN problems of the first set, `<set> #<index>
    reward <r> (<finish>, <tokens> tok) | ...<question's tail>` and `  -> <response head> ... <response tail>`."""
    picked = [r for r in records if r["sample"] == 0 and r["dataset"] == records[0]["dataset"]][:SHOWN] \
        if records else []
    lines = []
    for r in picked:
        head = f"{r['dataset']} #{r['index']} reward {r['reward']:g} ({r['finish_reason']}, {r['tokens']} tok) | "
        lines.append(head + shorten(one_line(r["question"]), max(width - len(head), 10), tail_only=True))
        lines.append("  -> " + shorten(one_line(r["response"]), width - 5))
    return lines


class SampleLog:
    """samples.jsonl of the run folder `run_dir`, appended to (rank 0 writes). A run resumed from checkpoint
    step_<K> (`resumed_step` K) first drops the records of steps >= K, which the earlier run wrote after that
    checkpoint and this one writes again (a half-written last line too): no sample twice, none lost."""

    def __init__(self, run_dir, resumed_step=None):
        self.path, self.drop_from = os.path.join(run_dir, "samples.jsonl"), resumed_step

    def add(self, step, records):
        if dist.rank() > 0 or not records:
            return
        if self.drop_from is not None and os.path.exists(self.path):
            self._drop(self.drop_from)
        self.drop_from = None
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write("".join(json.dumps({"step": step, **r}, ensure_ascii=False) + "\n" for r in records))

    def _drop(self, first_step):
        kept = []
        with open(self.path, encoding="utf-8") as handle:
            for line in handle:
                try:
                    if json.loads(line)["step"] < first_step:
                        kept.append(line if line.endswith("\n") else line + "\n")
                except (ValueError, KeyError):  # a line cut short by a kill: the records after the checkpoint's
                    continue
        with open(self.path + ".tmp", "w", encoding="utf-8") as handle:
            handle.write("".join(kept))
        os.replace(self.path + ".tmp", self.path)
