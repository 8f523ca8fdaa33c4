"""The built-in task (3-digit addition worked digit by digit, answer in \\boxed{}) and the built-in tiny model
(a 2-layer Qwen3 with a character tokenizer, supervised on that task), built once and cached as a Hugging Face
checkpoint that loads through from_pretrained like any other model. `python -m infra.tiny` rebuilds it.
"""
import json
import os
import random
import shutil

import torch

import common
from infra import UserError

CACHE_DIR = os.path.expanduser(os.environ.get("RL_REASONING_CACHE", "~/.cache/rl-reasoning"))
TINY_MODEL_VERSION = "tiny-v2"  # bump when build_tiny_model changes, so stale caches are not reused
TINY_SHAPE = (128, 2, 100)  # hidden size, layers, vocabulary of the built-in tiny model


def is_tiny_model(name):
    """`tiny`, or a checkpoint of it (its config has the built-in model's shape): such runs take the tiny preset."""
    config_path = os.path.join(name, "config.json")
    if name == "tiny" or not os.path.exists(config_path):
        return name == "tiny"
    with open(config_path) as handle:
        config = json.load(handle)
    return (config.get("hidden_size"), config.get("num_hidden_layers"), config.get("vocab_size")) == TINY_SHAPE


def is_heldout(a, b):
    return (a * 1000 + b) % 61 == 0  # about 1.6% of all pairs; never used for SFT or RL


def addition_problem(rng, split):
    while True:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        if is_heldout(a, b) == (split == "test"):
            return {"question": f"{a}+{b}", "answer": str(a + b), "a": a, "b": b}


def addition_solution(a, b, carries=True):
    """`8+5+0=13 7+6+1=14 4+3+1=8 \\boxed{843}` for 478+365; carries=False writes every carry as 0."""
    steps, digits, carry = [], [], 0
    for x, y in zip(reversed(str(a)), reversed(str(b))):
        total = int(x) + int(y) + carry
        steps.append(f"{x}+{y}+{carry}={total}")
        digits.append(str(total % 10))
        carry = total // 10 if carries else 0
    answer = (str(carry) if carry else "") + "".join(reversed(digits))
    return " ".join(steps) + f" \\boxed{{{int(answer)}}}"


def builtin_rows(split, n, seed):
    rng = random.Random(f"{split}-{seed}")
    return [addition_problem(rng, split) for _ in range(n)]



def build_tiny_model(cache_dir=CACHE_DIR, sft_steps=400, seed=0):
    """Build (once) the built-in tiny model: a 2-layer Qwen3 with a character tokenizer, supervised on
    the built-in addition task where 60% of the examples ignore carries. It starts at roughly 20-30%
    greedy held-out accuracy, so RL has a habit to fix. Cached as a normal HF checkpoint directory.
    Rebuild by hand with `python -m infra.tiny`."""
    path = os.path.join(cache_dir, TINY_MODEL_VERSION)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
    specials = ["<|pad|>", "<|endoftext|>", "<|unk|>"]
    vocab = {token: i for i, token in enumerate(specials + ["\n"] + [chr(c) for c in range(32, 127)])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_tokens([AddedToken(common.INSTRUCTION, normalized=False)])  # the instruction as one token: short prompts
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<|pad|>", eos_token="<|endoftext|>",
                                        unk_token="<|unk|>", clean_up_tokenization_spaces=False)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=sft_steps, pct_start=0.1)
    from tqdm import tqdm
    try:
        for _ in tqdm(range(sft_steps), desc="building the tiny model (one time)", leave=False):
            rows = [addition_problem(rng, "train") for _ in range(64)]
            prompts = [tokenizer(common.plain_prompt(r["question"]))["input_ids"] for r in rows]
            answers = [tokenizer(addition_solution(r["a"], r["b"], carries=rng.random() > 0.6))["input_ids"]
                       + [tokenizer.eos_token_id] for r in rows]
            batch = common.sequence_batch(prompts, answers, tokenizer.pad_token_id)
            logits = model(**batch.model_inputs(), logits_to_keep=batch.response_width + 1).logits[:, :-1]
            mask = batch.response_mask
            loss = torch.nn.functional.cross_entropy(logits[mask], batch.response_ids[mask])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
    except KeyboardInterrupt:  # nothing half-built is cached: the next run builds it again
        raise UserError("interrupted while building the tiny model (nothing was cached; the next run builds it)")
    staging = path + f".tmp{os.getpid()}"
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    os.makedirs(cache_dir, exist_ok=True)
    try:
        os.rename(staging, path)  # atomic: a concurrent builder's copy wins, ours is dropped
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return path


if __name__ == "__main__":
    shutil.rmtree(os.path.join(CACHE_DIR, TINY_MODEL_VERSION), ignore_errors=True)
    print(build_tiny_model())
