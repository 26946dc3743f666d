"""Generated demo tasks: small enough that a tiny Llama visibly learns them on a CPU in minutes.

    held_out = write_arithmetic_dataset("data/eval.jsonl", 200, seed=1)
    write_arithmetic_dataset("data/train.jsonl", 5000, seed=0, exclude={r["instruction"] for r in held_out})

Each line is an instruction/response record, e.g. {"instruction": "23+58=", "response": "81"}, for
`data.format: instruction`; `exact_match` scores a generated answer against the response.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path

from tigon.runtime.files import atomic_write_text

OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arithmetic_record(a: int, b: int, operator: str) -> dict[str, str]:
    """One example: {"instruction": "a<op>b=", "response": "<result>"}."""
    return {"instruction": f"{a}{operator}{b}=", "response": str(OPERATORS[operator](a, b))}


def write_arithmetic_dataset(
    path: str | Path,
    n_examples: int,
    seed: int,
    max_operand: int = 99,
    operators: str = "+",
    exclude: Iterable[str] = (),
) -> list[dict[str, str]]:
    """Write `n_examples` arithmetic problems as JSONL, atomically; the same arguments give the same file.

    Operands are drawn uniformly from 0..max_operand (for "-", the larger comes first, so no result is
    negative). Problems whose instruction is in `exclude` are never drawn: pass a held-out set's
    instructions to keep train and eval apart. Returns the records written.
    """
    if n_examples <= 0:
        raise ValueError(f"n_examples must be positive, got {n_examples}")
    if max_operand < 0:
        raise ValueError(f"max_operand must be >= 0, got {max_operand}")
    unknown = sorted(set(operators) - set(OPERATORS))
    if not operators or unknown:
        raise ValueError(f"operators must be drawn from {''.join(OPERATORS)!r}, got {operators!r}")
    excluded = set(exclude)
    ops = sorted(set(operators), key=operators.index)
    rng = random.Random(seed)
    records: list[dict[str, str]] = []
    draws, max_draws = 0, 1000 + 100 * n_examples
    while len(records) < n_examples:
        draws += 1
        if draws > max_draws:
            raise ValueError(
                f"could not draw {n_examples} problems outside `exclude` in {max_draws} tries: raise max_operand "
                f"(now {max_operand}), add operators, or exclude fewer"
            )
        op = ops[rng.randrange(len(ops))]
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        if op == "-" and b > a:
            a, b = b, a
        record = arithmetic_record(a, b, op)
        if record["instruction"] not in excluded:
            records.append(record)

    atomic_write_text(path, "".join(json.dumps(record) + "\n" for record in records))
    return records


def exact_match(prediction: str, reference: str) -> bool:
    """True when the generated answer equals the reference, ignoring surrounding whitespace.

    Pass the decoded generation up to (not including) the eos token, e.g.
    `tokenizer.decode(new_tokens, skip_special_tokens=True)` after generation stopped at eos.
    """
    return prediction.strip() == reference.strip()


def write_arithmetic_preferences(
    path: str | Path, n_examples: int, seed: int, kind: str = "paired", exclude: Iterable[str] = ()
) -> list[dict]:
    """Write arithmetic preference records as JSONL, atomically: the right sum is preferred over the right sum
    followed by a stray digit ("81" over "817"), which a tiny model learns to tell apart in a few hundred steps.
    `kind` 'paired': {"prompt", "chosen", "rejected"} (DPO, ORPO, SimPO, CPO); 'unpaired': {"prompt",
    "completion", "label"}, right and wrong answers alternating (KTO). Returns the records written."""
    if kind not in ("paired", "unpaired"):
        raise ValueError(f"kind must be 'paired' or 'unpaired', got {kind!r}")
    rng = random.Random(seed)
    records: list[dict] = []
    for index, problem in enumerate(write_arithmetic_dataset(path, n_examples, seed, exclude=exclude)):
        right = problem["response"]
        wrong = right + str(rng.randint(0, 9))
        if kind == "paired":
            records.append({"prompt": problem["instruction"], "chosen": right, "rejected": wrong})
        else:
            label = index % 2 == 0
            records.append({"prompt": problem["instruction"], "completion": right if label else wrong, "label": label})
    atomic_write_text(path, "".join(json.dumps(record) + "\n" for record in records))
    return records
