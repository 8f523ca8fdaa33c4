"""The README and docs/ as a reader meets them: the README fits in 180 lines of at most 120 characters, every
relative link in README.md and docs/*.md points at a file (and a heading, for `#anchors`) in the repository, no
document sends the reader outside it (../shared), and the README's Layout names every module of infra/ and every
script of benchmarks/."""
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCUMENTS = ["README.md"] + sorted(os.path.relpath(path, ROOT)
                                   for path in glob.glob(os.path.join(ROOT, "docs", "*.md")))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)|^\[[^\]]+\]:\s*(\S+)", re.MULTILINE)  # inline and reference links


def read(name):
    with open(os.path.join(ROOT, name), encoding="utf-8") as handle:
        return handle.read()


def anchor(heading):
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text):
    return {anchor(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def relative_links(text):
    targets = [inline or reference for inline, reference in LINK.findall(text)]
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # drop https:, mailto: ...


def test_readme_is_short_and_narrow():
    lines = read("README.md").splitlines()
    assert len(lines) <= 180, f"README.md has {len(lines)} lines; move detail to docs/ (at most 180)"
    wide = [f"README.md:{number}: {len(line)} characters" for number, line in enumerate(lines, 1) if len(line) > 120]
    assert not wide, "lines over 120 characters:\n" + "\n".join(wide)


@pytest.mark.parametrize("name", DOCUMENTS)
def test_relative_links_resolve(name):
    text, folder, broken = read(name), os.path.dirname(os.path.join(ROOT, name)), []
    for target in relative_links(text):
        path, _, fragment = target.partition("#")
        file = os.path.normpath(os.path.join(folder, path)) if path else os.path.join(ROOT, name)
        if not os.path.exists(file) or not file.startswith(ROOT + os.sep):
            broken.append(f"{target}: no such file in the repository")
        elif fragment and file.endswith(".md") and fragment not in anchors(read(os.path.relpath(file, ROOT))):
            broken.append(f"{target}: no heading with that anchor in {os.path.relpath(file, ROOT)}")
    assert not broken, f"{name}:\n" + "\n".join(broken)


@pytest.mark.parametrize("name", DOCUMENTS)
def test_documents_stand_alone(name):
    assert "../shared" not in read(name), f"{name} refers to ../shared, which is not part of the repository"


def test_readme_layout_names_every_module():
    layout = read("README.md").split("## Layout", 1)[1].split("\n## ", 1)[0]
    words = set(re.findall(r"[\w.]+", layout))
    modules = [os.path.basename(path)[:-3] for path in glob.glob(os.path.join(ROOT, "infra", "*.py"))]
    scripts = [os.path.basename(path) for path in glob.glob(os.path.join(ROOT, "benchmarks", "*"))
               if os.path.isfile(path) and not path.endswith("__init__.py")]
    missing = [f"infra/{m}.py" for m in modules if m != "__init__" and m not in words and f"{m}.py" not in words]
    missing += [f"benchmarks/{s}" for s in scripts if s not in words]
    assert not missing, "README.md's Layout does not name: " + ", ".join(sorted(missing))


def test_the_checks_can_fail(tmp_path):
    # the helpers above on planted defects: a missing file, a missing anchor, a wide line is counted
    text = "# Title\n## Speed against TRL\n[a](nowhere.md) [b](#speed-against-trl) [c](#no-such) [d](https://x.org)\n"
    assert relative_links(text) == ["nowhere.md", "#speed-against-trl", "#no-such"]
    assert anchors(text) == {"title", "speed-against-trl"}
    assert anchor("The six methods on 5 seeds") == "the-six-methods-on-5-seeds"
    assert anchor("Speed: the verdict (CPU)") == "speed-the-verdict-cpu"
