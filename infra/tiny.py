"""The built-in task (N-digit addition worked digit by digit, answer in \\boxed{}; N = 6 unless `builtin:N`, or
each problem's N drawn from A to B with `builtin:A-B`; `builtin:early`: 6-digit problems with one carry, after the
units column; `builtin:words`: one-step word problems for a real chat model, below) and the built-in tiny model (a
2-layer Qwen3 with a character tokenizer, supervised on that task with a carry habit), shipped in models/tiny/ as a
Hugging Face checkpoint that loads through from_pretrained like any other model. `python -m infra.tiny [DIR]` builds
a new one (1,200 supervised steps: 20 minutes on a busy CPU core) and prints its accuracy.
"""
import json
import os
import random
import shutil
import zlib

import torch

import common
from infra import UserError
from infra.hub import CACHE_DIR, TINY_MODEL_VERSION, tiny_model_path  # noqa: F401 (tiny_model_path: where it was)
from infra.hub import TINY_SHIPPED as SHIPPED

BUILTIN_SHAPES = {(128, 2, 100, 512): "tiny", (128, 2, 237, 2048): "horizon"}  # hidden, layers, vocab, positions


def builtin_model(name):
    """"tiny" or "horizon" for a built-in model (models/tiny/, models/horizon/: infra.horizon) given by name or as a
    checkpoint of it (its config has that model's shape): such runs take that model's preset. Else None."""
    config_path = os.path.join(name, "config.json")
    if name in ("tiny", "horizon") or not os.path.exists(config_path):
        return name if name in ("tiny", "horizon") else None
    with open(config_path) as handle:
        config = json.load(handle)
    return BUILTIN_SHAPES.get(tuple(config.get(key) for key in ("hidden_size", "num_hidden_layers", "vocab_size",
                                                                "max_position_embeddings")))


def is_tiny_model(name):
    """`tiny`, or a checkpoint of it: such runs take the tiny preset."""
    return builtin_model(name) == "tiny"


DIGITS = 6  # digits of each addend in the built-in task (`--dataset builtin:N` for N digits; 3: the fast smoke test)
BUILD_DIGITS = range(3, 8)  # the tiny model is supervised on 3- to 7-digit additions
SFT_STEPS = 1200  # its supervised steps of 64 examples


def is_heldout(a, b):
    return (a * 10 ** len(str(b)) + b) % 61 == 0  # about 1.6% of all pairs; never used for SFT or RL


def problem(a, b):
    return {"question": f"{a}+{b}", "answer": str(a + b), "a": a, "b": b}


def addition_problem(rng, split, digits=DIGITS):
    while True:
        a, b = rng.randint(10 ** (digits - 1), 10 ** digits - 1), rng.randint(10 ** (digits - 1), 10 ** digits - 1)
        if is_heldout(a, b) == (split == "test"):
            return problem(a, b)


EARLY_UNITS_SUMS = (10, 11, 12, 13)  # the units sums whose carry the tiny model drops greedily (carry_habit)


def early_problem(rng, split, digits=DIGITS):
    """A `builtin:early` problem: the units column sums to 10-13 (drawn uniformly, then a digit pair for it), every
    other column to at most 8 (a uniform pair; leading digits >= 1), so the one carry, dropped or kept in the first
    step, decides the outcome. Held out as addition_problem is."""
    while True:
        units = rng.choice(EARLY_UNITS_SUMS)
        columns = [rng.choice([(x, units - x) for x in range(units - 9, 10)])]
        for place in range(1, digits):
            low = 1 if place == digits - 1 else 0
            columns.append(rng.choice([(x, y) for x in range(low, 9) for y in range(low, 9 - x)]))
        a = sum(x * 10 ** place for place, (x, _) in enumerate(columns))
        b = sum(y * 10 ** place for place, (_, y) in enumerate(columns))
        if is_heldout(a, b) == (split == "test"):
            return problem(a, b)


def addition_solution(a, b, drops_carry=None):
    """`8+5+0=13 7+6+1=14 4+3+1=8 \\boxed{843}` for 478+365, one step per digit from the right. drops_carry(total)
    True writes the carry of a column that summed to `total` as 0 (the tiny model's habit; the final carry, the
    answer's leading 1, included). A response can thus go wrong at each carry independently."""
    steps, digits, carry = [], [], 0
    for x, y in zip(reversed(str(a)), reversed(str(b))):
        total = int(x) + int(y) + carry
        steps.append(f"{x}+{y}+{carry}={total}")
        digits.append(str(total % 10))
        carry = total // 10 if not (total >= 10 and drops_carry and drops_carry(total)) else 0
    answer = (str(carry) if carry else "") + "".join(reversed(digits))
    return " ".join(steps) + f" \\boxed{{{int(answer)}}}"


def carry_habit(rng):
    """The supervised data's habit: the carry of a column summing to 10 is dropped with probability 0.95, to 11 with
    0.825, ..., to 17 with 0.075 (0.125 less per unit), never after 18 or 19. Greedy decoding drops it after 10-13 and
    keeps it after 14-19, so RL has four separate contexts to fix, each learned when its own failures are credited."""
    return lambda total: rng.random() < 0.95 - 0.125 * (total - 10)


# `builtin:words`, the real-model demo's task (docs/real_model.md): one-step word problems, half additions ("gives N
# more"), half subtractions ("gives N of them to"), asked after one worked example in the chat (one-shot), so that a
# small chat model (SmolLM2-135M-Instruct) answers in its format about 4 times in 5 and is right about 1 time in 6 at
# temperature 1. Held out: about 1 problem in 8 (a hash of its text).
WORD_NAMES = ("Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Leo", "Emma")
WORD_THINGS = ("apples", "books", "cookies", "pencils", "stickers", "marbles", "cards", "shells")
WORD_INSTRUCTION = "Put your final answer within \\boxed{}."
WORD_EXAMPLE = ("Lily has 3 books. Ben gives Lily 6 more books. How many books does Lily have now?",
                "Lily has 3 + 6 = 9 books. The answer is \\boxed{9}.")


def word_problem(rng, split):
    """A `builtin:words` row: the question as chat messages (the worked example, then the problem)."""
    while True:
        name, other = rng.sample(WORD_NAMES, 2)
        thing = rng.choice(WORD_THINGS)
        if rng.random() < 0.5:
            a, b = rng.randint(2, 9), rng.randint(2, 9)
            question = f"{name} has {a} {thing}. {other} gives {name} {b} more {thing}. How many {thing} does {name} " \
                       f"have now?"
            answer = a + b
        else:
            a = rng.randint(5, 15)
            b = rng.randint(1, a - 1)
            question = f"{name} has {a} {thing} and gives {b} of them to {other}. How many {thing} does {name} " \
                       f"have left?"
            answer = a - b
        if (zlib.crc32(question.encode()) % 8 == 0) == (split == "test"):
            messages = [{"role": "user", "content": f"{WORD_EXAMPLE[0]} {WORD_INSTRUCTION}"},
                        {"role": "assistant", "content": WORD_EXAMPLE[1]},
                        {"role": "user", "content": f"{question} {WORD_INSTRUCTION}"}]
            return {"question": messages, "answer": str(answer)}


# `builtin:words2` and `builtin:words3`: the same people and things, a count changed by 2 or 3 events in turn (each a
# gift received or given away, drawn at random), so the operations must be chosen in order and one wrong step dooms
# the answer; asked after two worked examples with as many steps, one adding first, one subtracting first (one example:
# 3% right at temperature 1; two: 7%; docs/real_model.md has the step-0 search).
WORD_CHAIN_EXAMPLES = {
    2: [("Lily has 3 books. Ben gives Lily 6 more books. Then Lily gives 4 of them to Mia. How many books does Lily "
         "have now?", "Lily has 3 + 6 = 9 books. Then 9 - 4 = 5 books. The answer is \\boxed{5}."),
        ("Tom has 8 cards. Tom gives 5 of them to Anna. Then Sam gives Tom 4 more cards. How many cards does Tom "
         "have now?", "Tom has 8 - 5 = 3 cards. Then 3 + 4 = 7 cards. The answer is \\boxed{7}.")],
    3: [("Lily has 3 books. Ben gives Lily 6 more books. Then Lily gives 4 of them to Mia. Then Sam gives Lily 2 more "
         "books. How many books does Lily have now?",
         "Lily has 3 + 6 = 9 books. Then 9 - 4 = 5 books. Then 5 + 2 = 7 books. The answer is \\boxed{7}."),
        ("Tom has 8 cards. Tom gives 5 of them to Anna. Then Sam gives Tom 4 more cards. Then Tom gives 2 of them to "
         "Leo. How many cards does Tom have now?",
         "Tom has 8 - 5 = 3 cards. Then 3 + 4 = 7 cards. Then 7 - 2 = 5 cards. The answer is \\boxed{5}.")],
}


def chain_story(rng, operations, largest=9, then=True):
    """(question, answer): a start count (2 to `largest`), then `operations` events in turn, each with probability
    1/2 a gift received (+ 2 to `largest`) or given away (- 1 to count - 1: every count stays >= 1; a count of 1 only
    receives), the later ones after "Then" (`then`); the question asks for the count at the end."""
    name, *others = rng.sample(WORD_NAMES, 1 + operations)
    thing = rng.choice(WORD_THINGS)
    count = rng.randint(2, largest)
    sentences = [f"{name} has {count} {thing}."]
    for index, other in enumerate(others):
        if count < 2 or rng.random() < 0.5:
            change = rng.randint(2, largest)
            event = f"{other} gives {name} {change} more {thing}."
        else:
            change = -rng.randint(1, count - 1)
            event = f"{name} gives {-change} of them to {other}."
        count += change
        sentences.append(f"Then {event}" if then and index else event)
    return " ".join(sentences) + f" How many {thing} does {name} have now?", count


def chain_word_problem(rng, split, operations):
    """A `builtin:words2` (operations=2) or `builtin:words3` row: the two worked examples of as many steps, then the
    problem (chain_story). Held out as word_problem is: about 1 problem in 8, by a hash of its text."""
    while True:
        question, answer = chain_story(rng, operations)
        if (zlib.crc32(question.encode()) % 8 == 0) == (split == "test"):
            shots = [message for example, solution in WORD_CHAIN_EXAMPLES[operations] for message in (
                {"role": "user", "content": f"{example} {WORD_INSTRUCTION}"},
                {"role": "assistant", "content": solution})]
            return {"question": [*shots, {"role": "user", "content": f"{question} {WORD_INSTRUCTION}"}],
                    "answer": str(answer)}


def builtin_rows(split, n, seed, digits=DIGITS):
    """n problems of `digits` digits, or of (low, high): each problem's digits drawn uniformly from low..high, or
    with digits "early" the early_problem task, "words" the word_problem task, "words2"/"words3" chain_word_problem."""
    if digits == "words":
        rng = random.Random(f"{split}-{seed}-words")
        return [word_problem(rng, split) for _ in range(n)]
    if digits in ("words2", "words3"):
        rng = random.Random(f"{split}-{seed}-{digits}")
        return [chain_word_problem(rng, split, int(digits[-1])) for _ in range(n)]
    if digits == "early":
        rng = random.Random(f"{split}-{seed}-early")
        return [early_problem(rng, split) for _ in range(n)]
    if isinstance(digits, tuple):
        rng = random.Random(f"{split}-{seed}-{digits[0]}-{digits[1]}")
        return [addition_problem(rng, split, rng.randint(*digits)) for _ in range(n)]
    rng = random.Random(f"{split}-{seed}" if digits == 3 else f"{split}-{seed}-{digits}")
    return [addition_problem(rng, split, digits) for _ in range(n)]


def char_tokenizer():
    """The built-in models' tokenizer: one token per printable ASCII character and newline, pad, EOS, unknown, and
    our instruction (common.INSTRUCTION) as one token, so prompts stay short."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    specials = ["<|pad|>", "<|endoftext|>", "<|unk|>"]
    vocab = {token: i for i, token in enumerate(specials + ["\n"] + [chr(c) for c in range(32, 127)])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_tokens([AddedToken(common.INSTRUCTION, normalized=False)])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|pad|>", eos_token="<|endoftext|>",
                                   unk_token="<|unk|>", clean_up_tokenization_spaces=False)


def build_tiny_model(path, sft_steps=SFT_STEPS, seed=0):
    """Build the tiny model into `path` (kept if one is there): a 2-layer Qwen3 with a character tokenizer,
    supervised on 3- to 7-digit additions written with carry_habit, so it starts low (greedy: about 7% of the
    6-digit held-out problems) and RL has four carry contexts to fix. A normal HF checkpoint directory."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    from transformers import Qwen3Config, Qwen3ForCausalLM
    tokenizer = char_tokenizer()
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    rng = random.Random(seed)
    habit = carry_habit(rng)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=sft_steps, pct_start=0.1)
    from tqdm import tqdm
    try:
        for _ in tqdm(range(sft_steps), desc=f"building the tiny model into {path}", leave=False):
            rows = [addition_problem(rng, "train", rng.choice(BUILD_DIGITS)) for _ in range(64)]
            prompts = [tokenizer(common.plain_prompt(r["question"]))["input_ids"] for r in rows]
            answers = [tokenizer(addition_solution(r["a"], r["b"], habit))["input_ids"] + [tokenizer.eos_token_id]
                       for r in rows]
            batch = common.sequence_batch(prompts, answers, tokenizer.pad_token_id)
            logits = model(**batch.model_inputs(), logits_to_keep=batch.response_width + 1).logits[:, :-1]
            mask = batch.response_mask
            loss = torch.nn.functional.cross_entropy(logits[mask], batch.response_ids[mask])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
    except KeyboardInterrupt:  # nothing half-built is cached: the next run builds it again
        raise UserError(f"interrupted while building the tiny model (nothing was written to {path})")
    staging = path + f".tmp{os.getpid()}"
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        os.rename(staging, path)  # atomic: a concurrent builder's copy wins, ours is dropped
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def greedy_accuracy(path, digits=DIGITS, problems=256):
    """Greedy accuracy of the checkpoint at `path` on the first `problems` held-out problems of `builtin:<digits>`."""
    from infra.engine import HFGenerator
    model, tokenizer = common.load_model(path, "auto", "cpu")
    rows = builtin_rows("test", problems, 0, digits)
    prompts = [common.prompt_ids(tokenizer, row["question"]) for row in rows]
    longest = digits[1] if isinstance(digits, tuple) else digits
    completions = HFGenerator(model, tokenizer).generate(prompts, 1, 16 * longest, temperature=0.0)
    return sum(common.score(c.text, rows[c.prompt_index]) for c in completions) / len(rows)


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description="Build a tiny model (the shipped one is models/tiny/) and print "
                                                 "its greedy held-out accuracy beside the shipped model's.")
    parser.add_argument("output", nargs="?", default=os.path.join(CACHE_DIR, TINY_MODEL_VERSION + "-build"))
    parser.add_argument("--sft-steps", type=int, default=SFT_STEPS)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args()
    shutil.rmtree(options.output, ignore_errors=True)
    build_tiny_model(options.output, options.sft_steps, options.seed)
    for digits in (3, DIGITS):
        shipped = f" (models/tiny: {greedy_accuracy(SHIPPED, digits):.3f})" if os.path.exists(SHIPPED) else ""
        print(f"builtin:{digits} greedy accuracy: {greedy_accuracy(options.output, digits):.3f}{shipped}")
    print(f"built {options.output}; train on it with --model {options.output}")
