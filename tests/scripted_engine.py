"""A scripted rollout engine for tests: it honours common.py's contract (generate(prompts, n, max_tokens, temperature,
top_p) -> list of common.Completion) without a model, so a test can choose how responses end."""
import re

import common


def gold(tokenizer, prompt):
    """The built-in task's answer to a prompt (its ids, a response prefix allowed after it): a + b of its `a+b`."""
    a, b = re.search(r"(\d+)\+(\d+)", tokenizer.decode(prompt, skip_special_tokens=True)).groups()
    return str(int(a) + int(b))


class ScriptedEngine:
    """Every sample is the correct `\\boxed{<a + b>}` followed by spaces, max_tokens tokens in all: with
    finish="length" the last one is a space too and the response is cut at max_tokens (finish_reason "length", no
    EOS), with finish="stop" it is the EOS (finish_reason "stop"). The decoded texts are the same. A budget too small
    for the answer and the EOS gives the answer cut short ("length"). `calls` records (prompts, n, max_tokens)."""
    engine = "scripted"

    def __init__(self, tokenizer, finish):
        assert finish in ("length", "stop")
        self.tokenizer, self.finish, self.calls = tokenizer, finish, []

    def generate(self, prompts, n=1, max_tokens=256, temperature=1.0, top_p=1.0):
        self.calls.append((prompts, n, max_tokens))
        encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        completions = []
        for index, prompt in enumerate(prompts):
            answer = encode(f"\\boxed{{{gold(self.tokenizer, prompt)}}}")
            tokens = answer + encode(" ") * (max_tokens - len(answer) - 1)
            finish = self.finish if len(tokens) == max_tokens - 1 else "length"
            tokens = (tokens + ([self.tokenizer.eos_token_id] if finish == "stop" else encode(" ")))[:max_tokens]
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            completions += [common.Completion(index, list(tokens), text, [-1.0] * len(tokens), finish)
                            for _ in range(n)]
        return completions

    def sync_weights(self, model):
        """No weights."""

    def sleep(self):
        """Nothing to free."""

    def wake_up(self):
        """Nothing to restore."""

    def close(self):
        """Nothing to shut down."""
