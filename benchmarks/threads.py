"""Times the torch thread count a run picks (infra/threads.py) against one thread and torch's default, beside busy
processes and without them, printing the load beside every figure.

    python benchmarks/threads.py                 # grpo.py's CPU demo, 3 steps, beside 3 busy processes, then without
    python benchmarks/threads.py --busy 0 --steps 30 --repeats 1   # the whole demo, without busy processes of its own

Each condition runs `python <trainer> --steps N` three ways, interleaved `--repeats` times: auto (neither
OMP_NUM_THREADS nor --threads: what a newcomer gets), one thread (OMP_NUM_THREADS=1, the workaround) and torch's
default (--threads <torch's count>: what every run got before issue 60). "Beside busy" starts `--busy` processes that
spin a core each (Python loops) for the condition's runs; the other condition starts none (on a shared machine other
work may still be there: the `others` column says). Printed per run: the wall time of the whole command, the threads
the run chose (its first line), its CPU time (user + system: the work done, less sensitive to the load than the wall
time; spinning threads add to it) and the load around it (os.getloadavg's 1-minute figure before and after, and what
other processes kept busy over the run, in cores, from /proc/stat less the run's own CPU time); then the verdicts:
beside busy processes auto no slower than one thread, quiet auto no slower than torch's default (each the median, 10%
allowed for noise). On a machine shared with other work the "quiet" condition is only as quiet as the load column
says: re-measure it where that column is near 0.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
NOISE = 1.10  # "no slower": a median within 10% of the other's


def cpu_ticks():
    """(busy, total) ticks of all CPUs from /proc/stat: busy is all but idle and iowait."""
    with open("/proc/stat") as handle:
        ticks = [int(tick) for tick in handle.readline().split()[1:9]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def torch_default_threads():
    """torch's thread count in a fresh process without OMP_NUM_THREADS: what runs got before issue 60."""
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                          capture_output=True, text=True, check=True)
    return int(done.stdout)


def one_run(trainer, steps, way, default, output_dir):
    """Run the trainer one way; return {seconds, cpu, threads, load_before, load_after, others, first} (cpu: its CPU
    seconds; others: cores busy with other processes over the run; first: its first line)."""
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    flags = []
    if way == "one thread":
        env["OMP_NUM_THREADS"] = "1"
    elif way == "torch default":
        flags = ["--threads", str(default)]
    command = [sys.executable, trainer, "--steps", str(steps), "--output-dir", output_dir, "--save-every", "0",
               "--run-name", f"{way.replace(' ', '_')}_{time.time_ns()}", *flags]
    load_before, (busy0, total0), start = os.getloadavg()[0], cpu_ticks(), time.monotonic()
    child_cpu = os.times()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds, (busy1, total1) = time.monotonic() - start, cpu_ticks()
    own = (os.times().children_user - child_cpu.children_user) + (os.times().children_system -
                                                                  child_cpu.children_system)
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    first = done.stdout.splitlines()[0]
    threads = int(first.split()[2]) if first.startswith("torch threads: ") else None
    cpus = os.cpu_count()
    others = max(0.0, (busy1 - busy0) / max(total1 - total0, 1) * cpus - own / seconds)
    return dict(seconds=seconds, cpu=own, threads=threads, load_before=load_before, load_after=os.getloadavg()[0],
                others=others, first=first)


def condition(name, busy, args, default, output_dir):
    """Run the three ways `args.repeats` times beside `busy` spinning processes; print each run; return
    ({way: [seconds]}, [others' cores per run])."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        time.sleep(2.0 if busy else 0.0)  # the spinners are up before the first run samples the machine
        times, others = {way: [] for way in WAYS}, []
        for repeat in range(args.repeats):
            for way in WAYS:
                result = one_run(args.trainer, args.steps, way, default, output_dir)
                times[way].append(result["seconds"])
                others.append(result["others"])
                print(f"{name:<22} {way:<14} {result['threads']!s:>7} {result['seconds']:8.1f} {result['cpu']:6.1f} "
                      f"{result['load_before']:6.2f} -> {result['load_after']:5.2f} {result['others']:7.2f}   "
                      f"{result['first'][15:]}", flush=True)
        return times, others
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


WAYS = ("auto", "one thread", "torch default")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", default="grpo.py", help="the trainer to run (default: grpo.py, the CPU demo)")
    parser.add_argument("--steps", type=int, default=3, help="its --steps (default: 3 of the demo's 30)")
    parser.add_argument("--busy", type=int, default=3, help="busy processes beside it (default: 3; 0: quiet only)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each way per condition (default: 2)")
    args = parser.parse_args()
    default = torch_default_threads()
    print(f"{args.trainer} --steps {args.steps} on {os.cpu_count()} cores (affinity: "
          f"{len(os.sched_getaffinity(0))}), torch's default {default} threads; load: os.getloadavg 1-minute before "
          f"-> after each run; others: cores other processes kept busy during it (/proc/stat less the run's CPU)")
    print(f"{'condition':<22} {'way':<14} {'threads':>7} {'wall s':>8} {'cpu s':>6} {'load':>15} {'others':>7}   "
          "first line")
    with tempfile.TemporaryDirectory() as output_dir:
        results = {}
        if args.busy:
            results["busy"] = condition(f"beside {args.busy} busy", args.busy, args, default, output_dir)
        results["quiet"] = condition("no busy ones of its own", 0, args, default, output_dir)
    median = {name: {way: statistics.median(seconds) for way, seconds in times.items()}
              for name, (times, _) in results.items()}
    others = {name: statistics.median(loads) for name, (_, loads) in results.items()}
    if "busy" in median:
        auto, one = median["busy"]["auto"], median["busy"]["one thread"]
        print(f"beside {args.busy} busy processes (others' load {others['busy']:.1f} cores): auto {auto:.1f} s, one "
              f"thread {one:.1f} s, torch's default {median['busy']['torch default']:.1f} s (medians): auto is "
              f"{'no slower than' if auto <= NOISE * one else 'SLOWER than'} one thread ({auto / one:.2f}x)")
    auto, today = median["quiet"]["auto"], median["quiet"]["torch default"]
    print(f"without busy processes of its own (others' load {others['quiet']:.1f} cores): auto {auto:.1f} s, torch's "
          f"default {today:.1f} s, one thread {median['quiet']['one thread']:.1f} s (medians): auto is "
          f"{'no slower than' if auto <= NOISE * today else 'SLOWER than'} torch's default ({auto / today:.2f}x)"
          + ("; a quiet machine's figure needs others' load near 0: re-measure there" if others["quiet"] > 0.3 else ""))


if __name__ == "__main__":
    main()
