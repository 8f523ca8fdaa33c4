"""Step-0 search for a real model's task: how often the untrained model is right, per task variant, before any RL.

    OMP_NUM_THREADS=1 python benchmarks/task_search.py --model smollm2-135m-instruct \\
        --variants builtin:words chain2-one-step-example chain2 builtin:words2 builtin:words3

Each variant is a `builtin:...` dataset (infra/tiny.py) or one of VARIANTS below (the ones tried and dropped). Its
first --prompts training problems are sampled --samples times at temperature 1 (top-p 1, at most --max-tokens
tokens, the HF engine, seed 0) and once greedily; the reward is the trainers' (common.score: the last \\boxed{},
0 for a response cut at the limit). Printed per variant: the share of responses with a \\boxed{} answer, the share
cut at the limit, the mean reward at T = 1 (= avg@n), pass@n (a prompt with at least one right sample), greedy right
out of --prompts, the mean response length, and one sampled response; then the markdown table of docs/real_model.md.
"""
import argparse
import os
import random
import sys
import time
import zlib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch  # noqa: E402

import common  # noqa: E402
import infra.data  # noqa: E402
import infra.engine  # noqa: E402
from infra.tiny import WORD_CHAIN_EXAMPLES, WORD_INSTRUCTION, WORD_NAMES, WORD_THINGS, chain_story  # noqa: E402

ONE_STEP_EXAMPLE = ("Lily has 3 books. Ben gives Lily 6 more books. How many books does Lily have now?",
                    "Lily has 3 + 6 = 9 books. The answer is \\boxed{9}.")
TWO_STEP_NO_THEN = ("Lily has 3 books. Ben gives Lily 6 more books. Lily gives 4 of them to Mia. How many books does "
                    "Lily have now?", "Lily has 3 + 6 = 9 books, and 9 - 4 = 5 books. The answer is \\boxed{5}.")
ADD_FIRST, SUBTRACT_FIRST = WORD_CHAIN_EXAMPLES[2]  # builtin:words2's two worked examples
ADD_ADD = ("Mia has 2 shells. Leo gives Mia 5 more shells. Then Ben gives Mia 3 more shells. How many shells does Mia "
           "have now?", "Mia has 2 + 5 = 7 shells. Then 7 + 3 = 10 shells. The answer is \\boxed{10}.")


def few_shot_variant(story, examples):
    """Problems from story(rng) -> (question, answer), each after the worked examples (one chat turn each), held out
    as builtin:words is: about 1 problem in 8, by a hash of its text."""
    def make(rng, split):
        while True:
            question, answer = story(rng)
            if (zlib.crc32(question.encode()) % 8 == 0) == (split == "test"):
                shots = [turn for example, solution in examples for turn in (
                    {"role": "user", "content": f"{example} {WORD_INSTRUCTION}"},
                    {"role": "assistant", "content": solution})]
                return {"question": [*shots, {"role": "user", "content": f"{question} {WORD_INSTRUCTION}"}],
                        "answer": str(answer), "answer_format": "boxed"}
    return make


def chain_variant(operations, examples, then=True, largest=9):
    """A variant of the chained word problems (infra.tiny.chain_story's story and gold answer) after other worked
    examples (one chat turn each), or without "Then" before each later event, or with other number ranges."""
    return few_shot_variant(lambda rng: chain_story(rng, operations, largest, then), examples)


SIMPLE_EXAMPLE = ("Lily has 3 books. Lily gets 6 more books. Then Lily gives away 4 books. How many books does Lily "
                  "have now?", "Lily has 3 + 6 = 9 books. Then 9 - 4 = 5 books. The answer is \\boxed{5}.")
SIMPLE_SUBTRACT_FIRST = ("Tom has 8 cards. Tom gives away 5 cards. Then Tom gets 4 more cards. How many cards does Tom "
                         "have now?", "Tom has 8 - 5 = 3 cards. Then 3 + 4 = 7 cards. The answer is \\boxed{7}.")

SIMPLE_THREE = ("Lily has 3 books. Lily gets 6 more books. Then Lily gives away 4 books. Then Lily gets 2 more books. "
                "How many books does Lily have now?",
                "Lily has 3 + 6 = 9 books. Then 9 - 4 = 5 books. Then 5 + 2 = 7 books. The answer is \\boxed{7}.")
SIMPLE_THREE_SUBTRACT_FIRST = (
    "Tom has 8 cards. Tom gives away 5 cards. Then Tom gets 4 more cards. Then Tom gives away 2 cards. How many cards "
    "does Tom have now?", "Tom has 8 - 5 = 3 cards. Then 3 + 4 = 7 cards. Then 7 - 2 = 5 cards. The answer is "
    "\\boxed{5}.")


def simple_story(rng, operations, largest=9):
    """chain_story with one person: "Lily gets 6 more books." / "Lily gives away 4 books." (no second name)."""
    name, thing, count = rng.choice(WORD_NAMES), rng.choice(WORD_THINGS), rng.randint(2, largest)
    sentences = [f"{name} has {count} {thing}."]
    for index in range(operations):
        if count < 2 or rng.random() < 0.5:
            change = rng.randint(2, largest)
            event = f"{name} gets {change} more {thing}."
        else:
            change = -rng.randint(1, count - 1)
            event = f"{name} gives away {-change} {thing}."
        count += change
        sentences.append(f"Then {event}" if index else event)
    return " ".join(sentences) + f" How many {thing} does {name} have now?", count


def simple_variant(operations, examples, largest=9):
    """The same with one person (simple_story) instead of two."""
    return few_shot_variant(lambda rng: simple_story(rng, operations, largest), examples)


def arithmetic_variant(operations, largest=9):
    """The same chain without the words: "What is 3 + 6 - 4?" after the worked example "3 + 6 = 9. Then 9 - 4 = 5."
    (each step + 2..largest or - 1..count-1, as chain_story)."""
    example = " ".join(["3 + 6 = 9.", "Then 9 - 4 = 5.", "Then 5 + 2 = 7."][:operations])
    example_question = "What is " + " ".join(["3 + 6", "- 4", "+ 2"][:operations]) + "?"
    def make(rng, split):
        while True:
            count = rng.randint(2, largest)
            terms = [str(count)]
            for _ in range(operations):
                change = rng.randint(2, largest) if count < 2 or rng.random() < 0.5 else -rng.randint(1, count - 1)
                terms.append(f"{'+' if change > 0 else '-'} {abs(change)}")
                count += change
            question = f"What is {' '.join(terms)}?"
            if (zlib.crc32(question.encode()) % 8 == 0) == (split == "test"):
                return {"question": [{"role": "user", "content": f"{example_question} {WORD_INSTRUCTION}"},
                                     {"role": "assistant", "content": f"{example} The answer is \\boxed{{"
                                                                      f"{[9, 5, 7][operations - 1]}}}."},
                                     {"role": "user", "content": f"{question} {WORD_INSTRUCTION}"}],
                        "answer": str(count), "answer_format": "boxed"}
    return make


def no_example(rng, split):
    """Two events, no worked example: only the instruction."""
    question, answer = chain_story(rng, 2, 9, True)
    return {"question": [{"role": "user", "content": f"{question} {WORD_INSTRUCTION}"}], "answer": str(answer),
            "answer_format": "boxed"}


VARIANTS = {
    "chain2-no-example": no_example,
    "chain2-one-step-example": chain_variant(2, [ONE_STEP_EXAMPLE]),
    "chain2-no-then": chain_variant(2, [TWO_STEP_NO_THEN], then=False),
    "chain2-small": chain_variant(2, [TWO_STEP_NO_THEN], then=False, largest=5),
    "chain2-one-example": chain_variant(2, [ADD_FIRST]),  # builtin:words2 with its first example only
    "chain2-two-shot": chain_variant(2, [ADD_FIRST, SUBTRACT_FIRST]),  # builtin:words2's prompt, other problems
    "chain2-small-two-shot": chain_variant(2, [ADD_FIRST, SUBTRACT_FIRST], largest=5),
    "chain2-three-shot": chain_variant(2, [ADD_FIRST, SUBTRACT_FIRST, ADD_ADD]),
    "simple2": simple_variant(2, [SIMPLE_EXAMPLE]),
    "simple2-two-shot": simple_variant(2, [SIMPLE_EXAMPLE, SIMPLE_SUBTRACT_FIRST]),
    "arithmetic2": arithmetic_variant(2),
    "arithmetic3": arithmetic_variant(3),
    "simple2-small-two-shot": simple_variant(2, [SIMPLE_EXAMPLE, SIMPLE_SUBTRACT_FIRST], largest=5),
    "simple3-two-shot": simple_variant(3, [SIMPLE_THREE, SIMPLE_THREE_SUBTRACT_FIRST]),
    "simple1": simple_variant(1, [("Lily has 3 books. Lily gets 6 more books. How many books does Lily have now?",
                                   "Lily has 3 + 6 = 9 books. The answer is \\boxed{9}.")]),
}

STREAMS = {"chain2-one-example": "words2"}  # the problems of builtin:words2 (measured when it had one example)


def rows_of(variant, count):
    if variant.startswith("builtin"):
        return infra.data.load_rows(variant, "train", n_builtin=count)
    rng = random.Random(f"train-0-{STREAMS.get(variant, variant)}")
    return [VARIANTS[variant](rng, "train") for _ in range(count)]


def measure(generator, tokenizer, variant, prompts_count, samples, max_tokens):
    rows = rows_of(variant, prompts_count)
    prompts = [common.prompt_ids(tokenizer, row["question"]) for row in rows]
    torch.manual_seed(0)
    sampled = generator.generate(prompts, samples, max_tokens, 1.0, 1.0)
    greedy = generator.generate(prompts, 1, max_tokens, 0.0, 1.0)
    right = [common.score(c.text, rows[c.prompt_index]) if c.finish_reason == "stop" else 0.0 for c in sampled]
    per_prompt = [max(right[i * samples:(i + 1) * samples]) for i in range(len(rows))]
    greedy_right = sum(common.score(c.text, rows[c.prompt_index]) if c.finish_reason == "stop" else 0.0
                       for c in greedy)
    return dict(variant=variant, boxed=sum("\\boxed{" in c.text for c in sampled) / len(sampled),
                cut=sum(c.finish_reason == "length" for c in sampled) / len(sampled),
                reward=sum(right) / len(right), pass_at_n=sum(per_prompt) / len(rows), greedy=int(greedy_right),
                length=sum(len(c.token_ids) for c in sampled) / len(sampled),
                question=rows[0]["question"][-1]["content"], gold=rows[0]["answer"], response=sampled[0].text)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--variants", nargs="+", default=["builtin:words", *VARIANTS, "builtin:words2",
                                                          "builtin:words3"])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    options = parser.parse_args()
    unknown = [v for v in options.variants if not v.startswith("builtin") and v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant {unknown[0]!r}: a builtin:... dataset or one of {', '.join(VARIANTS)}")
    model, tokenizer = common.load_model(options.model, "float32", "cpu")
    generator = infra.engine.HFGenerator(model, tokenizer)
    results = []
    for variant in options.variants:
        start = time.time()
        result = measure(generator, tokenizer, variant, options.prompts, options.samples, options.max_tokens)
        results.append(result)
        print(f"{variant}: boxed {result['boxed']:.0%}, cut {result['cut']:.0%}, reward (T = 1) "
              f"{result['reward']:.3f}, pass@{options.samples} {result['pass_at_n']:.2f}, greedy "
              f"{result['greedy']}/{options.prompts}, length {result['length']:.1f} ({time.time() - start:.0f} s)\n"
              f"  {result['question']!r} (gold {result['gold']}) -> {result['response']!r}", flush=True)
    print(f"\n| variant | boxed | cut at {options.max_tokens} | reward (T = 1) | pass@{options.samples} | greedy |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['variant']} | {r['boxed']:.0%} | {r['cut']:.0%} | {r['reward']:.3f} | {r['pass_at_n']:.2f} | "
              f"{r['greedy']}/{options.prompts} |")


if __name__ == "__main__":
    main()
