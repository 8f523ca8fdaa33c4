"""Checkpoints and exact resume: runs/<run>/checkpoints/step_<n>/ holds every model and optimizer in sharded form
(torch.distributed.checkpoint, what a resume reads, on any number of ranks), a whole Hugging Face copy of each
model (safetensors, for --eval-only, vLLM and export), the RNG states and the step. Written to a staging folder,
flushed and renamed, so a kill at any moment leaves the previous checkpoints whole.
"""
import contextlib
import os
import random
import re
import shutil
import warnings

import numpy as np
import torch

from infra import UserError
from infra.dist import distributed, rank, sharded

warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP in one process too


def seed_everything(seed):
    """Seed Python, NumPy and torch; under torchrun each rank adds its rank, so the ranks sample differently."""
    random.seed(seed + rank())
    np.random.seed(seed + rank())
    torch.manual_seed(seed + rank())


def _checkpoint_steps(root):
    """Step numbers of the finished checkpoints under `root`, ascending (staging directories are not listed)."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(int(name[5:]) for name in names if re.fullmatch(r"step_\d+", name))


def _fsync(path):
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory
            os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _fsync_tree(path):
    """Flush a directory tree to disk, so a power loss after the rename cannot leave truncated files. Files get the
    usual permissions (safetensors writes through a private temporary file, mode 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    for directory, _, files in os.walk(path):
        for name in files:
            os.chmod(os.path.join(directory, name), 0o666 & ~umask)
            _fsync(os.path.join(directory, name))
        _fsync(directory)


def save_checkpoint(run_dir, step, models, optimizers, tokenizer, keep=2, rng=None):
    """runs/<run>/checkpoints/step_<n>/{sharded/, <name>/, rng_rank<r>.pt, trainer_state.pt}: sharded/ holds the
    weights and optimizer states (torch.distributed.checkpoint: each rank writes its shards, and a resume may use
    any number of ranks); <name>/ a whole HF-format copy of each model (for --eval-only, vLLM and export).
    Written to a staging directory, flushed, then renamed: a kill at any moment leaves the previous checkpoints
    whole. Keeps the last `keep`; a saved step also removes later steps (left by a run resumed from an earlier
    checkpoint). Every rank calls it; the directory must be one filesystem seen by all (multi-node: a shared one).
    `rng`: the RNG states to save (rng_state() taken earlier), else the current ones."""
    root = os.path.join(run_dir, "checkpoints")
    final, staging = os.path.join(root, f"step_{step:06d}"), os.path.join(root, f".staging_{step:06d}")
    if rank() == 0:
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):
            if name.startswith((".staging_", ".replaced_")):  # left by a save that was killed
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    # DCP's state-dict API gives a never-stepped optimizer (the actor during critic warm-up) state by a step at lr 0,
    # Adam's step count included: it is emptied again here and after loading, so a resumed run stays exact
    fresh = [name for name, optimizer in optimizers.items() if not optimizer.state]
    state = {"step": step, "models": sorted(models), "fresh_optimizers": fresh}
    _save_sharded(staging, models, optimizers, tokenizer)
    for name in fresh:
        optimizers[name].state.clear()
    torch.save(rng or rng_state(), os.path.join(staging, f"rng_rank{rank()}.pt"))
    if distributed():
        torch.distributed.barrier()
    if rank() == 0:
        torch.save(state, os.path.join(staging, "trainer_state.pt"))
        _fsync_tree(staging)
        replaced = os.path.join(root, f".replaced_{step:06d}")
        if os.path.exists(final):  # saving the same step again (an interrupt or a stop right after a save)
            os.rename(final, replaced)
        os.rename(staging, final)
        _fsync(root)
        shutil.rmtree(replaced, ignore_errors=True)
        steps = _checkpoint_steps(root)
        for old in [s for s in steps if s > step] + [s for s in steps if s <= step][:-max(keep, 1)]:
            shutil.rmtree(os.path.join(root, f"step_{old:06d}"), ignore_errors=True)
    if distributed():
        torch.distributed.barrier()
    return final


def _save_sharded(directory, models, optimizers, tokenizer):
    """The shards of every model and optimizer (DCP; one process writes one shard), and a whole HF-format copy of
    each model, gathered to rank 0."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    dcp.save(_sharded_state(models, optimizers), checkpoint_id=os.path.join(directory, "sharded"))
    for name, model in models.items():
        whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)) \
            if sharded() else None  # None: save_pretrained takes the model's own
        if rank() == 0:
            model.save_pretrained(os.path.join(directory, name), state_dict=whole, safe_serialization=True)
            model.config.architectures = [getattr(model, "architecture", type(model).__name__)]  # not FSDP's class
            model.config.save_pretrained(os.path.join(directory, name))
            tokenizer.save_pretrained(os.path.join(directory, name))


def _sharded_state(models, optimizers):
    """{name: {"model": ..., "optimizer": ...}}: this rank's shards (whole tensors in one process), keyed by name."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    return {name: dict(zip(("model", "optimizer"), get_state_dict(model, optimizers[name])))
            for name, model in models.items()}


def rng_state():
    return {"python": random.getstate(), "numpy": _numpy_rng_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def _set_rng_state(state):
    random.setstate(state["python"])
    kind, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def _numpy_rng_state():
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    return [kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached_gaussian]


def find_checkpoint(path):
    """The checkpoint directory `--resume path` names: a step_<n> directory, or a run directory's latest checkpoint.
    Raises UserError (cheap: call it before loading any model)."""
    if not os.path.isdir(path):
        raise UserError(f"--resume {path!r}: no such directory (give runs/<run> or runs/<run>/checkpoints/step_<n>)")
    if os.path.isdir(os.path.join(path, "checkpoints")):
        steps = _checkpoint_steps(os.path.join(path, "checkpoints"))
        if not steps:
            raise UserError(f"--resume {path!r}: the run has no checkpoint yet")
        path = os.path.join(path, "checkpoints", f"step_{steps[-1]:06d}")
    if not os.path.exists(os.path.join(path, "trainer_state.pt")):
        raise UserError(f"--resume {path!r}: not a checkpoint (no trainer_state.pt)")
    return path


def load_checkpoint(path, models, optimizers):
    """Restore weights, optimizer states and RNG from `path` (see find_checkpoint). Returns the number of finished
    steps, which also fixes the data position (step_rows). Any number of ranks can load it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    path = find_checkpoint(path)
    saved = torch.load(os.path.join(path, "trainer_state.pt"), map_location="cpu", weights_only=True)
    if saved["models"] != sorted(optimizers):
        raise UserError(f"--resume {path!r}: saved by a trainer with models {saved['models']}, "
                        f"this one has {sorted(optimizers)}")
    sharded = _sharded_state(models, optimizers)
    try:
        dcp.load(sharded, checkpoint_id=os.path.join(path, "sharded"))
    except (Exception, dcp.api.CheckpointException) as error:  # a BaseException: wraps a missing or misshapen tensor
        problem = re.search(r"(Missing key[^\n]*|Size mismatch[^\n]*)", str(error))
        what = problem.group(1) if problem else type(error).__name__
        raise UserError(f"--resume: the checkpoint in {path} does not fit the model ({what}); "
                        "resume with the same --model and method")
    for name, model in models.items():
        set_state_dict(model, optimizers[name], model_state_dict=sharded[name]["model"],
                       optim_state_dict=sharded[name]["optimizer"])
        if name in saved["fresh_optimizers"]:
            optimizers[name].state.clear()
    rng_path = os.path.join(path, f"rng_rank{rank()}.pt")
    if os.path.exists(rng_path):
        _set_rng_state(torch.load(rng_path, map_location="cpu", weights_only=True))
    else:  # more ranks than the run that saved it: a fresh seed per step and rank
        seed_everything(saved["step"] * 1000 + 7)
    return saved["step"]
