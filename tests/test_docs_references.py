"""The docs name only files that exist: every repository path in README.md, docs/*.md and the chart's README,
written in backticks or as a link, is checked against the checkout (issue 37, item 5).

What is checked: inside backticks (fenced code blocks are commands and examples, not references), each token with a
`/` whose first part is a top-level folder the repository tracks (`trainer/diloco_trainer/syncer/app.py`,
`docs/testing.md`, `tests/operator/test_x.py::test_y`, the latter also for its test function); and every link
target that is not a URL, resolved from the linking file's folder as GitHub does. Skipped: globs, placeholders
(`<job>`, `{i}`), `~/`, `/tmp`, `bench/results/` (git-ignored run output) and URLs.
A layout section (a heading with "layout" that names a folder in backticks: "## Layout (`operator/diloco_operator/`)",
with an optional bold sub-heading naming a subfolder, "**`api/` — ...**") resolves the modules in the first column of
its tables and at the head of its list items against that folder; and it names every module the folder tracks.
A bare `NAME.md` in backticks must be one of the docs (docs/NAME.md or NAME.md at the root)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "charts" / "decoupled-diloco" / "README.md"]

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1", re.S | re.M)
INDENTED_CODE = re.compile(r"^(?: {4}|\t).*$", re.M)
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# A path-like token inside a code span: parts joined by `/`, optionally a pytest node id after `::`.
PATH_TOKEN = re.compile(r"(?<![\w.~/$-])((?:[\w.-]+/)+[\w.*<>{}\[\]-]*)(::[\w\[\]-]+)?")
SKIPPED_PREFIXES = ("bench/results/",)
PLACEHOLDER = re.compile(r"[*?<>{}\[\]]|\.\.\.")


def _top_level_folders() -> set[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        names = [n for n in out.split("\0") if "/" in n]
        return {n.split("/", 1)[0] for n in names}
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every visible folder
        return {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")}


def _prose(text: str) -> str:
    """The text without fenced or indented code blocks (commands and examples, not references)."""
    return INDENTED_CODE.sub("", FENCE.sub("", text))


def _code_paths(text: str, folders: set[str]) -> list[tuple[str, str | None]]:
    found = []
    for span in INLINE_CODE.finditer(_prose(text)):
        for m in PATH_TOKEN.finditer(span.group(2)):
            path, node = m.group(1), m.group(2)
            if path.split("/", 1)[0] not in folders or path.startswith(SKIPPED_PREFIXES):
                continue
            if PLACEHOLDER.search(path):
                continue
            found.append((path.rstrip("."), node[2:] if node else None))
    return found


def _links(text: str) -> list[str]:
    targets = []
    for m in LINK.finditer(_prose(text)):
        target = m.group(1).split("#", 1)[0]
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("/", "~")):
            continue  # an anchor in the same file, a URL or mailto:, an absolute or home path
        targets.append(target)
    return targets


LAYOUT_HEADING = re.compile(r"^#+ (?:.*? )?[Ll]ayout .*?\(`((?:[\w-]+/)+)`\)", re.M)
BOLD_SUBFOLDER = re.compile(r"^\*\*`([\w-]+/)`")
BOLD_LINE = re.compile(r"^\*\*")
HEADING = re.compile(r"^#+ ")
ROW_HEAD = re.compile(r"^\|([^|]*)\|")
ITEM_HEAD = re.compile(r"^- ((?:`[^`]+`(?:, | and |, and )?)+)")
MODULE = re.compile(r"`([\w./-]+)`")
BARE_MD = re.compile(r"(?<![\w/.~-])([\w-]+\.md)\b(?![/\w])")


def _layout_sections(text: str) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(heading folder, the section's text, [(folder the entry is relative to, entry)]) per layout section."""
    sections = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = LAYOUT_HEADING.match(lines[i])
        if not m:
            i += 1
            continue
        folder, sub, entries, body = m.group(1), "", [], []
        level = len(lines[i]) - len(lines[i].lstrip("#"))
        i += 1
        while i < len(lines):
            line = lines[i]
            if HEADING.match(line) and len(line) - len(line.lstrip("#")) <= level:
                break
            body.append(line)
            if BOLD_LINE.match(line):
                bold = BOLD_SUBFOLDER.match(line)
                sub = bold.group(1) if bold else ""
            head = ROW_HEAD.match(line) or ITEM_HEAD.match(line)
            if head and not set(head.group(1).strip()) <= set("-: "):
                entries += [(folder + sub, name) for name in MODULE.findall(head.group(1))]
            i += 1
        sections.append((folder, "\n".join(body), entries))
    return sections


def _tracked_modules(folder: str) -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", folder], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout
        names = [n for n in out.split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = [str(p.relative_to(ROOT)) for p in (ROOT / folder).rglob("*.py")]
    return sorted(n[len(folder):] for n in names if n.endswith(".py") and not n.endswith("__init__.py"))


def _layout_missing(doc: Path, text: str) -> list[str]:
    missing = []
    where = doc.relative_to(ROOT)
    for folder, body, entries in _layout_sections(_prose(text)):
        for base, name in entries:
            if not (ROOT / base / name).exists():
                missing.append(f"{where}: layout of `{folder}`: `{name}` is not in `{base}`")
        named = set(MODULE.findall(body))
        for module in _tracked_modules(folder):
            if module not in named and module.rsplit("/", 1)[-1] not in named:
                missing.append(f"{where}: layout of `{folder}` does not name `{module}`")
    return missing


def _missing() -> list[str]:
    folders = _top_level_folders()
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        where = doc.relative_to(ROOT)
        for path, node in _code_paths(text, folders):
            target = ROOT / path
            if not target.exists():
                missing.append(f"{where}: `{path}` does not exist")
            elif node and target.is_file() and not re.search(rf"\bdef {re.escape(node)}\b", target.read_text()):
                missing.append(f"{where}: `{path}::{node}`: no such test in that file")
        for span in INLINE_CODE.finditer(_prose(text)):
            for name in BARE_MD.findall(span.group(2)):
                if not ((ROOT / "docs" / name).exists() or (ROOT / name).exists() or (doc.parent / name).exists()):
                    missing.append(f"{where}: `{name}` is none of the docs")
        missing += _layout_missing(doc, text)
        for link in _links(text):
            if PLACEHOLDER.search(link) or link.startswith(SKIPPED_PREFIXES):
                continue
            if not (doc.parent / link).resolve().exists():
                missing.append(f"{where}: link ({link}) does not exist")
    return missing


def test_the_docs_name_only_files_that_exist():
    missing = _missing()
    assert not missing, "\n".join(missing)


def test_the_check_finds_paths_and_links():
    """The check itself: it sees a path in backticks, a test node id and a relative link, and skips the rest."""
    folders = {"docs", "trainer", "tests", "bench"}
    text = (
        "See `trainer/diloco_trainer/syncer/app.py` and `tests/test_layout.py::test_x`, run `cat docs/a.md`; "
        "not `app.py`, `runs/demo`, `bench/results/x.json`, `docs/*.md` nor `<run>/final`.\n"
        "```\ncat docs/in_a_fence.md\n```\n[x](docs/y.md) [u](https://example.com/a.md) [s](#here)\n"
    )
    assert _code_paths(text, folders) == [
        ("trainer/diloco_trainer/syncer/app.py", None), ("tests/test_layout.py", "test_x"), ("docs/a.md", None),
    ]
    assert _links(text) == ["docs/y.md"]


def test_a_layout_section_resolves_its_modules_against_its_folder():
    text = (
        "## Layout (`trainer/diloco_trainer/`)\n| module | what |\n|---|---|\n| `config.py` | x `not_checked.py` |\n"
        "| `syncer/` | `app.py` |\n**`learner/` — the learner**\n\n| module | what |\n|---|---|\n| `loop.py` | y |\n"
        "- `protocol/wire.py`, `protocol/fragments.py` — z\n## Next\n| `ignored.py` | |\n"
    )
    [(folder, _, entries)] = _layout_sections(text)
    assert folder == "trainer/diloco_trainer/"
    assert entries == [
        ("trainer/diloco_trainer/", "config.py"), ("trainer/diloco_trainer/", "syncer/"),
        ("trainer/diloco_trainer/learner/", "loop.py"), ("trainer/diloco_trainer/learner/", "protocol/wire.py"),
        ("trainer/diloco_trainer/learner/", "protocol/fragments.py"),
    ]
