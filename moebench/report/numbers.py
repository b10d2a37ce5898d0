"""Numbers as the report reads them from results files: one decoder, used wherever a section, figure or verdict
takes a number from a file.

A results file holds a non-finite float as a string ("nan", "inf", "-inf": moebench.results.to_jsonable; the
schemas' `real` / `real_or_null` allow them), and a field the schema leaves open may hold anything. `real` turns
the three strings into math.nan / math.inf / -math.inf, keeps a number as it is and calls anything else (null,
another string, a bool, a list) "no number" (None): a report never compares or formats a string as a number,
which is how a "nan" beside floats crashed it (issue 37)."""

from __future__ import annotations

import math
from typing import Any

NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
"""What results.to_jsonable writes for a non-finite float, and the float it stands for."""


def real(value: Any) -> int | float | None:
    """A number from a results file: an int or float as it is, "nan" / "inf" / "-inf" decoded; None for anything
    else (no number)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        return NONFINITE.get(value)
    return None


def finite(value: Any) -> int | float | None:
    """`real`, with a non-finite number counted as no number too (a sum, an axis limit, a mean)."""
    number = real(value)
    return number if number is not None and math.isfinite(number) else None


def is_nonfinite(value: Any) -> bool:
    """Whether `value` decodes to NaN or an infinity."""
    number = real(value)
    return number is not None and not math.isfinite(number)


def nonfinite_text(number: float) -> str:
    """How a table or figure shows a non-finite number: "nan", "inf" or "-inf"."""
    return "nan" if math.isnan(number) else "inf" if number > 0 else "-inf"


def text(value: Any, spec: str = ".4g", *, missing: str = "—") -> str:
    """`value` formatted with `spec` (format()'s mini-language); "nan" / "inf" / "-inf" for a non-finite one,
    `missing` for no number."""
    number = real(value)
    if number is None:
        return missing
    if not math.isfinite(number):
        return nonfinite_text(number)
    try:
        return format(number, spec)
    except ValueError:  # an integer spec (",d") given a float
        return format(float(number), spec.replace("d", "f")) if spec.endswith("d") else str(number)
