"""User transforms in the sidecar: loading them, isolating failing rows, and turning
their output rows into one Arrow batch per step for the ring.

Pure (no lancedb): `reading` hands these pieces to lancedb's own StreamingDataset,
which applies the transform per read batch in its transform thread pool and yields
the rows in the reference order; see docs/preprocessing.md.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from splitfeed.trainer_client.contract import errors, specs

PREVIEW_CHARS = 200
"""How much of a failing row an error message quotes."""


class Failed:
    """Stands in for the output row of an input row whose transform raised."""

    __slots__ = ("error", "preview")

    def __init__(self, error: BaseException, preview: str) -> None:
        self.error = error
        self.preview = preview


def load_transform(data: specs.DataSpec) -> Callable[[pa.RecordBatch], Any]:
    """Import spec.data.transform and bind spec.data.transformArgs; a UserError names it."""
    path = data.transform
    if not path:
        raise ValueError("the job has no spec.data.transform")
    module_name, _, attr = path.partition(":")
    where = (
        "install it in the sidecar image (FROM the splitfeed image) or mount it and put "
        "its directory on the sidecar's PYTHONPATH (README, 'Preprocessing')"
    )
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # any error raised while importing user code
        raise errors.UserError(
            f"spec.data.transform={path!r}: cannot import module {module_name!r}: "
            f"{type(exc).__name__}: {exc}; {where}"
        ) from exc
    for part in attr.split("."):
        if not hasattr(target, part):
            raise errors.UserError(
                f"spec.data.transform={path!r}: module {module_name!r} has no attribute {attr!r}"
            )
        target = getattr(target, part)
    if not callable(target):
        raise errors.UserError(f"spec.data.transform={path!r} is not callable ({type(target).__name__})")
    if data.transform_args:
        target = functools.partial(target, **data.transform_kwargs)
    return target  # type: ignore[no-any-return]


class Guarded:
    """The transform as StreamingDataset sees it: never raises for a bad row.

    A batch whose transform raises is re-run row by row (as lancedb does for
    skip), and each failing row becomes a `Failed` marker, so every split keeps
    its length and the caller decides (raise names the row, fill substitutes).
    A wrong row count is the transform's bug and fails the job naming it.
    Transforms must therefore be row-wise and deterministic, which lancedb's
    exact resume already requires (read batches start elsewhere after a resume).
    """

    def __init__(self, transform: Callable[[pa.RecordBatch], Any], name: str) -> None:
        self._transform = transform
        self.name = name

    def __call__(self, batch: pa.RecordBatch) -> list[Any]:
        try:
            rows = list(self._transform(batch))
        except Exception:  # noqa: BLE001 - any failure of user code is isolated per row
            return [self.one(batch.slice(j, 1)) for j in range(batch.num_rows)]
        self._check_count(len(rows), batch.num_rows)
        return rows

    def one(self, row: pa.RecordBatch) -> Any:
        """The output of a single-row batch, or a Failed marker."""
        try:
            rows = list(self._transform(row))
        except Exception as exc:  # noqa: BLE001 - see __call__
            return Failed(exc, repr(row.to_pylist()[0])[:PREVIEW_CHARS])
        self._check_count(len(rows), 1)
        return rows[0]

    def _check_count(self, got: int, want: int) -> None:
        if got != want:
            raise errors.UserError(
                f"spec.data.transform={self.name!r} returned {got} rows for a batch of {want}; "
                "a transform must return exactly one output row per input row (raise inside "
                "it for a bad row and set spec.data.onTransformError)"
            )


def failure_error(name: str, failed: Failed, *, epoch: int, split: int, position: int,
                  global_step: int) -> errors.DataError:
    """What onTransformError=raise fails the job with: the transform, the row, the error."""
    return errors.DataError(
        f"spec.data.transform={name!r} failed on the row at position {position} of split "
        f"{split} in epoch {epoch} (global step {global_step}): "
        f"{type(failed.error).__name__}: {failed.error}; row: {failed.preview}; "
        "fix the data (or filter it out with spec.data.filter), or set "
        "spec.data.onTransformError=fill"
    )


# --- rows -> one Arrow batch --------------------------------------------------------


def _row_fields(row: Any) -> tuple[list[str], Callable[[Any], list[Any]]]:
    """Column names of an output row and how to take its values.

    A mapping gives its keys, a tuple positional names "0", "1", ...; anything
    else is one column named "value".
    """
    if isinstance(row, Mapping):
        names = [str(k) for k in row]
        keys = list(row)
        return names, lambda r: [r[k] for k in keys]
    if isinstance(row, tuple):
        return [str(i) for i in range(len(row))], list
    return ["value"], lambda r: [r]


def _as_array(value: Any) -> np.ndarray | None:
    """A numeric numpy form of one value, or None when it has none."""
    if isinstance(value, np.ndarray):
        array = value
    elif type(value).__module__.split(".")[0] == "torch" and hasattr(value, "numpy"):
        array = value.detach().cpu().numpy()
    elif isinstance(value, (np.generic, int, float)) and not isinstance(value, bool):
        array = np.asarray(value)
    else:
        return None
    return array if array.dtype.kind in "iuf" else None


def _uniform(values: Sequence[Any]) -> tuple[tuple[int, ...], np.dtype[Any]] | None:
    """(shape, dtype) when every value is a numeric numpy array or scalar of one type.

    The common case (a transform returning numpy), checked without a per-value
    conversion: the general path below costs more than the copy it feeds.
    """
    first = values[0]
    kind = type(first)
    if kind is np.ndarray:
        shape, dtype = first.shape, first.dtype
        if dtype.kind in "iuf" and all(
            type(v) is np.ndarray and v.shape == shape and v.dtype == dtype for v in values
        ):
            return shape, dtype
    elif isinstance(first, np.generic) and first.dtype.kind in "iuf":
        if all(type(v) is kind for v in values):
            return (), first.dtype
    return None


def _stack(values: Sequence[Any], shape: tuple[int, ...], dtype: np.dtype[Any]) -> pa.Array:
    """One C-ordered copy of the values (whatever their strides): the slot's layout."""
    if not shape:
        return pa.array(np.fromiter(values, dtype, len(values)))
    out = np.empty((len(values), *shape), dtype)
    np.stack(values, out=out)  # a transposed array (HWC -> CHW) is read strided, written once
    return pa.FixedShapeTensorArray.from_numpy_ndarray(out)


def column(values: Sequence[Any]) -> pa.Array:
    """One column of a step's rows.

    Numeric values of one shape and dtype (numpy, torch, Python numbers) are
    stacked: scalars into a primitive column, arrays into a fixed_shape_tensor
    column that the trainer views as a (rows, *shape) tensor without a copy.
    Anything else goes through `pa.array` (strings, ragged lists, dicts as
    structs), which the trainer receives copied, as numpy object arrays.
    """
    uniform = _uniform(values)
    if uniform is not None:
        return _stack(values, *uniform)
    arrays = [_as_array(v) for v in values]
    first = arrays[0]
    if first is not None and all(
        a is not None and a.shape == first.shape and a.dtype == first.dtype for a in arrays
    ):
        return _stack(arrays, first.shape, first.dtype)
    return pa.array([v.tolist() if isinstance(v, np.ndarray) else v for v in values])


def collate(rows: Sequence[Any], name: str) -> pa.RecordBatch:
    """A step's output rows as one record batch, one column per field of the rows."""
    first = rows[0]
    if type(first) is dict:  # the common case, without a per-row _row_fields
        names = [str(k) for k in first]
        keys = tuple(first)
        if all(type(row) is dict and tuple(row) == keys for row in rows):
            return _batch([[row[k] for row in rows] for k in keys], names, name)
    names, values_of = _row_fields(first)
    columns: list[list[Any]] = [[] for _ in names]
    for row in rows:
        if _row_fields(row)[0] != names:
            raise errors.UserError(
                f"spec.data.transform={name!r} returned rows with different fields "
                f"({names} and {_row_fields(row)[0]}); every output row needs the same fields"
            )
        for out, value in zip(columns, values_of(row)):
            out.append(value)
    return _batch(columns, names, name)


def _batch(columns: list[list[Any]], names: list[str], name: str) -> pa.RecordBatch:
    try:
        arrays = [column(values) for values in columns]
    except (pa.ArrowException, ValueError, TypeError) as exc:
        raise errors.UserError(
            f"spec.data.transform={name!r} returned values Arrow cannot hold as columns: {exc}"
        ) from exc
    return pa.RecordBatch.from_arrays(arrays, names=names)
