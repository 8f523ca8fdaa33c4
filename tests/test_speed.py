"""Speed: benchmarks/mfu.py counts the update's useful FLOPs as its docstring (and docs/scaling.md#speed) define
them, and its MFU is those FLOPs over the printed step time and ceiling, so the headline number cannot drift from its
definition; the HF engine casts each weight once per bf16 call."""
import os
import re
import subprocess
import sys

import pytest
import torch

import common

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUMBER = r"(\d+\.\d+(?:e[+-]\d+)?)"


# models/tiny/config.json: 2 layers, hidden 128, 4 heads x 32 (q = 128), 2 key-value heads x 32 (kv = 64), MLP 512,
# vocabulary 100. Matmul parameters of a layer: q 128x128, k and v 128x64 each, o 128x128, gate, up and down 128x512
# each = 16,384 + 2 x 8,192 + 16,384 + 3 x 65,536 = 245,760; two layers: 491,520. Rows: 2 of 4 + 6 = 10 tokens.
# Decoder: 6 x 491,520 x 20 = 58,982,400. LM head over the 6 response positions of each row (the embedding lookup and
# the 7th kept logit column not counted): 6 x 128 x 100 x 12 = 921,600. Attention: 6 x 2 layers x 128 x 2 rows x
# 10^2 = 307,200 (12 x L x heads x head_dim x s^2 / 2 per row). With --left-pad 1 a row holds 9 real tokens:
# decoder 6 x 491,520 x 18 = 53,084,160, attention 6 x 2 x 128 x 2 x 9^2 = 248,832, the LM head as before.
@pytest.mark.parametrize("left_pad, decoder, attention", [(0, 58_982_400, 307_200), (1, 53_084_160, 248_832)])
def test_mfu_counts_the_documented_flops_on_the_tiny_model(left_pad, decoder, attention):
    done = subprocess.run([sys.executable, "benchmarks/mfu.py", "--model", "tiny", "--rows", "2", "--prompt-length",
                           "4", "--response-length", "6", "--steps", "1", "--warmup", "0", "--ceiling-seconds", "0.01",
                           "--left-pad", str(left_pad)],
                          cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = done.stdout
    head = 921_600
    total = float(re.search(rf"useful FLOPs per step: {NUMBER} = decoder matmuls {NUMBER} \+ LM head {NUMBER} "
                            rf"\+ attention {NUMBER}", printed).group(1))
    parts = [float(value) for value in re.search(rf"decoder matmuls {NUMBER} \+ LM head {NUMBER} \+ attention "
                                                 rf"{NUMBER}", printed).groups()]
    assert parts == [decoder, head, attention]
    assert abs(total - (decoder + head + attention)) <= 1e-6 * total  # printed to 7 significant digits
    flops, seconds, rate, share = map(float, re.search(
        rf"MFU: {NUMBER} FLOP / {NUMBER} s = {NUMBER} GFLOP/s = {NUMBER}% of the ceiling", printed).groups())
    ceiling = float(re.search(rf"ceiling: {NUMBER} GFLOP/s", printed).group(1))
    step = float(re.search(rf"step times: {NUMBER} s", printed).group(1))
    assert flops == total and abs(seconds - step) <= 1e-3  # one timed step: the median is that step
    assert abs(rate - flops / seconds / 1e9) <= 0.01 * rate
    assert abs(share - 100 * rate / ceiling) <= 0.01 * share + 0.01


def tiny_qwen3(tied):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                        tie_word_embeddings=tied))


def test_hf_engine_casts_each_weight_once_per_call_under_autocast():
    """In bf16 (autocast over float32 weights) the HF engine's decode steps reuse autocast's cast of each weight:
    inference_mode turns that cache off, and then every step cast every weight again (for the tied [V x h]
    embedding: one cast per sampled token)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from infra.engine import HFGenerator
    from infra.tiny import builtin_rows

    class CountEmbeddingCasts(TorchDispatchMode):
        def __init__(self, shape):
            super().__init__()
            self.shape, self.count = shape, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            casts = (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype)  # to.dtype: under inference_mode
            if func in casts and tuple(args[0].shape) == self.shape:
                self.count += 1
            return func(*args, **kwargs)

    model, tokenizer = common.load_model("tiny", "bfloat16", "cpu")
    prompts = [common.prompt_ids(tokenizer, row["question"]) for row in builtin_rows("train", 2, 0)]
    counter = CountEmbeddingCasts(tuple(model.get_input_embeddings().weight.shape))
    with counter:
        completions = HFGenerator(model, tokenizer).generate(prompts, 2, 6)
    assert [len(c.token_ids) for c in completions] == [6] * 4  # six decode steps (the model answers in ~37 tokens)
    assert counter.count == 1
