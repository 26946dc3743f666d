"""`bash scripts/test.sh --quick` runs the tests listed in tests/quick.txt: every entry exists, every layer is in it."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("kernels", "runtime", "platform", "deploy", "workflows")


def entries() -> list[str]:
    lines = (ROOT / "tests" / "quick.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def test_every_entry_names_an_existing_test():
    missing = []
    for entry in entries():
        path, _, name = entry.partition("::")
        if not (ROOT / path).is_file():
            missing.append(entry)
        elif name and not re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), flags=re.M):
            missing.append(entry)
    assert not missing, "tests/quick.txt names tests that do not exist (moved or renamed?):\n" + "\n".join(missing)


def test_every_layer_is_sampled():
    sampled = {entry.split("/")[1] for entry in entries() if entry.count("/") >= 2}
    assert set(LAYERS) <= sampled, f"no quick test for {sorted(set(LAYERS) - sampled)}"
