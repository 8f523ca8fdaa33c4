"""Where a --model or a hub dataset comes from, checked in seconds before anything loads: a local folder, the local
Hugging Face cache, or the hub when it can be reached (offline, a name that is not in the cache fails at once, in one
line, instead of retrying the network for a minute and printing a traceback); `tiny` is the built-in model's folder,
`smollm2-135m-instruct` a real one converted from a pip package (infra/gguf_model.py). Hub datasets (`org/name`, or
`org/name:config`) load through Hugging Face `datasets`; `python -m infra.hub --dataset ID --eval-datasets ID ...`
writes them as the local files a trainer takes, for a machine without the hub.
"""
import functools
import glob
import os
import re
import subprocess
import sys

from infra import UserError, gguf_model

PROBE_TIMEOUT_S = 5  # one request to the hub's endpoint, only for a hub name that is not in the local cache
FILE_EXTENSIONS = (".jsonl", ".json", ".parquet", ".csv", ".tsv", ".txt", ".arrow", ".gz", ".zst", ".xz", ".zip")
HUB_DATASET = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?")  # org/name, or org/name:config (openai/gsm8k:main)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_SHIPPED = os.path.join(ROOT, "models", "tiny")
CACHE_DIR = os.path.expanduser(os.environ.get("RL_REASONING_CACHE", "~/.cache/rl-reasoning"))
TINY_MODEL_VERSION = "tiny-v4"  # the cache's name for a model built here when models/tiny/ is absent


def resolve_model_name(name, flag="--model"):
    """`tiny` -> the built-in checkpoint (models/tiny/), `horizon` -> models/horizon/; `smollm2-135m-instruct` -> its
    folder converted from the pip package's GGUF file (infra.gguf_model); a bare `Qwen3-4B-Base` ->
    `Qwen/Qwen3-4B-Base`; local paths and `org/name` hub ids pass through."""
    if name == "tiny":
        return tiny_model_path()
    if name == "horizon":  # the horizon task's model (infra.horizon), shipped only
        return os.path.join(ROOT, "models", "horizon")
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


def looks_like_path(spec):
    """Whether a --dataset / --eval-datasets value names a file, never a hub id: a file extension (data/train.jsonl)
    or a leading ./, ../, / or ~."""
    return spec.lower().endswith(FILE_EXTENSIONS) or spec.startswith(("./", "../", "/", "~"))


def is_hub_dataset(spec):
    """Whether a --dataset / --eval-datasets value is a hub dataset id: `org/name` or `org/name:config`, not a path."""
    return HUB_DATASET.fullmatch(spec) is not None and not os.path.exists(spec) and not looks_like_path(spec)


def no_such_file(spec):
    """Why `spec`, neither a file nor a hub id, was not found: `no such file (no folder data/ in /home/me)`."""
    folder = os.path.dirname(spec)
    where = f"not in {os.path.abspath(folder or '.')}" if not folder or os.path.isdir(folder) else \
        f"no folder {folder}/" + f" in {os.getcwd()}" * (not os.path.isabs(folder))
    return f"no such file ({where}{'' if looks_like_path(spec) else '; nor a hub id: org/name, org/name:config'})"


@functools.lru_cache(maxsize=None)
def hub_unreachable():
    """Why hub datasets cannot be downloaded here (HF_HUB_OFFLINE=1, or the hub does not answer within
    PROBE_TIMEOUT_S), None when they can; asked once per process."""
    import datasets
    from huggingface_hub import constants
    return "HF_HUB_OFFLINE=1" if datasets.config.HF_HUB_OFFLINE else _unreachable(constants.ENDPOINT)


def cached_dataset(spec):
    """Whether hub dataset `spec` is in the local `datasets` cache, where `datasets` finds it offline
    (datasets.load.CachedDatasetModuleFactory: <HF_DATASETS_CACHE>/<org>___<name>/<config>/<version>/<hash>/)."""
    import datasets
    from datasets.naming import camelcase_to_snakecase
    (org, name), config = spec.partition(":")[0].split("/"), spec.partition(":")[2]
    root = os.path.join(os.path.expanduser(str(datasets.config.HF_DATASETS_CACHE)),
                        f"{org}___{camelcase_to_snakecase(name)}")
    return any(os.path.isdir(path) for path in glob.glob(os.path.join(root, config or "*", "*", "*")))


def dataset_file(spec, flag):
    """The local file `python -m infra.hub` writes for hub dataset `spec`: <name>/train.jsonl for --dataset,
    <name>/test.jsonl (the split a held-out set is read from) for --eval-datasets."""
    return f"{spec.partition(':')[0].split('/')[1]}/{'train' if flag == '--dataset' else 'test'}.jsonl"


def check_dataset_sources(dataset, eval_datasets, keep=()):
    """Raise UserError, in one line, when hub ids among --dataset and --eval-datasets are neither in the local cache
    nor downloadable here: naming them, the command that writes them as local files where the hub can be reached,
    and the flags that take those files (`keep`: flags that must come with another --dataset, e.g. the method's
    --answer-format; the held-out sets are then given again, since another --dataset drops the method's own)."""
    wanted = [("--dataset", dataset)] + [("--eval-datasets", part.strip()) for item in eval_datasets
                                         for part in item.split(",") if part.strip()]
    try:
        missing = {spec: flag for flag, spec in wanted if is_hub_dataset(spec) and not cached_dataset(spec)}
    except ImportError:  # no `datasets`: data.load_rows names the install
        return
    problem = hub_unreachable() if missing else None
    if not problem:
        return
    import datasets
    files = {spec: dataset_file(spec, flag) for spec, flag in missing.items()}
    flags = list(dict.fromkeys(missing.values()))
    command = " ".join(f"{flag} {' '.join(spec for spec in missing if missing[spec] == flag)}" for flag in flags)
    instead = ([f"--dataset {files[dataset]}", *keep] if dataset in missing else []) + [
        "--eval-datasets " + " ".join(files.get(spec, spec) for flag, spec in wanted[1:])] * (len(wanted) > 1)
    them = "it" if len(missing) == 1 else "them"
    raise UserError(f"{' and '.join(flags)}: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not in the "
                    f"Hugging Face cache ({datasets.config.HF_DATASETS_CACHE}) and the hub cannot be reached "
                    f"({problem}); download {them} where it can (`python -m infra.hub {command}` writes "
                    f"{', '.join(files.values())}; or copy that cache here) or pass local files: {' '.join(instead)}")


def dataset_rows(spec, split, flag="--dataset"):
    """Hub dataset `spec` (org/name or org/name:config) through `datasets`: its split `split`, or its only split (many
    benchmarks have one, e.g. HuggingFaceH4/aime_2024's train), read from the local cache without retrying the
    network when the hub cannot be reached. Errors: UserError in one line."""
    try:  # a hub id is the one use of this large package
        import datasets
    except ImportError:
        raise UserError(f"{flag} {spec!r}: a hub dataset id needs the `datasets` package: pip install datasets "
                        f"(or give a .jsonl/.json/.parquet file)") from None
    repo, _, config = spec.partition(":")
    offline = datasets.config.HF_HUB_OFFLINE
    datasets.logging.set_verbosity_error()  # not "using the latest cached version": the start lines say what loaded
    try:
        datasets.config.HF_HUB_OFFLINE = offline or hub_unreachable() is not None  # datasets' own offline mode
        found = datasets.load_dataset(repo, config or None)
    except Exception as error:  # hub unreachable and not cached, no such dataset or config ...
        raise UserError(f"{flag} {spec!r}: not a local file and the hub dataset could not be loaded "
                        f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})")
    finally:
        datasets.config.HF_HUB_OFFLINE = offline
    if split not in found and len(found) > 1:
        raise UserError(f"{flag} {spec!r}: no {split!r} split (it has {', '.join(found)})")
    return found[split if split in found else next(iter(found))]


def main(argv=None):
    """python -m infra.hub --dataset ID --eval-datasets ID ...: each hub dataset written as the local file a trainer
    takes in its place (dataset_file), in the current folder, as JSON lines."""
    import argparse
    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--dataset", nargs="*", default=[], help="training sets: their train split")
    parser.add_argument("--eval-datasets", nargs="*", default=[], help="held-out sets: their test (or only) split")
    args = parser.parse_args(argv)
    for flag, specs in (("--dataset", args.dataset), ("--eval-datasets", args.eval_datasets)):
        for spec in specs:
            rows, path = dataset_rows(spec, "train" if flag == "--dataset" else "test", flag), dataset_file(spec, flag)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            rows.to_json(path, lines=True, force_ascii=False)
            print(f"{path}: {len(rows)} rows of {spec} ({rows.split})")


if __name__ == "__main__":
    try:
        main()
    except UserError as error:
        sys.exit(f"infra.hub: error: {error}")
