#!/usr/bin/env bash
# The wheels that benchmarks/gpu_check.sh installs on a GPU machine without network: run here (PyPI in reach), then
# carry the folder with the device tool (`carry: [".gpu-wheels"]`; it is in .gitignore, so it travels only so).
#
#     bash benchmarks/gpu_wheels.sh [DIR]        # default DIR: .gpu-wheels (about 1 MiB; refused above 64 MiB)
#
# The lent GPU machines (Python 3.12, PyTorch 2.11, transformers 5.17, no network) already hold every package of
# requirements.txt but these three and their needs: tyro (the command line), math-verify (the boxed-answer reward)
# and gymnasium (frozenlake_demo.py only). All are pure Python (py3-none-any), pinned to the versions this project
# is tested with, downloaded without their dependencies (--no-deps): each needed one not on the machine is listed
# below (typing-extensions, sympy, numpy and cloudpickle are there). gpu_check.sh installs them with
# `pip install --no-index --no-deps --target` only when `import tyro, math_verify` fails there, then checks their
# requirements against that machine's own versions (typeguard needs typing_extensions >= 4.14): one line names what
# is missing. The last line here lists what the wheels need from the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.gpu-wheels}
WHEELS=(
    tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1                            # tyro and its needs
    math-verify==0.9.0 latex2sympy2-extended==1.11.0 antlr4-python3-runtime==4.13.2  # math-verify and its needs
    gymnasium==1.4.0 farama-notifications==0.0.6                                      # gymnasium and its needs
)
mkdir -p "$DEST"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d "$DEST" "${WHEELS[@]}" \
    2> >(grep -v "is ignored: it is neither" >&2)  # local index locations some pip configurations name
count=$(ls "$DEST"/*.whl | wc -l)
kib=$(du -sk "$DEST" | cut -f1)
ls -l "$DEST"
echo "$count wheels, $((kib / 1024)).$((kib % 1024 * 10 / 1024)) MiB in $DEST"
if [ "$count" -ne "${#WHEELS[@]}" ]; then
    echo "expected ${#WHEELS[@]} wheels in $DEST, found $count: remove stale ones (two versions of one stop pip)" >&2
    exit 1
fi
if [ "$kib" -gt $((64 * 1024)) ]; then
    echo "$DEST is over 64 MiB: the device tool carries at most 64 MiB with the working tree" >&2
    exit 1
fi
# What the wheels need from the GPU machine itself (Python 3.12, extras aside), in one line: gpu_check.sh checks
# these there, once installed, before anything imports them (benchmarks/gpu_check_runs.py requirements).
python3 - "$DEST" <<'PYTHON'
import glob, re, sys, zipfile
from packaging.requirements import Requirement
def name(text):
    return re.sub(r"[-_.]+", "-", text).lower()
wheels = glob.glob(sys.argv[1] + "/*.whl")
carried = {name(wheel.rsplit("/", 1)[1].split("-")[0]) for wheel in wheels}
needs = set()
for wheel in wheels:
    with zipfile.ZipFile(wheel) as archive:
        text = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    for line in re.findall(r"^Requires-Dist: (.+)$", text, re.M):
        requirement = Requirement(line)
        marker = requirement.marker
        if marker and not marker.evaluate({"extra": "", "python_version": "3.12", "python_full_version": "3.12.3"}):
            continue
        if name(requirement.name) not in carried:
            needs.add(f"{requirement.name}{requirement.specifier} ({wheel.rsplit('/', 1)[1].split('-')[0]})")
print("needed from the GPU machine itself: " + (", ".join(sorted(needs)) or "nothing"))
PYTHON
