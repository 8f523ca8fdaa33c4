"""`builtin:horizon-k<K>-h<H>[-late]`: a task whose credit-assignment difficulty has knobs (docs/horizon.md), and the
small model built to do it at step 0 (models/horizon/, `--model horizon`).

A problem asks for K decisions and a stretch of H tokens that the model writes at random but that cannot change the
reward. The question holds K letters, letter i from its own alphabet (A-I, J-R, a-i, j-r: the values 1-9), where the
decisions go and the stretch's block count n = H / 8 as a clock token:

    question  `CM first <16>`                                (K = 2, n = 16, the decisions first)
    response  `\\boxed{34}   <16>uxzwvy <15>wvyuzz ... <1>yzuxwv`
    or, last: ` <16>uxzwvy <15>wvyuzz ... <1>yzuxwv \\boxed{34}`

Decision i is letter i's value (C = 3, M = 4), so the gold answer is a K-digit number without zeros. Each block is a
clock token (`<16>` ... `<1>`: one token each, counting down; the model stops after `<1>`), 6 letters drawn uniformly
from `uvwxyz` (ln 6 = 1.79 nats each) and a space: 8 tokens, 6 of them random. The decisions first are padded to K =
4's width, so the first block sits as far from the question at every K. The reward is the usual one (the last
\\boxed{} equals the gold answer; a response cut at the length limit scores 0), so a response scores by its K
decisions alone (tests/test_horizon.py). The model's habit, like the tiny model's dropped carries: each decision is
right with probability 0.2 ** (1 / K) and otherwise one too high (9 -> 1), so a response is right about 1 time in 5
at every K. Held out: 1 letter set in 8 for K >= 2; the 9 questions of K = 1 are all trained on (its held-out
evaluation samples them afresh).
"""
import os
import random
import re
import shutil
import zlib

import torch

import common
from infra import UserError
from infra.hub import ROOT

CLASSES = ("ABCDEFGHI", "JKLMNOPQR", "abcdefghi", "jklmnopqr")  # decision i's letters, values 1-9
STRETCH_LETTERS = "uvwxyz"  # the stretch's random letters (ln 6 nats each at step 0)
BLOCK_TOKENS = 8  # a block: a clock token, 6 random letters, a space
RANDOM_PER_BLOCK = 6
MAX_DECISIONS = len(CLASSES)
MAX_BLOCKS = 136  # the clock tokens <0> ... <136>: H up to 1,088, the lengths the model was built on
CLOCK = [f"<{n}>" for n in range(MAX_BLOCKS + 1)]
CLOCK_SET = set(CLOCK)
TARGET_ACCURACY = 0.2  # the habit: a response is right with this probability at every K (each decision 0.2 ** (1/K))
SPEC = re.compile(r"horizon-k(\d+)-h(\d+)(-late)?")
SHIPPED = os.path.join(ROOT, "models", "horizon")


def parse_spec(text, flag="--dataset"):
    """(K, H, late) of `horizon-k<K>-h<H>[-late]` (the part after `builtin:`), refused in one line if malformed."""
    match = SPEC.fullmatch(text)
    k, h = (int(match[1]), int(match[2])) if match else (0, -1)
    if not match or not 1 <= k <= MAX_DECISIONS or h % BLOCK_TOKENS or h > MAX_BLOCKS * BLOCK_TOKENS:
        raise UserError(f"{flag} builtin:{text}: the horizon task is `builtin:horizon-k<K>-h<H>` or "
                        f"`builtin:horizon-k<K>-h<H>-late`: K decisions (1 to {MAX_DECISIONS}), H irrelevant tokens "
                        f"(a multiple of {BLOCK_TOKENS}, 0 to {MAX_BLOCKS * BLOCK_TOKENS}), the decisions first, or "
                        f"last with -late; e.g. builtin:horizon-k1-h256")
    return k, h, bool(match[3])


def spec_name(k, h, late=False):
    """parse_spec's inverse: `horizon-k<K>-h<H>[-late]`."""
    return f"horizon-k{k}-h{h}" + "-late" * late


def horizon_problem(rng, split, k, h, late):
    """A row: the question (K letters, first/last, the block count), the gold answer (K digits) and the values."""
    while True:
        values = [rng.randint(1, 9) for _ in range(k)]
        letters = "".join(CLASSES[i][value - 1] for i, value in enumerate(values))
        if k == 1 or (zlib.crc32(letters.encode()) % 8 == 0) == (split == "test"):  # held out: 1 letter set in 8
            return {"question": f"{letters} {'last' if late else 'first'} <{h // BLOCK_TOKENS}>",
                    "answer": "".join(map(str, values)), "values": values, "blocks": h // BLOCK_TOKENS, "late": late}


def horizon_rows(split, n, seed, spec):
    k, h, late = parse_spec(spec)
    rng = random.Random(f"{split}-{seed}-{spec}")
    return [horizon_problem(rng, split, k, h, late) for _ in range(n)]


def stretch(rng, blocks):
    """The irrelevant stretch: blocks counting down from `blocks` to 1, each a clock token and 6 random letters,
    space-joined. (Counters written in digits, 3 tokens a block, were not kept by a 2- or 3-layer model over a
    hundred blocks: it skipped or repeated counts; one token a count it keeps better, not perfectly: see
    docs/horizon.md.)"""
    return " ".join(f"<{c}>" + "".join(rng.choice(STRETCH_LETTERS) for _ in range(RANDOM_PER_BLOCK))
                    for c in range(blocks, 0, -1))


def horizon_tokenizer():
    """The character tokenizer of the built-in models (infra.tiny.char_tokenizer) with the clock tokens <0>-<136>."""
    from tokenizers import AddedToken
    from infra.tiny import char_tokenizer
    tokenizer = char_tokenizer()
    tokenizer.add_tokens([AddedToken(token, normalized=False) for token in CLOCK])
    return tokenizer


def habit_probability(k):
    return TARGET_ACCURACY ** (1 / k)


def solution(row, rng, right=None):
    """A response to `row` as the model's supervised data writes it: each decision right with probability
    habit_probability(K) (or as `right` says, a list of booleans), else one too high; the stretch at random."""
    k = len(row["values"])
    right = right if right is not None else [rng.random() < habit_probability(k) for _ in range(k)]
    digits = "".join(str(value if ok else value % 9 + 1) for value, ok in zip(row["values"], right))
    answer, text = f"\\boxed{{{digits}}}", stretch(rng, row["blocks"])
    if not text:
        return answer
    # decisions first: padded to the width of K = 4, so the first block sits as far from the question at every K
    return f" {text} {answer}" if row["late"] else answer + " " * (MAX_DECISIONS + 1 - k) + text


SFT_STEPS = 3000  # supervised steps of about SFT_TOKENS response tokens each
SFT_TOKENS = 8192
SFT_MAX_BLOCKS = 136  # the build's stretches: 0 to 136 blocks (H up to 1,088), every K and both placements
SFT_SHORT, SFT_ANY = 0.3, 0.3  # shares of steps of at most 8 blocks, of 0-136; the rest 96-136 (the rare clocks)


def key_positions(pieces, decisions):
    """Offsets in a response's tokens (`pieces`: their strings, tokenizer.convert_ids_to_tokens) of the tokens the
    build weights: the `decisions` digits after `\\boxed{`, every clock token and the token after the last block
    (the end, or the space before a late `\\boxed{`)."""
    opening = list("\\boxed{")
    start = next(i for i in range(len(pieces)) if pieces[i - len(opening):i] == opening)
    clocks = [i for i, piece in enumerate(pieces) if piece in CLOCK_SET]
    after = clocks[-1] + 1 + RANDOM_PER_BLOCK if clocks else start + decisions + 1  # no stretch: after the `}`
    return [*range(start, start + decisions), *clocks, after]


def stretch_positions(pieces):
    """Offsets of the stretch's random letters in a response's tokens (`pieces`, as key_positions takes them)."""
    return [i + j for i, piece in enumerate(pieces) if piece in CLOCK_SET for j in range(1, RANDOM_PER_BLOCK + 1)
            if i + j < len(pieces)]


def build_horizon_model(path, sft_steps=SFT_STEPS, seed=0, log_every=100, layers=2):
    """Build the horizon model into `path`: a 2-layer Qwen3 (the tiny model's shape, 2,048 positions) with the
    character tokenizer and the clock tokens (horizon_tokenizer), supervised on `solution` for K 1-4, 0-136 blocks,
    both placements, each step's examples sharing one block count (no padding) and about SFT_TOKENS tokens. The loss
    is the response tokens' mean cross-entropy plus that of the decisions, clocks and stretch ends (key_positions):
    without the second term, a thousand random letters outweigh them and the model does not read the question. A
    normal HF checkpoint directory."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    tokenizer = horizon_tokenizer()
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=512, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                         tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(seed)
    model, rng = Qwen3ForCausalLM(config), random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=sft_steps, pct_start=0.1)
    for step in range(sft_steps):
        draw = rng.random()  # short (decisions most of the tokens), any length, long (every clock seen often)
        blocks = rng.randint(0, 8) if draw < SFT_SHORT else rng.randint(0, SFT_MAX_BLOCKS) if draw < SFT_SHORT + \
            SFT_ANY else rng.randint(SFT_MAX_BLOCKS - 40, SFT_MAX_BLOCKS)
        rows = [horizon_problem(rng, "train", rng.randint(1, MAX_DECISIONS), BLOCK_TOKENS * blocks, rng.random() < 0.5)
                for _ in range(max(4, SFT_TOKENS // (BLOCK_TOKENS * blocks + 16)))]
        texts = [solution(row, rng) for row in rows]
        batch = common.sequence_batch([common.prompt_ids(tokenizer, row["question"]) for row in rows],
                                      [tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                                       for text in texts], tokenizer.pad_token_id)
        keys = torch.zeros_like(batch.response_mask)
        for index, (row, ids) in enumerate(zip(rows, batch.response_ids.tolist())):
            keys[index, key_positions(tokenizer.convert_ids_to_tokens(ids), len(row["values"]))] = True
        logits = model(**batch.model_inputs(), logits_to_keep=batch.response_width + 1).logits[:, :-1]
        losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch.response_ids, reduction="none")
        loss = losses[batch.response_mask].mean() + losses[keys].mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if log_every and (step % log_every == 0 or step == sft_steps - 1):
            print(f"step {step:5d} blocks {blocks:3d} rows {len(rows):3d} loss {loss.item():.4f} "
                  f"(decisions, clocks, ends {losses[keys].mean().item():.4f})", flush=True)
    staging = path + f".tmp{os.getpid()}"
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(path, ignore_errors=True)
    os.rename(staging, path)
    return path


# `--preset horizon` (auto with `--model horizon`): the CPU demo's controlled comparison (infra.cli's
# CONTROLLED_TINY_PRESET and each file's TINY_PRESET: only each method's own mechanism differs) on this task, with
# rollouts a quarter the size (16 prompts x 8, SPPO 128 x 1) so that a GRPO run at H = 1,024 takes about 10 minutes
# on one core; responses up to H + 64 tokens; held-out accuracy sampled at temperature 1 (greedy decoding shows 0%
# until a decision's right digit overtakes its habit). SPO's cutpoint interval grows with H (see preset).
RUN_PRESET = dict(model="horizon", dataset="builtin:horizon-k1-h256", answer_format="auto", steps=20,
                  micro_batch_size=16, micro_batch_tokens=0, gradient_checkpointing=False, eval_datasets=("builtin",),
                  eval_every=5, eval_problems=128, eval_n=1, eval_temperature=1.0, eval_top_p=1.0, save_every=0)
ROLLOUT_SHARE = 4  # rollouts a quarter of the tiny demo's 512 samples
LENGTH_SLACK = 64  # response limit: H + this (K decisions and H tokens take H + 12, late H + K + 9)


def preset(dataset, controlled):
    """The horizon preset's values for --dataset `dataset` over `controlled` (the tiny demo's shared preset and the
    method file's own TINY_PRESET). SPO's `cut_interval` (a cutpoint every N-th low-probability token; 5 in the
    demo) becomes max(5, H / 8), about 5 cutpoints per response at every H: at 5, its Monte Carlo continuations
    would be about 100 per response at H = 1,024, some 25M tokens a step."""
    values = {**RUN_PRESET, **controlled}
    values["prompts_per_step"] = max(1, values["prompts_per_step"] // ROLLOUT_SHARE)
    spec = dataset.partition(":")[2] if dataset.startswith("builtin:horizon") else "horizon-k1-h256"
    h = parse_spec(spec)[1]
    values.update(max_response_tokens=h + LENGTH_SLACK, eval_max_tokens=h + LENGTH_SLACK)
    values["cut_interval"] = max(5, h // BLOCK_TOKENS)  # spo.py's own (SPO: 5, "int5"); other files have none
    return values


BLOCK = re.compile(r"<(\d+)>([a-z]{6})")


def parse_response(text, row):
    """(decisions right: list of bools or None if there is no \\boxed{} of K digits, stretch well formed: the blocks
    count down from n to 1 as the question asks, with 6 letters of STRETCH_LETTERS each)."""
    k, blocks = len(row["values"]), row["blocks"]
    match = re.search(r"\\boxed\{(\d+)\}", text)
    digits = match[1] if match and len(match[1]) == k else None
    right = None if digits is None else [d == g for d, g in zip(digits, row["answer"])]
    rest = (text[:match.start()] + text[match.end():]).strip() if match else text.strip()
    found = [BLOCK.fullmatch(word) for word in rest.split()] if rest else []
    well_formed = len(found) == blocks and all(
        f and int(f[1]) == blocks - i and set(f[2]) <= set(STRETCH_LETTERS) for i, f in enumerate(found))
    return right, well_formed


def report(path, settings, problems=64, samples=4, seed=0):
    """Step-0 numbers of the model at `path` on each (K, H, late) of `settings`: sampled accuracy (temperature 1,
    `samples` per held-out problem), the share of responses that stop within the preset's limit (the others score
    0), of all the share that stop with the stretch well formed, each decision's accuracy, and the stretch's
    per-token entropy (the mean of -log p over its sampled random letters: an unbiased estimate at temperature 1;
    ln 6 = 1.79 nats for uniform letters)."""
    from infra.engine import HFGenerator
    model, tokenizer = common.load_model(path, "float32", "cpu")
    generator, lines = HFGenerator(model, tokenizer), []
    for k, h, late in settings:
        spec = spec_name(k, h, late)
        rows = horizon_rows("test", problems, seed, spec)
        torch.manual_seed(seed)
        completions = generator.generate([common.prompt_ids(tokenizer, row["question"]) for row in rows], samples,
                                         h + LENGTH_SLACK, 1.0, 1.0)
        rewards, stopped_share, formed, decisions, surprisal = [], [], [], [], []
        for completion in completions:
            row = rows[completion.prompt_index]
            stopped = completion.finish_reason == "stop"
            stopped_share.append(stopped)
            rewards.append(common.score(completion.text, row) if stopped else 0.0)
            right, well_formed = parse_response(completion.text, row)
            formed.append(stopped and well_formed)
            decisions.extend(right or [False] * k)
            surprisal.extend(-completion.logprobs[i] for i in stretch_positions(
                tokenizer.convert_ids_to_tokens(completion.token_ids)) if i < len(completion.logprobs))
        mean = lambda values: sum(values) / max(1, len(values))  # noqa: E731
        lines.append(dict(dataset=f"builtin:{spec}", accuracy=mean(rewards), stopped=mean(stopped_share),
                          well_formed=mean(formed),
                          decision_accuracy=mean(decisions), stretch_entropy=mean(surprisal),
                          response_tokens=mean([len(c.token_ids) for c in completions])))
    return lines


# (K, H, late) of the sweep (docs/horizon.md), in its order: the extremes of H first, then the middle, then more
# decisions, then the decisions last
SWEEP_SETTINGS = [(1, 0, False), (1, 1024, False), (1, 256, False), (1, 64, False), (3, 0, False), (3, 256, False),
                  (1, 256, True)]


def print_report(path, settings=SWEEP_SETTINGS, problems=64, samples=4):
    print(f"{path}: {problems} held-out problems x {samples} samples at temperature 1")
    print(f"{'dataset':32} {'accuracy':>8} {'decision':>8} {'stopped':>7} {'formed':>7} {'entropy':>7} {'tokens':>7}")
    for line in report(path, settings, problems, samples):
        print(f"{line['dataset']:32} {line['accuracy']:8.3f} {line['decision_accuracy']:8.3f} {line['stopped']:7.3f} "
              f"{line['well_formed']:7.3f} {line['stretch_entropy']:7.3f} {line['response_tokens']:7.1f}", flush=True)


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description="Build the horizon task's model (the shipped one is models/horizon/) "
                                                 "and print its step-0 numbers at the sweep's settings; --report "
                                                 "prints them for an existing model.")
    parser.add_argument("output", nargs="?", default="runs/horizon-build", help="folder to build into")
    parser.add_argument("--sft-steps", type=int, default=SFT_STEPS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--report", default="", help="print the numbers of this model folder, build nothing")
    parser.add_argument("--problems", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4)
    options = parser.parse_args()
    if not options.report:
        build_horizon_model(options.output, options.sft_steps, options.seed)
    print_report(options.report or options.output, problems=options.problems, samples=options.samples)
