"""Where a --model comes from, checked in seconds before anything loads: a local folder, the local Hugging Face
cache, or the hub when it can be reached (offline, a name that is not in the cache fails at once, in one line,
instead of retrying the network for a minute and printing a traceback).
"""
import functools
import os

from infra import UserError

PROBE_TIMEOUT_S = 5  # one request to the hub's endpoint, only for a hub name that is not in the local cache


@functools.lru_cache(maxsize=None)
def check_model_source(name):
    """Raise UserError (one line) when --model `name` cannot load here: a local path that is not a model folder,
    or a hub name that is neither in the local cache nor downloadable (HF_HUB_OFFLINE=1, or the hub unreachable)."""
    from common import resolve_model_name  # `tiny` is built, a bare Qwen name gets its org
    if name == "tiny":
        return
    path = resolve_model_name(name)
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise UserError(f"--model {name!r}: the folder {path} holds no config.json (give a model folder, e.g. "
                            "runs/<run>/checkpoints/step_<n>/policy, or a hub name)")
        return
    if os.path.exists(path):
        raise UserError(f"--model {name!r}: {path} is a file; give a model folder or a hub name")
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    try:
        validate_repo_id(path)
    except HFValidationError:  # runs/x/policy, ./model, /abs/path: meant as a local folder
        raise UserError(f"--model {name!r}: no such folder (and not a hub name of the form org/name)") from None
    if isinstance(try_to_load_from_cache(path, "config.json"), str):
        return
    if constants.HF_HUB_OFFLINE:
        raise UserError(f"--model {name!r}: no such local folder, and not in the local Hugging Face cache "
                        f"({constants.HF_HUB_CACHE}) while HF_HUB_OFFLINE=1 forbids downloading it")
    problem = _unreachable(constants.ENDPOINT)
    if problem:
        raise UserError(f"--model {name!r}: no such local folder, not in the local Hugging Face cache "
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
