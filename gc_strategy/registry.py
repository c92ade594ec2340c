"""Name registries with validated options.

Every pluggable role (compressor, memory, communicator) is a class registered under a short name.
A class declares the options it accepts as :class:`Option` entries in ``OPTIONS``; building it by
name checks the name, refuses unknown option keys and checks each value against its declared range,
so bad input fails at construction with a message that names the option, the value and what is
allowed, before any training work starts.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice a misspelled ``word`` most likely meant: the same letters in another case, the one
    choice it begins (``comm`` for ``communicator``), or difflib's closest match; None if none is close."""
    choices = list(choices)
    by_lower = {choice.lower(): choice for choice in choices}
    if word.lower() in by_lower:
        return by_lower[word.lower()]
    beginning = [choice for choice in choices if len(word) >= 3 and choice.startswith(word)]
    if len(beginning) == 1:
        return beginning[0]
    matches = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return matches[0] if matches else None


@dataclass(frozen=True)
class Option:
    """One keyword option of a registered class or a :class:`Configuration`.

    ``kind`` is ``float``, ``int``, ``bool``, ``str`` or ``callable``; numeric options may have a
    lower and an upper bound (``low_open``/``high_open`` make them exclusive); string options may
    have ``choices``, which a numeric option also accepts beside its numbers (``fragments``: an
    integer or ``"auto"``); ``optional`` accepts None as well.
    """

    default: Any
    kind: type = float
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] | None = None
    optional: bool = False
    help: str = ""

    def allowed(self) -> str:
        """A human-readable description of the valid values."""
        described = self._kind_allowed()
        if self.kind in (int, float) and self.choices is not None:
            described += " or " + " or ".join(repr(c) for c in self.choices)
        return described + (" or None" if self.optional else "")

    def _kind_allowed(self) -> str:
        if self.kind is bool:
            return "true or false"
        if self.kind is callable:
            return "a callable"
        if self.kind is str and self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        name = {float: "a number", int: "an integer", str: "a string"}[self.kind]
        if self.low is None and self.high is None:
            return name
        left = "(" if self.low_open or self.low is None else "["
        right = ")" if self.high_open or self.high is None else "]"
        low = "-inf" if self.low is None else f"{self.low:g}"
        high = "inf" if self.high is None else f"{self.high:g}"
        return f"{name} in {left}{low}, {high}{right}"

    def validate(self, owner: str, name: str, value: Any) -> Any:
        """Return ``value`` converted to ``kind``, or raise ``ValueError`` naming what is wrong."""

        given = value

        def refuse() -> ValueError:
            return ValueError(f"{owner}: option '{name}' = {given!r} is invalid; allowed: {self.allowed()}")

        if value is None and self.optional:
            return None
        if self.kind is bool:
            if not isinstance(value, bool):
                raise refuse()
            return value
        if self.kind is callable:
            if not callable(value):
                raise refuse()
            return value
        if self.kind is not str and self.choices is not None and isinstance(value, str) and value in self.choices:
            return value
        if self.kind is str:
            if not isinstance(value, str) or (self.choices is not None and value not in self.choices):
                raise refuse()
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise refuse()
        if self.kind is int and not float(value).is_integer():
            raise refuse()
        value = self.kind(value)
        if not math.isfinite(value):
            raise refuse()
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            raise refuse()
        if self.high is not None and (value > self.high or (self.high_open and value == self.high)):
            raise refuse()
        return value


def validate_options(owner: str, declared: Mapping[str, Option], options: Mapping[str, Any]) -> dict[str, Any]:
    """Every option of ``declared``, from ``options`` or its default, each checked and converted;
    an unknown key is refused with the accepted ones (and the one it most likely meant), and so is
    a missing one that has no default (None, where None is not allowed)."""
    unknown = sorted(set(options) - set(declared))
    if unknown:
        match = closest(unknown[0], declared)
        hint = f" (did you mean {match!r}?)" if match else ""
        accepted = ", ".join(sorted(declared)) or "none"
        raise ValueError(f"{owner} does not take option(s) {', '.join(unknown)}{hint}; it accepts: {accepted}")
    for key, option in declared.items():
        if key not in options and option.default is None and not option.optional:
            what = f" ({option.help})" if option.help else ""
            raise ValueError(f"{owner} needs option '{key}'{what}; allowed: {option.allowed()}")
    return {key: option.validate(owner, key, options.get(key, option.default)) for key, option in declared.items()}


class Configuration:
    """A small validated configuration object (a sync mode, the hierarchy): its class declares its
    options in ``OPTIONS`` (defaults written there alone), and construction checks every value as
    a registered role's options are checked."""

    OPTIONS: dict[str, Option] = {}

    def __init__(self, **options: Any) -> None:
        self.options = validate_options(type(self).__name__, self.OPTIONS, options)
        for key, value in self.options.items():
            setattr(self, key, value)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.options == self.options

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted((k, repr(v)) for k, v in self.options.items()))))

    def __repr__(self) -> str:
        changed = ", ".join(f"{k}={v!r}" for k, v in self.options.items() if v != self.OPTIONS[k].default)
        return f"{type(self).__name__}({changed})"


def fresh_copy(role: T) -> T:
    """A new instance of a built role with the same validated options and fresh state."""
    return type(role)(**role.options)


class Registry(Generic[T]):
    """Maps names to classes that declare their options in a class attribute ``OPTIONS``."""

    def __init__(self, role: str) -> None:
        self.role = role
        self._classes: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        def add(cls: type[T]) -> type[T]:
            if name in self._classes:
                raise ValueError(f"{self.role} '{name}' is registered twice")
            cls.name = name  # type: ignore[attr-defined]
            self._classes[name] = cls
            return cls

        return add

    def names(self) -> list[str]:
        return sorted(self._classes)

    def get(self, name: str) -> type[T]:
        if not isinstance(name, str) or name not in self._classes:
            match = closest(name, self.names()) if isinstance(name, str) else None
            hint = f" (did you mean {match!r}?)" if match else ""
            raise ValueError(f"unknown {self.role} {name!r}{hint}; valid names: {', '.join(self.names())}")
        return self._classes[name]

    def options(self, name: str) -> Mapping[str, Option]:
        return getattr(self.get(name), "OPTIONS", {})

    def build(self, name: str, **options: Any) -> T:
        """Instantiate ``name`` with validated ``options`` (declared defaults fill the rest)."""
        return self.get(name)(**validate_options(f"{self.role} '{name}'", self.options(name), options))
