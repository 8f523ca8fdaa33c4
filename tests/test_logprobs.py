"""Per-token log-probs (common.head_logprobs, response_logprobs, engine_logprobs) and token-budget micro-batches
(infra.packing.token_budget_chunks, common.micro_batches, batched)."""
import functools
import math
import random

import pytest
import torch

import common
import infra.engine
import infra.packing

LN2 = math.log(2.0)


def naive_logprobs(logits, tokens, temperature=1.0):
    return (logits.double() / temperature).log_softmax(-1).gather(-1, tokens[..., None]).squeeze(-1)


# ------------------------------------------------------------------------------------------------
# head_logprobs: log softmax(h W^T / tau)[y], the vocabulary a slice at a time; values and gradients
# ------------------------------------------------------------------------------------------------
def test_head_logprobs_hand_computed():
    # W = I: the logits are the hidden states. z = [0, 0, ln 2]: exp(z) = 1, 1, 2, sum 4 -> log p = ln 1/4, ln 1/2.
    # z / 0.5 = [0, 0, 2 ln 2]: exp = 1, 1, 4, sum 6 -> log p_2 = ln 4/6 = ln 2/3, log p_0 = ln 1/6.
    hidden, identity = torch.tensor([[0.0, 0.0, LN2], [0.0, 0.0, LN2]]), torch.eye(3)
    tokens = torch.tensor([2, 0])
    assert torch.allclose(common.head_logprobs(hidden, identity, tokens), torch.tensor([math.log(0.5), math.log(0.25)]))
    assert torch.allclose(common.head_logprobs(hidden, identity, tokens, temperature=0.5),
                          torch.tensor([math.log(2 / 3), math.log(1 / 6)]))


def test_head_logprobs_gradients_hand_computed():
    # d log p_y / d z_j = (1[j = y] - p_j) / T; with z = h W^T: dh = dz W, dW = dz^T h.
    # T = 1, y = 2, p = (1/4, 1/4, 1/2): dz = (-1/4, -1/4, 1/2); W = I: dh = dz; h = [0, 0, ln 2]: dW = dz^T h, whose
    # last column is ln 2 x dz and the others 0.
    # T = 0.5, y = 0, p = (1/6, 1/6, 2/3): dz = (5/6, -1/6, -2/3) / 0.5 = (5/3, -1/3, -4/3).
    hidden = torch.tensor([[0.0, 0.0, LN2]], requires_grad=True)
    identity = torch.eye(3, requires_grad=True)
    common.head_logprobs(hidden, identity, torch.tensor([2])).sum().backward()
    dz = torch.tensor([[-0.25, -0.25, 0.5]])
    assert torch.allclose(hidden.grad, dz)
    assert torch.allclose(identity.grad, torch.cat([torch.zeros(3, 2), LN2 * dz.T], 1))
    hidden.grad = None
    common.head_logprobs(hidden, identity, torch.tensor([0]), temperature=0.5).sum().backward()
    assert torch.allclose(hidden.grad, torch.tensor([[5 / 3, -1 / 3, -4 / 3]]))


@pytest.mark.parametrize("chunk_elements", [1, 10 ** 7])  # 256-column slices (4, the last 232 wide), or one slice
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_logprobs_match_whole_logits_across_slices(chunk_elements, temperature):
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16, requires_grad=True)
    weight = (torch.randn(1000, 16) / 2).requires_grad_()
    tokens = torch.randint(0, 1000, (3, 7))
    tokens[0, :4] = torch.tensor([0, 255, 256, 999])  # a slice's first and last columns
    upstream = torch.randn(3, 7)
    ours = common.head_logprobs(hidden, weight, tokens, temperature, chunk_elements=chunk_elements)
    our_grads = torch.autograd.grad((ours * upstream).sum(), (hidden, weight))
    reference = naive_logprobs(hidden @ weight.T, tokens, temperature)
    reference_grads = torch.autograd.grad((reference * upstream).sum(), (hidden, weight))
    assert ours.dtype == torch.float32 and ours.shape == (3, 7)
    assert torch.allclose(ours.double(), reference, atol=1e-5)
    for mine, theirs in zip(our_grads, reference_grads):
        assert mine.dtype == torch.float32 and torch.allclose(mine.double(), theirs.double(), atol=1e-5)


def test_head_logprobs_in_bfloat16_as_autocast_runs_the_head():
    # dtype bfloat16 over float32 hidden states and weights: the logits are autocast's bf16 matmul, softmax in float32
    torch.manual_seed(0)
    hidden, weight = torch.randn(5, 32, requires_grad=True), torch.randn(300, 32, requires_grad=True)
    tokens = torch.randint(0, 300, (5,))
    ours = common.head_logprobs(hidden, weight, tokens, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = torch.nn.functional.linear(hidden, weight)
    assert logits.dtype == torch.bfloat16 and ours.dtype == torch.float32
    assert torch.allclose(ours.double(), naive_logprobs(logits.detach().float(), tokens), atol=1e-5)
    ours.sum().backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.float32  # the parameters' own dtype


def test_head_logprobs_keep_no_vocabulary_sized_tensor():
    # Saved for backward: the hidden states, the weight itself, the tokens and one logsumexp per position; made in
    # the forward and backward passes: slices of at most 256 vocabulary columns here, never [N, V] logits.
    from torch.utils._python_dispatch import TorchDispatchMode
    hidden, weight = torch.randn(12, 8, requires_grad=True), torch.randn(1000, 8, requires_grad=True)
    tokens = torch.randint(0, 1000, (12,))
    saved, widths = [], []

    class Shapes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            widths.extend(t.shape[-1] for t in (out if isinstance(out, (tuple, list)) else [out])
                          if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[0] == 12)
            return out

    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t), Shapes():
        common.head_logprobs(hidden, weight, tokens, chunk_elements=1).sum().backward()
    assert sorted(tuple(t.shape) for t in saved) == [(12,), (12,), (12, 8), (1000, 8)]
    assert any(saved_tensor is weight for saved_tensor in saved)  # the parameter itself, not a copy
    assert max(widths) == 256 and 1000 not in widths


def test_head_logprobs_empty():
    assert common.head_logprobs(torch.zeros(0, 4), torch.zeros(7, 4), torch.zeros(0, dtype=torch.long)).shape == (0,)


# ------------------------------------------------------------------------------------------------
# response_logprobs against whole logits (the path before: model logits, then log-softmax)
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    return common.load_model("tiny", "float32", "cpu")


def random_qwen3(tied, vocab=1000):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                        tie_word_embeddings=tied))
    model.compute_dtype = torch.float32
    return model


def whole_logits_logprobs(model, batch, temperature):
    logits = model(**batch.model_inputs()).logits[:, -batch.response_width - 1:-1]
    return naive_logprobs(logits, batch.response_ids, temperature)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_response_logprobs_equal_whole_logits_values_and_gradients(tied, temperature, monkeypatch):
    """Float32, a tied and an untied head, the vocabulary in 4 slices of at most 256 columns, padded
    rows (responses of 4, 1, 0 and 3 tokens; prompts of 3, 3, 2, 4) and two rows sharing a prompt: values and every
    parameter's gradient (the head's and a tied embedding's included) within 1e-5 of whole logits."""
    model = random_qwen3(tied)
    monkeypatch.setattr(common, "head_logprobs", functools.partial(common.head_logprobs, chunk_elements=1))
    batch = common.sequence_batch([[5, 6, 7], [5, 6, 7], [8, 9], [1, 2, 3, 4]],
                                  [[10, 11, 12, 13], [14], [], [15, 16, 2]], pad_id=0)
    upstream, mask = torch.randn(batch.response_ids.shape), batch.response_mask
    gradients, values = [], []
    for function in (lambda: common.response_logprobs(model, batch, temperature),
                     lambda: whole_logits_logprobs(model, batch, temperature)):
        model.zero_grad()
        out = function()
        (out * upstream * mask).sum().backward()
        values.append(out[mask].double())
        gradients.append({name: parameter.grad.clone() for name, parameter in model.named_parameters()})
    assert torch.allclose(values[0], values[1], atol=1e-5)
    assert gradients[0].keys() == gradients[1].keys() and ("lm_head.weight" in gradients[0]) != tied
    for name, reference in gradients[1].items():
        assert torch.allclose(gradients[0][name].double(), reference.double(), atol=1e-5), name
    with torch.no_grad():  # the old and reference log-probs' path
        assert torch.allclose(common.response_logprobs(model, batch, temperature)[mask].double(), values[1], atol=1e-5)


def test_response_logprobs_take_whole_logits_where_the_model_rescales_them(monkeypatch):
    """A config that names a logit transform after the head (Gemma 2's final_logit_softcapping ...) takes the model's
    own logits; the head is never bypassed there (Qwen3 ignores the field: the numbers must stay the same)."""
    model = random_qwen3(True)
    batch = common.sequence_batch([[5, 6, 7], [8, 9]], [[10, 11], [12]], pad_id=0)
    fused = common.response_logprobs(model, batch, 0.8)
    model.config.final_logit_softcapping = 30.0
    swapped = []
    monkeypatch.setattr(model, "set_output_embeddings", lambda head: swapped.append(head))
    whole = common.response_logprobs(model, batch, 0.8)
    assert swapped == [] and torch.allclose(fused, whole, atol=1e-5)


def test_response_logprobs_match_naive_and_gradients(tiny):
    model, tokenizer = tiny
    batch = common.sequence_batch([[5, 6, 7], [8, 9]], [[10, 11, 1], [12]], tokenizer.pad_token_id)
    ours = common.response_logprobs(model, batch, temperature=0.8)
    (ours * batch.response_mask).sum().backward()
    our_grad = model.model.norm.weight.grad.clone()
    model.zero_grad()
    logits = model(**batch.model_inputs()).logits[:, -batch.response_width - 1:-1]
    reference = (logits / 0.8).log_softmax(-1).gather(-1, batch.response_ids[..., None]).squeeze(-1)
    (reference * batch.response_mask).sum().backward()
    assert torch.allclose(ours[batch.response_mask], reference[batch.response_mask], atol=1e-5)
    assert torch.allclose(our_grad, model.model.norm.weight.grad, atol=1e-5)
    model.zero_grad()
    assert isinstance(model.get_output_embeddings(), torch.nn.Linear)  # the head is back after the call


def grouped_batch(tokenizer, prompt_lengths=(1, 5, 9, 3), samples=3, seed=0, head=0):
    """`samples` rows per prompt (a prompt of one token included: nothing to share but the last column), responses
    of 0-8 tokens (an empty one included); head > 0: every prompt starts with the same `head` tokens (a system turn,
    a few-shot example)."""
    rng = random.Random(seed)
    common_head = [rng.randint(4, 90) for _ in range(head)]
    prompts = [common_head + prompt for length in prompt_lengths
               for prompt in [[rng.randint(4, 90) for _ in range(length)]] * samples]
    responses = [[rng.randint(4, 90) for _ in range(rng.randint(0, 8))] for _ in prompts]
    responses[1] = []
    return common.sequence_batch(prompts, responses, tokenizer.pad_token_id)


# head 0: four distinct prompts (1, 5, 9, 3 tokens), each read once; head 20: the four start with the same 20 tokens,
# read once for all (the shortest prompt's 20 + 1 tokens leave 20 before its last column, and it keeps one of those),
# then each prompt's rest (9 + 1 columns at most)
@pytest.mark.parametrize("head, samples, passes", [(0, 3, [(4, 9 - 1)]), (20, 3, [(1, 19), (4, 10 - 1)]),
                                                   (20, 1, [(1, 19), (4, 10 - 1)])])
@pytest.mark.parametrize("value_head", [0, 1])
def test_response_forward_shares_prompts_with_the_full_forwards_numbers(value_head, head, samples, passes):
    """Rows of one prompt read it once (keys and values indexed out to each row), and the prompts' common head once
    for all of them: outputs at columns P-1 .. P+T-1 and every parameter's gradient equal one full forward's, for the
    policy and for a value-head critic."""
    model, tokenizer = common.load_model("tiny", "float32", "cpu", value_head=value_head)
    batch = grouped_batch(tokenizer, samples=samples, head=head)
    calls = []
    model.register_forward_hook(lambda module, args, kwargs, out: calls.append(kwargs["input_ids"].shape),
                                with_kwargs=True)
    shared = common.response_forward(model, batch).logits
    assert calls[:-1] == passes and calls[-1] == (4 * samples, batch.response_width + 1)
    full = model(**batch.model_inputs()).logits[:, -batch.response_width - 1:]
    kept = torch.cat([torch.ones(len(batch.input_ids), 1, dtype=torch.bool), batch.response_mask], 1)
    assert shared.shape == full.shape
    assert torch.allclose(shared[kept], full[kept], atol=1e-5)
    gradients = []
    for outputs in (shared, full):
        model.zero_grad()
        outputs[kept].square().sum().backward(retain_graph=True)
        gradients.append([parameter.grad.clone() for parameter in model.parameters()])
    for ours, reference in zip(*gradients):  # float noise of a different summation order
        assert (ours - reference).norm() <= 1e-5 * reference.norm() + 1e-6


def test_response_forward_plain_when_nothing_is_shared(tiny):
    """Distinct prompts take one plain forward: the critic's value head (no logits_to_keep) still returns T+1
    columns."""
    _, tokenizer = tiny
    critic = common.load_model("tiny", "float32", "cpu", value_head=1)[0]
    batch = grouped_batch(tokenizer, samples=1)
    calls = []
    critic.register_forward_hook(lambda module, args, out: calls.append(1))
    values = common.critic_outputs(critic, batch)
    assert len(calls) == 1 and values.shape == batch.response_ids.shape
    full = critic(**batch.model_inputs()).logits[:, -batch.response_width - 1:-1, 0]
    assert torch.allclose(values[batch.response_mask], full[batch.response_mask], atol=1e-5)


def test_micro_batches_keep_a_groups_rows_together():
    """Rows go in rollout order (a group's samples are consecutive there), whatever order the mini-batch drew."""
    assert common.micro_batches([7, 0, 5, 2, 6, 1, 4, 3], None, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_hf_generator_logprobs_match_trainer(tiny, temperature):
    model, tokenizer = tiny
    torch.manual_seed(0)
    prompts = [common.prompt_ids(tokenizer, q) for q in ("123+456", "907+88")]
    completions = infra.engine.HFGenerator(model, tokenizer).generate(prompts, 2, 24, temperature, 1.0)
    batch = common.sequence_batch([prompts[c.prompt_index] for c in completions], [c.token_ids for c in completions],
                                  tokenizer.pad_token_id)
    with torch.no_grad():
        trainer = common.response_logprobs(model, batch, temperature)
    engine = common.engine_logprobs(completions, batch.response_width)
    assert (engine - trainer)[batch.response_mask].abs().max() < 1e-4


def test_hf_generator_ignores_the_models_own_sampling_defaults():
    """A checkpoint's generation_config (say temperature 0.3, top-k 3, top-p 0.5) must not change how rollouts are
    sampled: the engine's log-probs still equal the trainer's at the requested temperature, and sampling at 1.0
    still spreads over many responses (top-k 3 at temperature 0.3 would make almost all of them identical)."""
    from transformers import GenerationConfig
    model, tokenizer = common.load_model("tiny", "float32", "cpu")
    model.generation_config = GenerationConfig(do_sample=True, temperature=0.3, top_k=3, top_p=0.5)
    torch.manual_seed(0)
    prompt = common.prompt_ids(tokenizer, "478+365")
    completions = infra.engine.HFGenerator(model, tokenizer).generate([prompt], 64, 48, 1.0, 1.0)
    batch = common.sequence_batch([prompt] * 64, [c.token_ids for c in completions], tokenizer.pad_token_id)
    with torch.no_grad():
        trainer = common.response_logprobs(model, batch, 1.0)
    engine = common.engine_logprobs(completions, batch.response_width)
    assert (engine - trainer)[batch.response_mask].abs().max() < 1e-4
    assert len({tuple(c.token_ids) for c in completions}) >= 5


def test_hf_generator_overrides_a_checkpoints_generation_config(tmp_path):
    """A checkpoint whose generation_config.json sets a repetition penalty, a no-repeat n-gram size, top-k and two EOS
    ids. Rollouts must sample the distribution the trainer computes (engine log-probs = trainer log-probs at the
    requested temperature: a leaked repetition penalty would rescale the logits) and stop on either EOS id."""
    from transformers import GenerationConfig
    model, tokenizer = common.load_model("tiny", "float32", "cpu")
    space = tokenizer.convert_tokens_to_ids(" ")  # the tiny model writes "8+5+0=13 7+6+0=13 ...": a space early on
    model.generation_config = GenerationConfig(eos_token_id=[tokenizer.eos_token_id, space], repetition_penalty=3.0,
                                               no_repeat_ngram_size=2, do_sample=True, top_k=5, bos_token_id=1,
                                               pad_token_id=0)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model, tokenizer = common.load_model(str(tmp_path), "float32", "cpu")
    assert model.generation_config.repetition_penalty == 3.0  # the checkpoint carries the settings
    assert list(model.generation_config.eos_token_id) == [tokenizer.eos_token_id, space]
    torch.manual_seed(0)
    prompt = common.prompt_ids(tokenizer, "478+365")
    completions = infra.engine.HFGenerator(model, tokenizer).generate([prompt], 16, 48, 1.0, 1.0)
    stops = {tokenizer.eos_token_id, space}
    for completion in completions:  # stopped at the first of either id, which ends the response
        assert completion.finish_reason == "stop" and completion.token_ids[-1] in stops
        assert not stops & set(completion.token_ids[:-1])
    assert any(c.token_ids[-1] == space for c in completions)
    batch = common.sequence_batch([prompt] * 16, [c.token_ids for c in completions], tokenizer.pad_token_id)
    with torch.no_grad():
        trainer = common.response_logprobs(model, batch, 1.0)
    engine = common.engine_logprobs(completions, batch.response_width)
    assert (engine - trainer)[batch.response_mask].abs().max() < 1e-4


def test_old_logprobs_auto_reuses_only_the_hf_engines_own_numbers(tiny):
    # --old-logprobs auto takes the engine's log-probs only where they are the trainer's (test above: equal to 1e-4):
    # the HF engine on the policy object itself, float32, top-p 1. Forced choices are taken as given.
    model, tokenizer = tiny
    reuse, hf = infra.engine.reuse_engine_logprobs, infra.engine.HFGenerator(model, tokenizer)

    class VLLM:
        engine = "vllm"

    assert reuse("auto", hf, model, 1.0)
    assert not reuse("auto", hf, model, 0.95)  # the engine records the truncated (top-p) distribution
    assert not reuse("auto", VLLM(), model, 1.0)  # another engine's numbers: truncated IS needs both
    other, _ = common.load_model("tiny", "float32", "cpu")
    assert not reuse("auto", hf, other, 1.0)  # a copy (a sharded run's engine), not the policy itself
    other.compute_dtype = torch.bfloat16
    assert not reuse("auto", infra.engine.HFGenerator(other, tokenizer), other, 1.0)  # bf16: cache vs full forward
    assert not reuse("recompute", hf, model, 1.0)
    assert reuse("engine", VLLM(), model, 0.95)


def test_engine_logprobs_pads_with_zero():
    completions = [common.Completion(0, [4, 5], "", [-0.5, -1.5], "stop"),
                   common.Completion(0, [6], "", [-2.0], "length")]
    assert torch.equal(common.engine_logprobs(completions, 3), torch.tensor([[-0.5, -1.5, 0.0], [-2.0, 0.0, 0.0]]))


# ------------------------------------------------------------------------------------------------
# token_budget_chunks / micro_batches / batched
# ------------------------------------------------------------------------------------------------
def test_token_budget_chunks_hand_computed():
    # Longest first: 0 (5), 2 (4), 4 (3), 1 (2), 3 (1); budget 8 tokens = rows x longest. Each micro-batch costs
    # 512 tokens more: the fewest micro-batches win. 0 and 2 cannot share (2 x 5 = 10 > 8), nor 2, 4 and 1
    # (3 x 4 = 12), so three at least: [0], [2, 4] (2 x 4 = 8), [1, 3] (2 x 2 = 4) is the only such split.
    lengths = {0: 5, 1: 2, 2: 4, 3: 1, 4: 3}
    assert infra.packing.token_budget_chunks([0, 1, 2, 3, 4], lengths, 8) == [[0], [2, 4], [1, 3]]
    # without the cost per micro-batch, every row alone computes no padding: 15 tokens, the least
    assert infra.packing.token_budget_chunks([0, 1, 2, 3, 4], lengths, 8, overhead=0) == [[0], [2], [4], [1], [3]]


def test_token_budget_chunks_cut_where_padding_is_least():
    # Lengths 8, 5, 5, 4, 4, 4, budget 16, each micro-batch costing 2 tokens more. Filling each micro-batch in turn
    # gives [8, 5] (2 x 8 = 16), [5, 4, 4] (15), [4] (4): 35 tokens + 3 x 2 = 41. Cutting between unequal lengths,
    # [8], [5, 5], [4, 4, 4]: 8 + 10 + 12 = 30 tokens, no padding, + 3 x 2 = 36, the least.
    assert infra.packing.token_budget_chunks(list(range(6)), [8, 5, 5, 4, 4, 4], 16, overhead=2) == \
        [[0], [1, 2], [3, 4, 5]]


def test_token_budget_chunks_row_over_budget_goes_alone():
    assert infra.packing.token_budget_chunks([0, 1, 2], [10, 3, 3], 8) == [[0], [1, 2]]


def test_token_budget_chunks_prompt_response_pairs():
    # Pairs (prompt, response): the width is longest prompt + longest response. All three rows have 6 tokens; the
    # order is by response, longest first: 1 (1, 5), 2 (3, 3), 0 (5, 1). Budget 12: [1, 2] is 2 x (3 + 5) = 16 and
    # [2, 0] 2 x (5 + 3) = 16: each alone. Budget 16: [1, 2] + [0] and [1] + [2, 0] both compute 22 tokens in two
    # micro-batches; the first split found stays.
    lengths = [(5, 1), (1, 5), (3, 3)]
    assert infra.packing.token_budget_chunks([0, 1, 2], lengths, 12) == [[1], [2], [0]]
    assert infra.packing.token_budget_chunks([0, 1, 2], lengths, 16) == [[1, 2], [0]]


def test_token_budget_chunks_bound_the_selected_batch():
    rng = random.Random(0)
    prompts = [[7] * rng.randint(1, 9) for _ in range(40)]
    responses = [[8] * rng.randint(0, 30) for _ in range(40)]
    batch = common.sequence_batch(prompts, responses, pad_id=0)
    rows = list(range(3, 40))  # a subset, like a mini-batch
    for budget in (40, 64, 200):
        groups = infra.packing.token_budget_chunks(rows, batch.lengths(), budget)
        assert sorted(i for group in groups for i in group) == rows
        for group in groups:
            assert len(group) == 1 or batch.select(group).input_ids.numel() <= budget
        responses = [batch.lengths()[i][1] for group in groups for i in group]
        assert responses == sorted(responses, reverse=True)  # longest response first


def test_micro_batches_by_count_or_by_budget():
    assert common.micro_batches([4, 6, 5], None, 2) == [[4, 5], [6]]
    assert common.micro_batches([4, 5, 6], {4: 1, 5: 3, 6: 2}, 2, max_tokens=4) == [[5], [6, 4]]


def test_batched_same_values_with_a_token_budget(tiny):
    model, tokenizer = tiny
    rng = random.Random(1)
    prompts = [[rng.randint(4, 90) for _ in range(rng.randint(2, 8))] for _ in range(6)]
    responses = [[rng.randint(4, 90) for _ in range(rng.randint(1, 12))] for _ in range(6)]
    batch = common.sequence_batch(prompts, responses, tokenizer.pad_token_id)
    function = lambda micro: common.response_logprobs(model, micro)  # noqa: E731
    by_count = common.batched(function, batch, micro_batch_size=2)
    by_budget = common.batched(function, batch, micro_batch_size=2, max_tokens=30)
    mask = batch.response_mask  # values past each response's end are undefined (pad-token log-probs or 0)
    assert torch.allclose(by_count[mask], by_budget[mask], atol=1e-5)
    assert torch.allclose(by_budget[mask], common.response_logprobs(model, batch)[mask].detach(), atol=1e-5)
