"""Docs, README, comments and docstrings describe the product, not how it was developed.

docs/architecture.md, "The project speaks of itself only": no development rounds ("session 9"), no commit
hashes, no internal work-item names ("issue 4", "the loss issue's bars"); git history keeps those. This scans
docs/, README.md and the package folders for them. Legitimate text stays clear: "a Kubernetes session", an HTTP
session, a test session; a hash in a URL, a sha256 digest of a vendored file, the upstream commit a vendored file
was taken from (on a line that names its source URL or digest), a model revision in a config example.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ["README.md", "docs", "kernels", "runtime", "platform", "workflows", "benchmarks", "deploy", "docker"]
SUFFIXES = {".md", ".py", ".sh", ".yaml", ".yml", ".tpl", ".txt", ".toml", ".cfg", ".ini"}

_HEX = r"(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}"  # 7-40 hex digits, at least one digit and one letter
PATTERNS = {
    # A numbered development round: "session 9", "sessions 2 and 9", "session-13".
    "development round": re.compile(r"\bsessions?[ -]\d", re.IGNORECASE),
    # A numbered work item: "issue 4", "issues 4 and 5", "issue-5", "issue #12" (not ".../issues/2583" in a URL).
    "work item": re.compile(r"\bissues?[ -]#?\d", re.IGNORECASE),
    # An unnumbered internal work item: "the runtime issue", "the loss issue's bars", "the shapes".
    "named work item": re.compile(
        r"\b(?:kernel|loss|runtime|first|second|third) issue\b|\bthe issue's\b|\bissue's (?:bars?|shapes|target)",
        re.IGNORECASE,
    ),
    # A commit hash in backticks, after "commit(s)" or "at", or alone in parentheses: `5113f95`, (c08bd83, ...).
    # A hash of digits alone counts only after "commit": elsewhere it reads as a number.
    "commit hash": re.compile(
        rf"`{_HEX}`|\bcommits? (?:at )?`?(?:{_HEX}|\d{{7,40}})\b|\bat `?{_HEX}\b|\(`?{_HEX}`?[,)]",
    ),
}
# A line that cites where a vendored file came from may name the upstream commit.
VENDORED_SOURCE = re.compile(r"https?://|sha256", re.IGNORECASE)


def scanned_files() -> list[Path]:
    files = []
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            files.append(path)
            continue
        for file in sorted(path.rglob("*")):
            if file.is_file() and (file.suffix in SUFFIXES or file.name.startswith("Dockerfile")):
                files.append(file)
    return files


def findings(text: str) -> list[tuple[int, str, str]]:
    """(line number, kind, the matched text) for every history mark in `text`."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for kind, pattern in PATTERNS.items():
            if kind == "commit hash" and VENDORED_SOURCE.search(line):
                continue
            found.extend((number, kind, match.group(0)) for match in pattern.finditer(line))
    return found


def test_scan_covers_every_folder():
    files = scanned_files()
    for name in SCANNED:
        assert any(f == ROOT / name or ROOT / name in f.parents for f in files), f"nothing scanned in {name}"


def test_docs_and_code_carry_no_development_history():
    problems = [
        f"{file.relative_to(ROOT)}:{number}: {kind} {text!r}"
        for file in scanned_files()
        for number, kind, text in findings(file.read_text(errors="replace"))
    ]
    assert not problems, (
        "docs, comments and docstrings describe the product, not its history (docs/architecture.md):\n"
        + "\n".join(problems)
    )


@pytest.mark.parametrize(
    "text",
    [
        "measured in session 9 on the H200",
        "Sessions 2 and 9 found it",
        "see issue 4",
        "End-to-end training benchmark (issues 4 and 5)",
        "# issue-5 benchmark",
        "the loss issue's two bars",
        "(see the runtime issue)",
        "only the issue's shapes",
        "reverted at `5113f95`",
        "measured at commit 3721377",
        "the branch at commit 5113f95",
        "the GPU tests passed at d81cdbf",
        "(c08bd83, `python -m benchmarks.tune_rope` there)",
        "(889f806)",
    ],
)
def test_flags_history(text):
    assert findings(text), text


@pytest.mark.parametrize(
    "text",
    [
        "a Kubernetes session, an HTTP session, the test session's fixtures",
        "requests.Session() keeps the connection",
        "revision: 7ae557604adf67be50417f59c2c2f167def9a775   # a branch, tag or commit",
        "tag `v1.9.2` (commit `bde9c20903ad9b54af1f3883e4fa764a3c0db797`) of https://github.com/kubeflow/trainer",
        "sha256 `eb80e57a984cdc7ceefaaf3fc561e21b673c30cbb58589f2389528d2b2760d22`",
        "([kubeflow/trainer#2583](https://github.com/kubeflow/trainer/issues/2583))",
        "instruction issue, not HBM, bounds it",
        "It issues all its loads before any store",
        "at 4096 tokens (0.169 ms), 131072 tokens at 26.79 GiB",
        "the limit is 0x7fffffff elements (2147483647)",
    ],
)
def test_leaves_legitimate_text(text):
    assert not findings(text), findings(text)
