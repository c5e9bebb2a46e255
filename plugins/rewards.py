"""Built-in reward functions: ``fn(completion, task) -> float``.

``task`` is the dataset row; the expected answer is read from ``task["answer"]``. For GSM8K
rows the answer field holds the worked solution ending in ``#### N``: only ``N`` counts.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

from areal_sdk.hookspecs import hookimpl

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_GSM8K_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
_BOXED = re.compile(r"\\boxed\{([^}]*)\}")


def _to_number(text: str) -> Decimal | None:
    try:
        return Decimal(text.replace(",", "").strip().rstrip("."))
    except (InvalidOperation, ValueError):
        return None


def reference_answer(task: Mapping[str, Any]) -> str:
    """The expected final answer of a task: after ``####`` if present, else the field."""
    raw = str(task.get("answer", ""))
    match = _GSM8K_FINAL.search(raw)
    return match.group(1) if match else raw.strip()


def final_number(completion: str) -> Decimal | None:
    """The number a completion commits to: ``#### N``, then ``\\boxed{N}``, then the last number."""
    for pattern in (_GSM8K_FINAL, _BOXED):
        found = pattern.findall(completion)
        if found:
            value = _to_number(found[-1])
            if value is not None:
                return value
    numbers = _NUMBER.findall(completion)
    return _to_number(numbers[-1]) if numbers else None


def numeric_match(completion: str, task: Mapping[str, Any]) -> float:
    """1.0 when the completion's final number equals the reference number, else 0.0."""
    expected = _to_number(reference_answer(task))
    got = final_number(completion)
    return float(expected is not None and got is not None and got == expected)


def exact_match(completion: str, task: Mapping[str, Any]) -> float:
    """1.0 when the stripped completion equals the stripped reference answer."""
    return float(completion.strip() == reference_answer(task))


def strict_answer_tag(completion: str, task: Mapping[str, Any]) -> float:
    """1.0 only for ``<answer>N</answer>`` holding the reference number: a strict format."""
    match = re.fullmatch(r"\s*<answer>\s*(-?[\d,]*\.?\d+)\s*</answer>\s*", completion)
    if match is None:
        return 0.0
    expected = _to_number(reference_answer(task))
    return float(expected is not None and _to_number(match.group(1)) == expected)


@hookimpl
def areal_reward_functions() -> Mapping[str, Callable[..., float]]:
    return {
        "numeric_match": numeric_match,
        "gsm8k": numeric_match,
        "exact_match": exact_match,
        "answer_tag": strict_answer_tag,
    }
