"""Torch's threads for a run, chosen once as it starts (Run.__init__ calls use_threads, which says the choice in the
run's first line): --threads, else OMP_NUM_THREADS, else the cores this process may use less those other processes
keep busy, at least 1 (choose: the rule, a pure function).

Torch's own default, one thread per core, suits a quiet machine only: its threads meet at every operation, so a core
taken by another process stalls them all. On 2 cores at load 2-5 `python grpo.py` took 2,353 s with torch's two
threads and 84 s with one (issue 60); at load 5-9, 3 of its steps took 156-201 s on two threads (83-132 CPU seconds:
threads spinning while they wait), 23-42 s on one (14-16 CPU seconds), whether chosen here or by OMP_NUM_THREADS=1
(benchmarks/threads.py, which measures the rule beside busy processes and without them).
"""
import math
import os
import time

SLACK = 0.3  # a core counts as free while other processes keep it at most 0.3 busy (daemons, an editor, a shell)
SAMPLE_S = 0.5  # how long /proc/stat is watched as the run starts
_TORCH_DEFAULT = []  # torch's thread count before this module first set it (its default: one per physical core)


def choose(cores, busy, env=None, flag=0, cap=None):
    """(threads, why): `flag` (--threads; 0: not given) when given, else OMP_NUM_THREADS from `env` when it holds a
    positive count, else the free cores: `cores` less `busy` (what other processes use of them, in cores), rounded
    down after SLACK, at least 1 and at most `cap` (a CPU quota, torch's default; None: `cores`)."""
    if flag > 0:
        return flag, f"--threads {flag}"
    if omp_threads(env):
        return omp_threads(env), f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}"
    free = max(1, min(cores if cap is None else cap, math.floor(cores - busy + SLACK)))
    return free, f"auto: {cores} core{'s' * (cores != 1)} here, {busy:.1f} busy with other work"


def omp_threads(env):
    """OMP_NUM_THREADS's count in `env` (the first of a list: OpenMP takes one per nesting level), 0 if none."""
    value = (env or {}).get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(value) if value.isdigit() else 0


def usable_cores(torch_default):
    """(cores, cap): the cores this process may run on (its CPU affinity: a cpuset, taskset), shared with the other
    ranks of a torchrun on this machine, and the most threads it may take: no more than a cgroup CPU quota allows
    (a container's --cpus) nor than `torch_default` (a quiet machine never gets more threads than torch gave)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    cores = cap = max(1, cpus // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    for path in ("/sys/fs/cgroup/cpu.max", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
        try:
            with open(path) as handle:
                quota = handle.read().split()
            if path.endswith("cfs_quota_us"):
                with open(os.path.join(os.path.dirname(path), "cpu.cfs_period_us")) as handle:
                    quota.append(handle.read().strip())
            if quota[0] not in ("max", "-1"):
                cap = min(cap, max(1, math.ceil(int(quota[0]) / int(quota[1]))))
            break
        except (OSError, ValueError, IndexError):
            continue
    return cores, max(1, min(cap, torch_default))


def busy_cores(seconds=SAMPLE_S):
    """Cores' worth of CPU time that other processes took over the next `seconds`: the busy time (all but idle and
    iowait; a VM's steal included) of the CPUs this process may run on, from /proc/stat, less this process's own
    (os.times: its threads). Without /proc/stat (macOS) the 1-minute load average."""
    cpus = {f"cpu{n}" for n in os.sched_getaffinity(0)} if hasattr(os, "sched_getaffinity") else set()

    def sample():
        busy = total = 0
        with open("/proc/stat") as handle:
            for line in handle:
                name, *ticks = line.split()
                if name in cpus:
                    ticks = [int(tick) for tick in ticks[:8]]  # user nice system idle iowait irq softirq steal
                    busy, total = busy + sum(ticks) - ticks[3] - ticks[4], total + sum(ticks)
        own = os.times()
        return busy, total, own.user + own.system, time.monotonic()
    try:
        before = sample()
        time.sleep(seconds)
        busy, total, own, elapsed = (b - a for a, b in zip(before, sample()))
    except (OSError, ValueError):
        return os.getloadavg()[0]
    if total <= 0:
        return os.getloadavg()[0]
    return max(0.0, busy / total * len(cpus) - own / elapsed)


def use_threads(flag=0):
    """Set torch's threads by choose() (sampling the machine only when neither --threads nor OMP_NUM_THREADS
    decides); print (rank 0) and return the line that says it: `torch threads: 1 (auto: 2 cores here, 1.4 busy ...`."""
    import torch

    from infra import dist
    if not _TORCH_DEFAULT:
        _TORCH_DEFAULT.append(torch.get_num_threads())
    decided = flag > 0 or omp_threads(os.environ) > 0
    cores, cap = usable_cores(_TORCH_DEFAULT[0])
    threads, why = choose(cores, 0.0 if decided else busy_cores(), os.environ, flag, cap)
    torch.set_num_threads(threads)
    line = f"torch threads: {threads} ({why}{'' if decided else '; --threads N or OMP_NUM_THREADS=N to set'})"
    if dist.rank() == 0:
        print(line)
    return line
