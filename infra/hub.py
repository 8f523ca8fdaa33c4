"""Where a --model comes from, checked in seconds before anything loads: a local folder, the local Hugging Face
cache, or the hub when it can be reached (offline, a name that is not in the cache fails at once, in one line,
instead of retrying the network for a minute and printing a traceback); `tiny` is the built-in model's folder,
`smollm2-135m-instruct` a real one converted from a pip package (infra/gguf_model.py).
"""
import functools
import os
import subprocess
import sys

from infra import UserError, gguf_model

PROBE_TIMEOUT_S = 5  # one request to the hub's endpoint, only for a hub name that is not in the local cache
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_SHIPPED = os.path.join(ROOT, "models", "tiny")
CACHE_DIR = os.path.expanduser(os.environ.get("RL_REASONING_CACHE", "~/.cache/rl-reasoning"))
TINY_MODEL_VERSION = "tiny-v4"  # the cache's name for a model built here when models/tiny/ is absent


def resolve_model_name(name, flag="--model"):
    """`tiny` -> the built-in checkpoint (models/tiny/); `smollm2-135m-instruct` -> its folder converted from the
    pip package's GGUF file (infra.gguf_model); a bare `Qwen3-4B-Base` -> `Qwen/Qwen3-4B-Base`; local paths and
    `org/name` hub ids pass through."""
    if name == "tiny":
        return tiny_model_path()
    if gguf_model.is_packaged_model(name) and not os.path.exists(name):  # smollm2-135m-instruct
        return gguf_model.packaged_model_path(name, CACHE_DIR)
    if os.path.exists(name) or "/" in name:
        return name
    if name.lower().startswith(("qwen", "qwq")):
        return f"Qwen/{name}"
    raise UserError(f"{flag} {name!r} is neither a local path nor a hub id (org/name); "
                    "use e.g. Qwen3-4B-Base, Qwen/Qwen3-4B-Base, ./my_checkpoint, smollm2-135m-instruct or tiny")


def tiny_model_path():
    """models/tiny/, the shipped model; in a copy of the code without it, one built here once and cached (by
    infra.tiny.build_tiny_model in a child process: infra.tiny sits above common.py, this module below it)."""
    if os.path.exists(os.path.join(TINY_SHIPPED, "config.json")):
        return TINY_SHIPPED
    path = os.path.join(CACHE_DIR, TINY_MODEL_VERSION)
    if not os.path.exists(os.path.join(path, "config.json")):
        build = "import sys, infra.tiny; infra.tiny.build_tiny_model(sys.argv[1])"
        if subprocess.run([sys.executable, "-c", build, path], cwd=ROOT).returncode:
            raise UserError(f"building the tiny model into {path} failed or was interrupted (nothing was kept)")
    return path


@functools.lru_cache(maxsize=None)
def check_model_source(name, flag="--model"):
    """Raise UserError (one line) when --model `name` cannot load here: a local path that is not a model folder,
    or a hub name that is neither in the local cache nor downloadable (HF_HUB_OFFLINE=1, or the hub unreachable)."""
    if name == "tiny":
        return
    path = resolve_model_name(name, flag)
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise UserError(f"{flag} {name!r}: the folder {path} holds no config.json (give a model folder, e.g. "
                            "runs/<run>/checkpoints/step_<n>/policy, or a hub name)")
        return
    if os.path.exists(path):
        raise UserError(f"{flag} {name!r}: {path} is a file; give a model folder or a hub name")
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    try:
        validate_repo_id(path)
    except HFValidationError:  # runs/x/policy, ./model, /abs/path: meant as a local folder
        raise UserError(f"{flag} {name!r}: no such folder (and not a hub name of the form org/name)") from None
    if isinstance(try_to_load_from_cache(path, "config.json"), str):
        return
    if constants.HF_HUB_OFFLINE:
        raise UserError(f"{flag} {name!r}: no such local folder, and not in the local Hugging Face cache "
                        f"({constants.HF_HUB_CACHE}) while HF_HUB_OFFLINE=1 forbids downloading it")
    problem = _unreachable(constants.ENDPOINT)
    if problem:
        raise UserError(f"{flag} {name!r}: no such local folder, not in the local Hugging Face cache "
                        f"({constants.HF_HUB_CACHE}), and the hub {constants.ENDPOINT} cannot be reached ({problem})")


def _unreachable(endpoint):
    """Why the hub cannot be reached (None when it answers at all), through the hub client's own session (its proxy
    settings included), within PROBE_TIMEOUT_S."""
    from huggingface_hub import get_session
    try:
        get_session().head(endpoint, timeout=PROBE_TIMEOUT_S)
    except Exception as error:  # no DNS, no route, refused, timed out
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else 'no answer'}"
    return None


def config_folder(name, flag="--model"):
    """A folder holding --model `name`'s config.json, for the memory plan before any weights load: the local folder,
    or the hub model's snapshot in the local Hugging Face cache, its config.json alone downloaded first when it is
    not there yet (hf_hub_download; the weights come when the model loads). A name that cannot be had fails in
    check_model_source's one line (offline without a cache too)."""
    check_model_source(name, flag)
    path = resolve_model_name(name, flag)
    if os.path.isdir(path):
        return path
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    cached = try_to_load_from_cache(path, "config.json")
    try:
        return os.path.dirname(cached if isinstance(cached, str) else hf_hub_download(path, "config.json"))
    except Exception as error:  # a network error, a gated or missing repository
        raise UserError(f"{flag} {name!r}: its config.json could not be fetched for the memory plan "
                        f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else 'no answer'})")
