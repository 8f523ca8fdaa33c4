"""Run by tests/test_vllm.py in a process of its own (one vLLM engine each): `python tests/vllm_turn_end.py CHECKPOINT`
builds a vLLM engine beside the Qwen-like checkpoint's policy (tests/fixtures/qwen_like/, or its Llama layout
without a pad token), which syncs the policy's weights into it; checks every engine path at the turn end
(helpers.check_turn_end_paths); then changes the policy, syncs again and compares the engine's log-probs with
the trainer's."""
import os
import sys

import torch

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(__file__))]
import common  # noqa: E402
import infra.engine  # noqa: E402
import infra.tiny  # noqa: E402
from helpers import check_turn_end_paths  # noqa: E402

model, tokenizer = common.load_model(sys.argv[1], "float32", "cpu")
generator = infra.engine.make_generator("vllm", model, tokenizer, 0.3, 0, 1 / 16)  # the first weight sync
try:
    print(f"stops {generator.stop_ids}, pad {tokenizer.pad_token_id}, "
          f"rows {model.get_input_embeddings().num_embeddings}, sleep level {generator.sleep_level}")
    rows = infra.tiny.builtin_rows("test", 24, 0, 2)
    print(f"turn end: {check_turn_end_paths(generator, tokenizer, rows)} of {len(rows)} turns answered right")
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter), alpha=0.01)
    generator.sync_weights(model)
    prompts = [common.prompt_ids(tokenizer, row["question"]) for row in rows[:8]]
    completions = generator.generate(prompts, 2, 48, 1.0)
    batch = common.sequence_batch([prompts[c.prompt_index] for c in completions], [c.token_ids for c in completions],
                                  tokenizer.pad_token_id)
    with torch.no_grad():
        trainer = common.response_logprobs(model, batch)
    gap = (common.engine_logprobs(completions, batch.response_width) - trainer)[batch.response_mask].abs().max()
    print(f"after a second sync: engine-trainer log-prob gap {gap.item():.2e}")
    assert gap < 1e-4, gap
finally:
    generator.close()
