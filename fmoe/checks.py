"""Setting checks shared by fmoe's configs and optimizers (internal).

Every error names the setting, its value and what is allowed, in one form:
``Plan.remat='sometimes' is invalid: allowed: 'none', 'selective', 'full'`` (a config
field, ``where = "Plan.remat"``) or ``adamw lr=inf is invalid: ...`` (an argument,
``where = "adamw lr"``). ``bool`` is an ``int`` subclass in Python, but ``True`` is no
learning rate or layer count: numbers here exclude it. Config fields (``builtin=True``)
take Python's own ``int`` and ``float`` only, since configs are written to JSON;
optimizer arguments take any real number (a NumPy float is a fine learning rate).
"""

from __future__ import annotations

import math
import numbers


def is_number(value, builtin: bool = False) -> bool:
    """A real number that is not a bool (``builtin``: an ``int`` or a ``float``)."""
    return isinstance(value, (int, float) if builtin else numbers.Real) and not isinstance(value, bool)


def is_int(value, builtin: bool = False) -> bool:
    """An integer that is not a bool (``builtin``: an ``int``)."""
    return isinstance(value, int if builtin else numbers.Integral) and not isinstance(value, bool)


def fail(where: str, value, allowed: str):
    """Raise the ValueError for setting ``where`` holding ``value``."""
    raise ValueError(f"{where}={value!r} is invalid: {allowed}")


def check(where: str, value, ok: bool, allowed: str) -> None:
    """``fail`` unless ``ok``."""
    if not ok:
        fail(where, value, allowed)


def check_int(where: str, value, minimum: int, allowed_extra: str = "", builtin: bool = False) -> None:
    ok = is_int(value, builtin) and value >= minimum
    check(where, value, ok, f"must be an int >= {minimum}{allowed_extra}")


def check_choice(where: str, value, choices) -> None:
    check(where, value, value in choices, "allowed: " + ", ".join(repr(c) for c in choices))


def check_bool(where: str, value) -> None:
    check(where, value, isinstance(value, bool), "must be True or False")


def check_finite(where: str, value, positive: bool, allowed_extra: str = "") -> None:
    """A finite number, ``> 0`` (``positive``) or ``>= 0``."""
    ok = is_number(value) and math.isfinite(value) and (value > 0 if positive else value >= 0)
    check(where, value, ok, "must be a finite number " + ("> 0" if positive else ">= 0") + allowed_extra)


def check_positive(where: str, value, allow_zero: bool = False, allow_inf: bool = False) -> None:
    """A config field's number ``> 0`` (``>= 0`` with ``allow_zero``), finite unless
    ``allow_inf``. NaN compares false with everything, so it is refused explicitly (a
    NaN rate or eps trains a broken model with a finite loss)."""
    ok = is_number(value, builtin=True) and not math.isnan(value) and (allow_inf or not math.isinf(value))
    ok = ok and value >= 0 and (value > 0 or allow_zero)
    check(where, value, ok, "must be a finite number " + (">= 0" if allow_zero else "> 0")
          + (", or inf" if allow_inf else ""))


def check_decay(where: str, value) -> None:
    """A decay rate in ``[0, 1)`` (Adam's betas)."""
    check(where, value, is_number(value) and 0.0 <= value < 1.0, "must be in [0, 1)")


def check_lr(where: str, lr) -> None:
    """A learning rate: a finite number ``> 0``, or a schedule (a function of the update count)."""
    ok = callable(lr) or (is_number(lr) and math.isfinite(lr) and lr > 0)
    check(where, lr, ok, "must be a finite number > 0 or a schedule (a function of the update count)")
