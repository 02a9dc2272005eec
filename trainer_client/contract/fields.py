"""Reads manifest sections into frozen dataclasses by the `Rule` each field declares.

The engine under trainer_client/contract/specs.py: wire names (a field's camelCase twin),
required flags, unknown-field errors with a suggestion, the CRD's maxima, and the
value kinds every manifest shares (str, int, bool, strlist, strmap, map, version).
specs.py declares the StreamingJob's dataclasses and adds its own kinds in a `Reader`.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from typing import Any

from .errors import SplitfeedError


class SpecError(SplitfeedError, ValueError):
    """A manifest that does not describe a valid StreamingJob; names the field."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one spec field is read from a manifest; its wire name is the field's camelCase name.

    The dataclasses in specs.py declare each field once: its type and default in Python,
    its rule in the field's metadata. Parsing, required flags, defaults on the wire
    and MAXIMA all come from there (tests/crd checks the CRD against the same fields).
    """

    kind: str
    """str, int, bool, strlist, strmap, map, version, section, or one a `Reader` adds
    (specs.py: quantity, resumeFrom, importPath, jsonObject, onTransformError,
    blocksPerEpoch, packSequences)."""
    minimum: int | None = None
    maximum: int | None = None
    """The CRD's `maximum` (MAXIMA): keeps every piece of per-job work small."""
    model: type | None = None
    """For a section: the dataclass it parses into."""


def rule(kind: str, minimum: int | None = None, maximum: int | None = None,
         model: type | None = None) -> dict[str, Rule]:
    """A field's metadata: `dataclasses.field(metadata=fields.rule("int", 1))`."""
    return {"rule": Rule(kind, minimum, maximum, model)}


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


@dataclasses.dataclass(frozen=True)
class Field:
    name: str
    """The Python name; the wire name is its camelCase twin."""
    rule: Rule
    required: bool


def wire_fields(model: type) -> dict[str, Field]:
    """wire key -> field, for every field of `model` that a manifest spells (has a Rule)."""
    return {
        camel(f.name): Field(f.name, f.metadata["rule"],
                             f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        for f in dataclasses.fields(model) if "rule" in f.metadata
    }


def reject_unknown(path: str, raw: Mapping[str, Any], known: set[str]) -> None:
    """SpecError naming the first key of `raw` not in `known`, with the closest known one."""
    for key in raw:
        if key not in known:
            hint = difflib.get_close_matches(str(key), sorted(known), n=1)
            suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
            allowed = ", ".join(sorted(known))
            raise SpecError(
                f"{path}.{key}", f"unknown field{suggestion} (known fields: {allowed})"
            )


def maxima(path: str, model: type) -> dict[str, int]:
    """Wire path -> the rule's maximum, for every bounded field of `model` and its sections."""
    out: dict[str, int] = {}
    for key, field in wire_fields(model).items():
        if field.rule.model is not None and field.rule.kind == "section":
            out.update(maxima(f"{path}.{key}", field.rule.model))
        elif field.rule.maximum is not None:
            out[f"{path}.{key}"] = field.rule.maximum
    return out


# --- the kinds every manifest shares ----------------------------------------------

def to_str(path: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise SpecError(path, f"must be a non-empty string, got {value!r}")
    return value


def to_int(path: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(path, f"must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise SpecError(path, f"must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise SpecError(path, f"must be at most {maximum}, got {value}")
    return value


def _bool(path: str, rule: Rule, value: Any) -> bool:
    if not isinstance(value, bool):
        raise SpecError(path, f"must be true or false, got {value!r}")
    return value


def _strlist(path: str, rule: Rule, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(
        isinstance(v, str) and v for v in value
    ):
        raise SpecError(path, f"must be a non-empty list of column names, got {value!r}")
    if len(set(value)) != len(value):
        raise SpecError(path, f"lists a column twice: {value!r}")
    return tuple(value)


def _strmap(path: str, rule: Rule, value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise SpecError(path, f"must map strings to strings, got {value!r}")
    return dict(value)


def _map(path: str, rule: Rule, value: Any) -> dict[Any, Any]:
    if not isinstance(value, Mapping):
        raise SpecError(path, f"must be a mapping, got {value!r}")
    return dict(value)


def _version(path: str, rule: Rule, value: Any) -> int | str:
    """A number (within the rule's bounds) or a non-empty name (a tag)."""
    if isinstance(value, str):
        return to_str(path, value)
    return to_int(path, value, rule.minimum, rule.maximum)


Convert = Callable[[str, Rule, Any], Any]
"""Turns the manifest value at a path into the field's Python value, or raises SpecError."""

SHARED_KINDS: Mapping[str, Convert] = {
    "str": lambda path, rule, value: to_str(path, value),
    "int": lambda path, rule, value: to_int(path, value, rule.minimum, rule.maximum),
    "bool": _bool,
    "strlist": _strlist,
    "strmap": _strmap,
    "map": _map,
    "version": _version,
}


@dataclasses.dataclass(frozen=True)
class Reader:
    """Reads manifest sections with SHARED_KINDS plus a manifest's own `kinds`."""

    kinds: Mapping[str, Convert]
    """Converters by Rule.kind, beside SHARED_KINDS ("section" is the reader's own)."""
    checks: Mapping[type, Callable[[Any], None]] = dataclasses.field(default_factory=dict)
    """Rules between the fields of one section's dataclass, run once it is built and
    before the sections after it are read; each raises SpecError."""

    def convert(self, path: str, rule: Rule, value: Any) -> Any:
        convert = self.kinds.get(rule.kind) or SHARED_KINDS.get(rule.kind)
        if convert is None:
            raise AssertionError(f"unknown kind {rule.kind}")  # a bug in the declarations
        return convert(path, rule, value)

    def section(self, path: str, raw: Any, model: type) -> dict[str, Any]:
        """The keyword arguments of `model` from its manifest section `raw` at `path`.

        Leaf fields first, then nested sections, so that an error names the first field
        a reader of the section would find wrong."""
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise SpecError(path, f"must be a mapping, got {raw!r}")
        fields = wire_fields(model)
        reject_unknown(path, raw, set(fields))
        out: dict[str, Any] = {}
        ordered = sorted(fields.items(), key=lambda item: item[1].rule.kind == "section")
        for key, field in ordered:
            if key not in raw or (field.rule.kind != "section" and raw[key] is None):
                if field.required:
                    raise SpecError(f"{path}.{key}", "is required")
                continue
            if field.rule.kind == "section" and field.rule.model is not None:
                out[field.name] = self._subsection(f"{path}.{key}", raw[key], field.rule.model)
            else:
                out[field.name] = self.convert(f"{path}.{key}", field.rule, raw[key])
        return out

    def _subsection(self, path: str, raw: Any, model: type) -> Any:
        section = model(**self.section(path, raw, model))
        check = self.checks.get(model)
        if check is not None:
            check(section)  # rules between its fields, before later sections
        return section
