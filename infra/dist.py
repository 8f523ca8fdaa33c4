"""Several processes: `torchrun --nproc-per-node N <trainer>.py ...` runs one process (rank) per GPU, or per CPU
slot with gloo. Every model is sharded over the ranks (FSDP2 fully_shard); each rank generates and scores its
share of the prompts with a whole copy of the policy (the HF engine, or one vLLM engine per rank). Losses divide
by the mean token count per rank, so the gradients FSDP averages are those of the global token-mean loss.
Without torchrun every function here is the identity, and models are sharded only under --offload-optimizer
(FSDP2 on a world of one process, whose CPU offload keeps weights, gradients and AdamW states in host memory).
"""
import os
import sys

import torch

from infra import UserError


def rank():
    return int(os.environ.get("RANK", 0))


def world_size():
    return int(os.environ.get("WORLD_SIZE", 1))


def distributed():
    """True when this run was launched with several ranks (torchrun sets WORLD_SIZE), whatever process groups a
    library (vLLM's engine, say) set up in this process on its own."""
    return world_size() > 1


_offload_device = None  # with --offload-optimizer: the device the offloaded models compute on (init_device)


def offloaded():
    """Whether models keep their weights, gradients and AdamW states in host memory (--offload-optimizer)."""
    return _offload_device is not None


def sharded():
    """Whether models are wrapped by FSDP2: under torchrun, or in one process with --offload-optimizer."""
    return distributed() or offloaded()


def default_device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_device(device="", cpu_offload=False):
    """This process's torch device. Under torchrun (WORLD_SIZE > 1) it joins the process group first: NCCL with one
    GPU per rank (LOCAL_RANK), gloo on CPU; ranks other than 0 print nothing to stdout. cpu_offload: models will be
    sharded with FSDP2's CPU offload (a group of one process without torchrun; gloo beside NCCL for the host-side
    collectives on offloaded tensors)."""
    global _offload_device
    device = device or default_device()
    if (distributed() or cpu_offload) and not torch.distributed.is_initialized():
        if device.startswith("cuda"):
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            torch.cuda.set_device(device)
        backend = ("cpu:gloo,cuda:nccl" if cpu_offload else "nccl") if device.startswith("cuda") else "gloo"
        if distributed():
            torch.distributed.init_process_group(backend)
        else:  # a world of one, no rendezvous
            torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
        if rank() > 0:
            sys.stdout = open(os.devnull, "w")
    _offload_device = device if cpu_offload else None
    return device


def _communicable(tensor):
    """NCCL moves CUDA tensors only."""
    return tensor.cuda() if torch.distributed.get_backend() == "nccl" else tensor


def gather_objects(value):
    """[value of rank 0, value of rank 1, ...] (picklable values); [value] without torchrun."""
    if not distributed():
        return [value]
    values = [None] * world_size()
    torch.distributed.all_gather_object(values, value)
    return values


def gather_all(tensor):
    """Every rank's `tensor`, concatenated along dim 0 in rank order (the ranks may hold different numbers of rows)."""
    if not distributed():
        return tensor
    sizes = gather_objects(tensor.shape[0])
    padded = _communicable(tensor.new_zeros((max(sizes),) + tuple(tensor.shape[1:])))
    padded[:tensor.shape[0]] = _communicable(tensor)
    parts = [torch.empty_like(padded) for _ in sizes]
    torch.distributed.all_gather(parts, padded)
    return torch.cat([part[:size] for part, size in zip(parts, sizes)]).to(tensor.device)


def broadcast_object(value):
    """Rank 0's `value` on every rank (picklable values)."""
    if not distributed():
        return value
    holder = [value]
    torch.distributed.broadcast_object_list(holder, src=0)
    return holder[0]


def all_sum(tensor):
    """The element-wise sum over ranks of a small float tensor (float64 on the wire)."""
    if not distributed():
        return tensor
    total = _communicable(tensor.detach().to(torch.float64))
    torch.distributed.all_reduce(total)
    return total.to(tensor.device, tensor.dtype)


def rank_mean(value):
    """The mean over ranks of a number or a one-element tensor, as a float (itself without torchrun)."""
    return float(all_sum(torch.tensor([float(value)], dtype=torch.float64))) / world_size()


def mean_std(values):
    """Mean and standard deviation (Bessel-corrected; 0 for a single value) of `values` pooled over every rank,
    from one all-reduce of (count, sum, sum of squares)."""
    values = values.detach().double()
    count, total, squares = all_sum(torch.stack([values.new_tensor(values.numel()), values.sum(), (values ** 2).sum()]))
    mean = total / count.clamp(min=1)
    variance = (squares - count * mean ** 2).clamp(min=0) / (count - 1).clamp(min=1)
    return mean.float(), variance.sqrt().float()


def rank_share(items):
    """This rank's contiguous share of `items` (a list or a tensor); the shares in rank order make up `items`."""
    if not distributed():
        return items
    if len(items) % world_size():
        raise UserError(f"{len(items)} prompts do not split evenly over {world_size()} processes: make "
                        f"--prompts-per-step a multiple of --nproc-per-node (times the number of nodes)")
    share = len(items) // world_size()
    return items[rank() * share:(rank() + 1) * share]


def shard_model(model, compute_dtype):
    """FSDP2 over all ranks: each decoder layer a unit (the architecture's _no_split_modules), then the rest
    (embeddings, final norm, heads). Parameters stay float32; forward and backward run in `compute_dtype`. With
    --offload-optimizer, CPUOffloadPolicy: the float32 shards, their gradients and so the AdamW states (built from
    model.parameters()) live in host memory; each unit is copied to the device for its forward and backward, and
    the optimizer steps on the CPU. Not FSDP2's pin_memory=True: it copies each shard into torch's caching host
    allocator, which rounds every block up to a power of two (aten/src/ATen/core/CachingHostAllocator.h; 1.35-1.6x
    for Qwen3-4B's tensors, pytorch/pytorch#150517); torch 2.13's pinned_max_round_threshold_mb would stop that, 2.11
    and 2.12 have no such option. The shards are page-locked where they lie instead (pin_in_place); the gradients go
    to pageable memory."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    precision = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=False) if _offload_device else OffloadPolicy()
    layer_names = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in layer_names:
            fully_shard(module, mp_policy=precision, offload_policy=offload)
    fully_shard(model, mp_policy=precision, offload_policy=offload)
    if _offload_device and torch.cuda.is_available():
        pin_in_place(model)
    return model


def pin_in_place(model, smallest=2 ** 20, page=4096):
    """Page-lock each offloaded float32 shard of at least `smallest` bytes where it lies (cudaHostRegister, portable,
    as torch's own checkpoint stager does: exact sizes, where SGLang and vLLM fixed the same rounding), so its unit's
    copy to the GPU runs at pinned speed. A smaller shard, or one sharing a page with a registered one (a page
    registers once), stays pageable; at the first failure (a runtime without it) the rest do too, in one line.
    Never unregistered: the shards live as long as the run. Returns the bytes registered."""
    storages = {}
    for parameter in model.parameters():
        storage = (parameter.to_local() if hasattr(parameter, "to_local") else parameter).untyped_storage()
        if storage.nbytes() >= smallest:
            storages[storage.data_ptr()] = storage.nbytes()
    cudart, registered, last_page = torch.cuda.cudart(), 0, -1
    for pointer, size in sorted(storages.items()):
        if pointer // page <= last_page:
            continue
        error = int(cudart.cudaHostRegister(pointer, size, 1))  # 1: cudaHostRegisterPortable
        if error:
            _clear_cuda_error()
            if rank() == 0:
                print(f"--offload-optimizer: page-locking the shards failed (cudaError {error}): their copies to the "
                      f"GPU run from pageable memory")
            break
        registered, last_page = registered + size, (pointer + size - 1) // page
    return registered


def _clear_cuda_error():
    """cudaGetLastError of the CUDA runtime torch loaded, so that a failed registration does not surface at the next
    kernel launch's check (best effort: the runtime is found by its soname)."""
    import ctypes
    for name in ("libcudart.so.13", "libcudart.so.12"):
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


def compute_device(model):
    """Where `model` computes: its parameters' device, or under CPU offload the device FSDP copies them to."""
    return torch.device(_offload_device) if _offload_device else model.device


def full_weights(model, dtype=None):
    """(name, whole tensor) for each entry of model.state_dict(), an FSDP shard gathered one tensor at a time
    (under torchrun every rank must iterate: each gather is collective); floating-point ones cast to `dtype` if given,
    before the gather (bf16: half the bytes; a tensor already in `dtype` is itself, no copy)."""
    from torch.distributed.tensor import DTensor
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, DTensor):  # an offloaded shard goes to the mesh's device first (as torch's own gather)
            tensor = tensor.to(tensor.device_mesh.device_type)
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
