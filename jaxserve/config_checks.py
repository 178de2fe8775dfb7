"""The engine configuration's validation helpers: each failure a `ValueError` naming the field."""

from __future__ import annotations

import dataclasses


def check(cond: bool, name: str, value, must: str) -> None:
    """Raises `ValueError("{name} must be {must}, got {value!r}")` unless `cond`."""
    if not cond:
        raise ValueError(f"{name} must be {must}, got {value!r}")


def is_int(value) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_num(value) -> bool:
    """An int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_types(obj) -> None:
    """Type checks from the dataclass annotations, so a wrong type is a ValueError too."""
    for f in dataclasses.fields(obj):
        value, kind = getattr(obj, f.name), str(f.type)
        if value is None and "None" in kind:
            continue
        if kind.startswith("int"):
            check(is_int(value), f.name, value, "an integer")
        elif kind.startswith("float"):
            check(is_num(value), f.name, value, "a number")
        elif kind.startswith("bool"):
            check(isinstance(value, bool), f.name, value, "True or False")
        elif kind.startswith("str"):
            check(isinstance(value, str), f.name, value, "a string")
