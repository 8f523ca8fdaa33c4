"""One GPU as a first-class target (issue 46): docs/usage.md's one-GPU commands for Qwen3-4B-Base, each checked with
`--plan-only --gpu-memory-gib 80 --gpus 1` against the figures the docs print, and (issue 57) against a 128 GiB host;
--plan-only's exit codes, loading nothing; refusals that never suggest more GPUs than --gpus (torchrun: its world);
--hf-batch-size reaching the engine; the README's SmolLM2 command planned from its own prompts within 8 GiB (issue
47)."""
import contextlib
import importlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

import infra.cli
import infra.memory as memory
import infra.run
from infra.memory import GIB

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN3_4B_CONFIG = os.path.join(REPO, "tests", "fixtures", "qwen3_4b_config.json")
QWEN3_CONFIGS = {"Qwen3-4B-Base": QWEN3_4B_CONFIG,  # the one-GPU recipe's policy and critics (published shapes)
                 "Qwen3-1.7B-Base": os.path.join(REPO, "tests", "fixtures", "qwen3_1_7b_config.json")}
HOST_128 = 110 * GIB  # what the one-GPU recipe may plan on a 128 GiB host: MemAvailable is less than the total (the
# kernel, the page cache), and loading reads a model whole in float32 before sharding it

@pytest.fixture
def qwen3_4b_offline(monkeypatch, tmp_path):
    """Qwen/Qwen3-4B-Base and Qwen/Qwen3-1.7B-Base in a Hugging Face cache of its own holding config.json alone
    (tests/fixtures: the published shapes), the hub offline: `--model Qwen3-4B-Base` plans without a network, and
    loading anything else (weights, tokenizer files) would fail."""
    import huggingface_hub.constants
    cache = tmp_path / "hub"
    for name, config in QWEN3_CONFIGS.items():
        snapshot = cache / f"models--Qwen--{name}" / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True)
        shutil.copy(config, snapshot / "config.json")
        (cache / f"models--Qwen--{name}" / "refs").mkdir()
        (cache / f"models--Qwen--{name}" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    infra.hub.check_model_source.cache_clear()
    yield cache
    infra.hub.check_model_source.cache_clear()


def plan_only(argv, *extra):
    """(exit code, printed lines) of `python <trainer>.py <flags> --plan-only <extra>` run in this process."""
    trainer = argv[0]
    module = importlib.import_module(trainer[:-3])
    args = infra.cli.parse_args(module.Args, getattr(module, "TINY_PRESET", None), [*argv[1:], "--plan-only", *extra])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.raises(SystemExit) as done:
        infra.run.Run(args, os.path.join(REPO, trainer))
    return done.value.code, printed.getvalue().splitlines()


def one_gpu_section():
    text = open(os.path.join(REPO, "docs", "usage.md")).read()
    return text.split("## One GPU", 1)[1].split("\n## ", 1)[0]


def one_gpu_commands():
    """[(argv without `python`, 'vllm' or 'hf')] of docs/usage.md's one-GPU block, its variables ($ONE_GPU,
    $CRITIC) expanded."""
    block = one_gpu_section().split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", "")
    variables = {f"${name}": shlex.split(value) for name, value in re.findall(r'^(\w+)="([^"]*)"', block, re.M)}
    commands = []
    for line in block.splitlines():
        if line.startswith("python "):
            argv = shlex.split(line.split("#")[0])[1:]
            argv = [token for item in argv for token in variables.get(item, [item])]
            commands.append((argv, "hf" if "hf" in argv else "vllm"))
    return commands


def test_the_docs_one_gpu_commands_fit_one_80_gb_gpu(qwen3_4b_offline, monkeypatch):
    """Each of the 14 commands (7 methods, vLLM and the HF engine) exits 0 with --plan-only on one 80 GiB GPU, its
    GPU peak within what CUDA reports for an "80 GB" H100 and its host memory within what a 128 GiB host leaves
    (HOST_128: the critic methods with a Qwen3-1.7B critic), and the docs' table holds the plan's figures."""
    commands = one_gpu_commands()
    assert sorted({argv[0] for argv, _ in commands}) == ["grpo.py", "ppo.py", "sp3o.py", "spo.py", "sppo.py",
                                                         "tppo.py", "vapo.py"] and len(commands) == 14
    table = {}
    for row in one_gpu_section().splitlines():
        cells = [cell.strip(" `") for cell in row.strip("|").split("|")]
        if len(cells) == 6 and cells[0].endswith(".py"):
            table[cells[0]] = cells[2:]
    for argv, engine in commands:
        code, lines = plan_only(argv, "--gpu-memory-gib", "80", "--gpus", "1")
        assert code == 0, (argv, lines[-1])
        fits = re.fullmatch(r"fits: ([\d.]+) GiB per GPU of 80\.0, host memory ([\d.]+) GiB per process", lines[-1])
        assert fits, lines[-1]
        gpu, host = map(float, fits.groups())
        assert gpu <= memory.CUDA_80GB_GIB and host <= HOST_128 / GIB, (argv, gpu, host)
        assert "prompts: 1,024 tokens (assumed: the data was not read)" in "\n".join(lines)  # --plan-only reads no data
        column = 0 if engine == "vllm" else 2
        assert table[argv[0]][column:column + 2] == [f"{gpu:.1f}", f"{host:.1f}"], (argv, engine)


def test_a_policy_size_critic_needs_more_than_a_128_gib_host(qwen3_4b_offline):
    """SP3O with its own Qwen3-4B critic, offloaded: 16 bytes x 8,044,938,753 trained parameters (119.9 GiB), AdamW's
    for-loop temporaries (two float32 copies of the [151,936 x 2,560] embedding: 2.9 GiB), vLLM's pools while it
    sleeps (2 GiB) and the process (2 GiB): 126.8 GiB, more than a 128 GiB host leaves; pinned by FSDP2 itself (its
    caching host allocator's power-of-two blocks) the float32 weights and gradients alone would take 84.5 GiB, not
    59.9. With a Qwen3-1.7B critic: 92.5 GiB."""
    own = ["sp3o.py", "--model", "Qwen3-4B-Base", "--offload-optimizer", "--max-response-tokens", "4096"]
    for argv, expected in ((own, 126.8), (own + ["--critic-model", "Qwen3-1.7B-Base"], 92.5)):
        code, lines = plan_only(argv, "--gpu-memory-gib", "80", "--gpus", "1")
        host = float(re.search(r"host memory ([\d.]+) GiB per process", lines[-1]).group(1))
        assert code == 0 and host == expected and (host <= HOST_128 / GIB) == (expected < 100), lines[-1]
    both = 4_022_468_096 + 4_022_470_657
    assert (16 * both + 8 * 151936 * 2560) / GIB + 4 == pytest.approx(126.8, abs=0.05)


def test_the_one_gpu_commands_need_their_changes(qwen3_4b_offline, monkeypatch):
    """Without --offload-optimizer or with the papers' 8,192-token responses SP3O does not fit one GPU, and the
    refusal names the documented flags; the HF engine at its default batch of 256 does not either."""
    base = ["sp3o.py", "--model", "Qwen3-4B-Base", "--gpu-memory-gib", "80", "--gpus", "1"]
    code, lines = plan_only(base)  # shorter responses in training and evaluation alike (issue 60)
    assert code == 1 and lines[-1].endswith("it fits with --offload-optimizer --max-response-tokens 4096 "
                                            "--eval-max-tokens 4096")
    code, lines = plan_only(base + ["--offload-optimizer"])
    assert code == 1 and "fewer than 1/8 of this rank's rollout of 512 (64)" in lines[-1]
    code, lines = plan_only(base + ["--offload-optimizer", "--max-response-tokens", "4096", "--eval-max-tokens", "4096",
                                    "--generator", "hf"])
    assert code == 1 and "it fits with --hf-batch-size 64, or with --generator vllm" in lines[-1]


def test_plan_only_exit_codes_and_nothing_loaded(tmp_path):
    """--plan-only from the command line: 0 when the plan fits, 1 when not (its last line the refusal, naming flags
    that fit), for a model folder holding config.json alone (no weights, no tokenizer: nothing else can load);
    no run folder."""
    config = tmp_path / "qwen3-4b"
    config.mkdir()
    shutil.copy(QWEN3_4B_CONFIG, config / "config.json")

    def run(*flags):
        return subprocess.run([sys.executable, "grpo.py", "--model", str(config), "--plan-only", "--gpu-memory-gib",
                               "80", "--gpus", "1", "--output-dir", str(tmp_path / "runs"), *flags], cwd=REPO,
                              capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    refused, fits = run(), run("--offload-optimizer", "--max-response-tokens", "4096")
    assert refused.returncode == 1 and fits.returncode == 0, (refused.stderr[-2000:], fits.stderr[-2000:])
    assert refused.stdout.splitlines()[-1].startswith("the memory plan needs ")
    assert "it fits with --offload-optimizer --max-response-tokens 4096" in refused.stdout.splitlines()[-1]
    assert fits.stdout.splitlines()[-1].startswith("fits: ") and "memory plan per GPU, grpo.py" in fits.stdout
    assert not os.path.exists(tmp_path / "runs") and "rollouts stop at" not in fits.stdout


@pytest.mark.parametrize("gpus", [1, 2, 4])
def test_a_refusal_never_suggests_more_gpus_than_the_machine_has(gpus, qwen3_4b_offline, monkeypatch):
    """SP3O on Qwen3-4B-Base and an 80 GiB GPU at its defaults: the flags offered never run more processes than
    --gpus; under torchrun the world size rules (--gpus 8 is not believed: no more ranks than the world)."""
    code, lines = plan_only(["sp3o.py", "--model", "Qwen3-4B-Base", "--gpu-memory-gib", "80"], "--gpus",
                            str(gpus))
    offered = [int(n) for n in re.findall(r"--nproc-per-node (\d+)", lines[-1])]
    assert code == 1 and "it fits with" in lines[-1] and all(n <= gpus for n in offered), lines[-1]
    assert bool(offered) == (gpus > 1)  # 2 GPUs: torchrun --nproc-per-node 2 with offload is offered
    if gpus == 1:
        return
    monkeypatch.setenv("WORLD_SIZE", str(gpus))
    monkeypatch.setattr(infra.dist, "init_device", lambda device="", cpu_offload=False: "cpu")  # no process group
    code, lines = plan_only(["sp3o.py", "--model", "Qwen3-4B-Base", "--gpu-memory-gib", "80", "--prompts-per-step",
                             "64"], "--gpus", "8")
    header = next(line for line in lines if line.startswith("memory plan per"))
    assert f"{gpus} process{'es' * (gpus > 1)} ({gpus} GPU" in header and "--nproc-per-node" not in lines[-1]


def test_the_hf_batch_flag_reaches_the_engine(tmp_path, tiny_path):
    """--hf-batch-size: the HF engine a run builds generates that many sequences a call."""
    import common
    import grpo
    args = infra.cli.parse_args(grpo.Args, grpo.TINY_PRESET, ["--hf-batch-size", "24", "--output-dir", str(tmp_path)])
    run = infra.run.Run(args, os.path.join(REPO, "grpo.py"))
    model, tokenizer = common.load_model(tiny_path, "float32", "cpu")
    try:
        generator = run.start({"policy": model}, [], tokenizer)
        assert generator.engine == "hf" and generator.batch_size == 24
    finally:
        run.close()


def readme_smollm2_command():
    """The README's SmolLM2-135M-Instruct command, as argv after `python` (in a code block, or inline in backticks)."""
    text = open(os.path.join(REPO, "README.md")).read().replace("\\\n", "")
    line = next(line for line in text.splitlines() if "python grpo.py --model smollm2-135m-instruct" in line)
    return shlex.split(line.split("python ", 1)[1].split("`")[0].split("#")[0])


def test_the_readme_smollm2_command_plans_its_own_prompts_within_8_gib(monkeypatch):
    """Issue 47: planned from the run's longest prompt (129 tokens of builtin:words through SmolLM2's chat template)
    instead of the 1,024-token allowance, the README's command fits a machine with 8 GiB available; with the
    allowance its HF engine's cache (128 sequences of 1,024 + 64 tokens in float32, 6.1 GiB) made it 9.0 GiB."""
    try:
        infra.hub.resolve_model_name("smollm2-135m-instruct")
    except infra.UserError as error:
        pytest.skip(str(error))
    monkeypatch.setattr(memory, "host_memory", lambda: (8 * GIB, 24 * GIB))
    code, lines = plan_only(readme_smollm2_command())
    assert code == 0, lines[-1]
    total = float(re.fullmatch(r"fits: ([\d.]+) GiB per process, host memory ([\d.]+) GiB per process",
                               lines[-1]).group(2))
    assert "prompts: 129 tokens (the run's longest, tokenized)" in "\n".join(lines) and total <= 8
    allowance = plan_only_setup(readme_smollm2_command(), memory.PROMPT_TOKENS)
    assert memory.host_need(allowance, True, 1) > 8 * GIB  # the plan before: refused at 8 GiB


def plan_only_setup(argv, prompt_tokens):
    module = importlib.import_module(argv[0][:-3])
    args = infra.cli.parse_args(module.Args, None, argv[1:])
    return memory.setup_for(args, "cpu", 0, prompt_tokens, 64)[0]


def test_offline_the_missing_data_and_the_plan_are_refused_together(qwen3_4b_offline, monkeypatch, capsys, tmp_path):
    """Issue 60: offline, `python sp3o.py --model Qwen3-4B-Base` named only the missing data; the memory refusal
    came on the second try. Both now come in one line, before any model loads, the plan's flags the recipe's."""
    import common
    import sp3o
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(infra.hub, "hub_unreachable", lambda: "ConnectError: no network in this test")
    monkeypatch.setattr(common, "load_model", lambda *args, **kwargs: pytest.fail("a model was loaded"))
    monkeypatch.setattr(sys, "argv", ["sp3o.py", "--model", "Qwen3-4B-Base", "--gpu-memory-gib", "80", "--gpus", "1",
                                      "--output-dir", str(tmp_path / "runs")])
    with pytest.raises(SystemExit) as exit_code:
        infra.run.run_main(sp3o.main)
    error = capsys.readouterr().err
    assert exit_code.value.code == 2 and error.count("\n") == 1, error
    data, plan = error.split("; also, ")
    assert data.startswith("sp3o.py: error: --dataset and --eval-datasets: zhuzilin/dapo-math-17k, ") and \
        "are not in the Hugging Face cache" in data
    assert plan.startswith("the memory plan needs ") and plan.endswith(
        "it fits with --offload-optimizer --max-response-tokens 4096 --eval-max-tokens 4096\n")
    assert not os.path.exists(tmp_path / "runs")
