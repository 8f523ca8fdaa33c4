"""The rollout engine choice (--generator auto|hf|vllm) and the vLLM backend (infra.vllm_engine.VLLMGenerator).

Three layers: the choice itself (runs anywhere); VLLMGenerator's own logic against a stand-in `vllm` module that
records the calls (runs anywhere; it checks our glue code, not vLLM); and the real engine, which runs only where
vLLM (requirements-vllm.txt) and a CUDA GPU are both present and is skipped otherwise, with the reason.
"""
import importlib.util
import os
import sys
import types
from dataclasses import dataclass

import pytest
import torch

import common
import infra.engine
import infra.tiny
import infra.vllm_engine


def _vllm_missing():
    missing = []
    if importlib.util.find_spec("vllm") is None:
        missing.append("vllm is not installed (pip install -r requirements-vllm.txt)")
    if not torch.cuda.is_available():
        missing.append("no CUDA GPU")
    return "; ".join(missing)


VLLM_MISSING = _vllm_missing()
needs_vllm = pytest.mark.skipif(bool(VLLM_MISSING),
                                reason=f"the vLLM backend needs vllm and a CUDA GPU: {VLLM_MISSING}")


@pytest.fixture(scope="module")
def tiny_cpu():
    return common.load_model("tiny", "float32", "cpu")


# ------------------------------------------------------------------------------------------------
# Choosing the engine
# ------------------------------------------------------------------------------------------------
def test_auto_falls_back_to_hf_without_vllm_or_cuda(tiny_cpu):
    model, tokenizer = tiny_cpu
    generator = infra.engine.make_generator("auto", model, tokenizer)
    assert isinstance(generator, infra.engine.HFGenerator) and generator.engine == "hf"
    generator.sleep()  # no-ops: HF generate runs on the trainer's model
    generator.wake_up()
    with pytest.raises(infra.UserError, match="--generator vllm"):
        infra.engine.make_generator("vllm", model, tokenizer)


# ------------------------------------------------------------------------------------------------
# VLLMGenerator's glue, against a stand-in `vllm` module (the 0.22.1 names: LLM, SamplingParams, TokensPrompt)
# ------------------------------------------------------------------------------------------------
@dataclass
class FakeLogprob:
    logprob: float


class FakeLLM:
    """Records calls. generate: for each prompt, n samples [last prompt token + j + 1, EOS], log-probs -0.25 and
    -0.5 (position-wise dicts holding the sampled token, as logprobs=0 returns), finish_reason "stop"."""

    def __init__(self, model, **kwargs):
        self.kwargs, self.calls = dict(model=model, **kwargs), []
        self.engine_model = types.SimpleNamespace(loaded=None)
        self.engine_model.load_weights = lambda weights: setattr(self.engine_model, "loaded", dict(weights))

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append(("generate", len(prompts), params.n))
        eos = params.stop_token_ids[0]
        outputs = []
        for prompt in prompts:
            samples = []
            for j in range(params.n):
                tokens = [prompt["prompt_token_ids"][-1] + j + 1, eos]
                logprobs = [{tokens[0]: FakeLogprob(-0.25)}, {eos: FakeLogprob(-0.5)}]
                samples.append(types.SimpleNamespace(token_ids=tokens, finish_reason="stop", logprobs=logprobs))
            outputs.append(types.SimpleNamespace(outputs=samples))
        return outputs

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))

    def apply_model(self, func):
        self.calls.append(("apply_model",))
        return [func(self.engine_model)]

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


class FakeSamplingParams:
    def __init__(self, n=1, temperature=1.0, top_p=1.0, max_tokens=16, logprobs=None, stop_token_ids=None):
        if n > 1 and temperature == 0:
            raise ValueError("n must be 1 when using greedy sampling")  # as vLLM's SamplingParams
        self.n, self.temperature, self.top_p, self.max_tokens = n, temperature, top_p, max_tokens
        self.logprobs, self.stop_token_ids = logprobs, stop_token_ids


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams, module.TokensPrompt = FakeLLM, FakeSamplingParams, dict
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # restored after the test
    return module


def test_vllm_generator_engine_arguments(fake_vllm, tiny_cpu):
    model, tokenizer = tiny_cpu
    generator = infra.vllm_engine.VLLMGenerator(model, tokenizer, gpu_memory_utilization=0.3, seed=5)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # engine core in this process
    assert generator.llm.kwargs == dict(model=model.name_or_path, tokenizer=model.name_or_path, dtype="float32",
                                        seed=5, gpu_memory_utilization=0.3, enable_sleep_mode=True,
                                        enable_prefix_caching=True, logprobs_mode="processed_logprobs")


def test_vllm_generator_completions(fake_vllm, tiny_cpu):
    model, tokenizer = tiny_cpu
    generator = infra.vllm_engine.VLLMGenerator(model, tokenizer)
    eos = tokenizer.eos_token_id
    completions = generator.generate([[40, 41], [50]], n=2, max_tokens=8, temperature=1.0)
    assert generator.llm.calls == [("generate", 2, 2)]
    assert [(c.prompt_index, c.token_ids, c.logprobs, c.finish_reason) for c in completions] == [
        (0, [42, eos], [-0.25, -0.5], "stop"), (0, [43, eos], [-0.25, -0.5], "stop"),
        (1, [51, eos], [-0.25, -0.5], "stop"), (1, [52, eos], [-0.25, -0.5], "stop")]
    assert completions[0].text == tokenizer.decode([42])  # EOS dropped from the text, kept in token_ids
    # Greedy with n = 2: each prompt sent twice with n = 1 (vLLM refuses n > 1 when greedy), grouped by prompt.
    greedy = generator.generate([[40, 41], [50]], n=2, max_tokens=8, temperature=0.0)
    assert generator.llm.calls[-1] == ("generate", 4, 1)
    assert [c.prompt_index for c in greedy] == [0, 0, 1, 1]


def test_vllm_generator_sleep_and_weight_sync_order(fake_vllm, tiny_cpu):
    model, tokenizer = tiny_cpu
    generator = infra.vllm_engine.VLLMGenerator(model, tokenizer)
    generator.sleep()
    generator.sleep()  # already asleep: no second call
    generator.sync_weights(model)
    assert generator.llm.calls == [("sleep", 1), ("wake_up", ("weights",)), ("apply_model",),
                                   ("wake_up", ("kv_cache",)), ("reset_prefix_cache",)]
    loaded = generator.llm.engine_model.loaded
    assert loaded.keys() == model.state_dict().keys()  # HF names, as vLLM's load_weights expects
    assert all(loaded[name].data_ptr() == tensor.data_ptr() for name, tensor in model.state_dict().items())  # no copies
    generator.llm.calls.clear()
    generator.sync_weights(model)  # awake: no wake-up calls
    generator.sleep()
    generator.generate([[40]], n=1, max_tokens=4)  # generating wakes everything first
    assert generator.llm.calls == [("apply_model",), ("reset_prefix_cache",), ("sleep", 1),
                                   ("wake_up", ("weights", "kv_cache")), ("generate", 1, 1)]


# ------------------------------------------------------------------------------------------------
# The real engine (vllm + CUDA only)
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    model, tokenizer = common.load_model("tiny", "float32", "cuda")
    generator = infra.engine.make_generator("vllm", model, tokenizer, gpu_memory_utilization=0.2)
    return model, tokenizer, generator


def _trainer_logprobs(model, tokenizer, prompts, completions, temperature):
    batch = common.sequence_batch([prompts[c.prompt_index] for c in completions], [c.token_ids for c in completions],
                                  tokenizer.pad_token_id).to("cuda")
    with torch.no_grad():
        trainer = common.response_logprobs(model, batch, temperature)
    return trainer, common.engine_logprobs(completions, batch.response_width).to("cuda"), batch.response_mask


@needs_vllm
def test_vllm_logprobs_match_the_trainer(engine):
    model, tokenizer, generator = engine
    assert generator.engine == "vllm"
    prompts = [common.prompt_ids(tokenizer, row["question"]) for row in infra.tiny.builtin_rows("test", 8, 0)]
    for temperature in (1.0, 0.7):
        completions = generator.generate(prompts, 4, 48, temperature, 1.0)
        assert len(completions) == 32 and [c.prompt_index for c in completions] == [i // 4 for i in range(32)]
        assert all(c.token_ids[-1] == tokenizer.eos_token_id for c in completions if c.finish_reason == "stop")
        trainer, engine_logprobs, mask = _trainer_logprobs(model, tokenizer, prompts, completions, temperature)
        gap = (engine_logprobs - trainer)[mask].abs()
        assert gap.mean() < 1e-2 and gap.max() < 0.1, f"engine/trainer log-prob gap: mean {gap.mean()}, max {gap.max()}"


@needs_vllm
def test_vllm_weight_sync_changes_outputs(engine):
    model, tokenizer, generator = engine
    prompts = [common.prompt_ids(tokenizer, row["question"]) for row in infra.tiny.builtin_rows("test", 8, 0)]
    before = [c.token_ids for c in generator.generate(prompts, 1, 48, 0.0)]
    norm = model.model.norm.weight
    try:
        with torch.no_grad():
            norm.mul_(-1)  # flips every logit: the greedy token becomes the least likely one
        generator.sleep()
        generator.sync_weights(model)
        after = generator.generate(prompts, 1, 48, 0.0)
        assert [c.token_ids for c in after] != before
        trainer, engine_logprobs, mask = _trainer_logprobs(model, tokenizer, prompts, after, 1.0)
        assert (engine_logprobs - trainer)[mask].abs().max() < 0.1  # the engine now runs the trainer's new weights
    finally:
        with torch.no_grad():
            norm.mul_(-1)
        generator.sync_weights(model)
    assert [c.token_ids for c in generator.generate(prompts, 1, 48, 0.0)] == before
