"""``ExperienceBatch.checked`` takes its single-pass path for NumPy columns too (as for tensors), and what it returns
or raises is exactly what the full path (``from_mapping`` then ``validate``) returns or raises: the same columns,
dtypes, shapes and values, sharing the caller's arrays where that path shares them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from conduit import ExperienceSchema, Field, SchemaError
from conduit.batch import ExperienceBatch

SCHEMA = ExperienceSchema({"obs": Field((4, 3), torch.float32), "id": Field((), torch.int64),
                           "done": Field((4,), torch.bool)})
N = 5


def _columns() -> dict[str, Any]:
    return {"obs": np.arange(N * 12, dtype=np.float32).reshape(N, 4, 3), "id": np.arange(N, dtype=np.int64),
            "done": (np.arange(N * 4) % 3 == 0).reshape(N, 4)}


def _full_path(data: dict[str, Any]) -> ExperienceBatch:
    b = ExperienceBatch.from_mapping(data)
    b.validate(SCHEMA)
    return b


def _readonly(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


VARIANTS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "numpy": lambda d: d,
    "numpy-and-tensor": lambda d: {**d, "id": torch.from_numpy(d["id"])},
    "field-order": lambda d: {k: d[k] for k in ("done", "id", "obs")},
    "non-contiguous": lambda d: {**d, "obs": np.swapaxes(np.ascontiguousarray(np.swapaxes(d["obs"], 0, 1)), 0, 1)},
    "big-endian": lambda d: {**d, "obs": d["obs"].astype(">f4")},
    "read-only": lambda d: {**d, "id": _readonly(d["id"].copy())},
    "empty": lambda d: {k: v[:0] for k, v in d.items()},
}


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_numpy_columns_give_the_full_paths_batch(variant: str) -> None:
    data = VARIANTS[variant](_columns())
    got, want = ExperienceBatch.checked(data, SCHEMA), _full_path(data)
    assert got.batch_size == want.batch_size == (0 if variant == "empty" else N)
    assert list(got) == list(want) == list(data), "the columns' names or order differ"
    for name in want:
        g, w = got.tensor(name), want.tensor(name)
        assert (g.dtype, g.shape, g.stride()) == (w.dtype, w.shape, w.stride()), name
        assert torch.equal(g, w), f"{name}: values differ"
        given = data[name]
        if isinstance(given, np.ndarray) and given.dtype.isnative and given.flags.c_contiguous and given.size:
            # the full path shares such an array (no copy); so must the single pass
            assert g.data_ptr() == w.data_ptr() == given.ctypes.data, f"{name}: the array was copied"
    # the result is marked valid for the schema, as the full path marks it
    got.validate(SCHEMA)


BAD: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "float64-for-float32": lambda d: {**d, "obs": d["obs"].astype(np.float64)},
    "item-shape": lambda d: {**d, "obs": d["obs"].reshape(N, 3, 4)},
    "lengths": lambda d: {**d, "id": d["id"][:-1]},
    "missing": lambda d: {k: v for k, v in d.items() if k != "done"},
    "extra": lambda d: {**d, "more": d["id"]},
    "masked": lambda d: {**d, "id": np.ma.masked_array(d["id"], mask=d["id"] == 2)},
    "object": lambda d: {**d, "id": d["id"].astype(object)},
    "scalar": lambda d: {**d, "id": np.int64(3)},
    "list": lambda d: {**d, "id": d["id"].tolist()},
}


@pytest.mark.parametrize("variant", list(BAD))
def test_numpy_columns_the_schema_refuses_are_refused_as_the_full_path_refuses_them(variant: str) -> None:
    data = BAD[variant](_columns())
    try:
        want: object = _full_path(data)
    except Exception as e:  # noqa: BLE001 - compared below
        want = (type(e), str(e))
    try:
        got: object = ExperienceBatch.checked(data, SCHEMA)
    except Exception as e:  # noqa: BLE001 - compared below
        got = (type(e), str(e))
    if isinstance(want, ExperienceBatch):  # (a list of ints is read as the int64 column it holds)
        assert isinstance(got, ExperienceBatch) and variant == "list"
        assert all(torch.equal(got.tensor(k), want.tensor(k)) for k in want)
    else:
        assert got == want
        assert issubclass(want[0], SchemaError), want  # type: ignore[index]


def test_numpy_columns_take_the_single_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """NumPy columns that match the schema are not sent through ``from_mapping`` and ``validate`` (the full path
    cost a NumPy ``put`` several times a tensor's)."""
    calls: list[str] = []
    real_from, real_validate = ExperienceBatch.from_mapping.__func__, ExperienceBatch.validate  # type: ignore[attr-defined]

    def from_mapping(cls: type[ExperienceBatch], data: Any) -> ExperienceBatch:
        calls.append("from_mapping")
        return real_from(cls, data)

    def validate(self: ExperienceBatch, schema: ExperienceSchema) -> None:
        calls.append("validate")
        real_validate(self, schema)

    monkeypatch.setattr(ExperienceBatch, "from_mapping", classmethod(from_mapping))
    monkeypatch.setattr(ExperienceBatch, "validate", validate)
    b = ExperienceBatch.checked(_columns(), SCHEMA)
    assert calls == [], f"NumPy columns took the full path ({calls})"
    assert b.batch_size == N
    with pytest.raises(SchemaError):
        ExperienceBatch.checked({**_columns(), "obs": _columns()["obs"].astype(np.float64)}, SCHEMA)
    assert calls == ["from_mapping", "validate"], "a column the schema refuses must take the full path (its message)"


@pytest.mark.parametrize("as_given", [lambda d: {k: torch.from_numpy(v) for k, v in d.items()}, lambda d: d],
                         ids=["tensors", "numpy"])
def test_the_checked_batch_keeps_its_columns_when_the_callers_dict_changes(
        as_given: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """The single pass keeps a dict of its own: a key the caller removes or replaces afterwards is still there, as
    it was, in the batch (which stays valid for the schema)."""
    data = as_given(_columns())
    b = ExperienceBatch.checked(data, SCHEMA)
    ids = b["id"]
    del data["obs"]
    data["id"] = torch.zeros(N, dtype=torch.int64)
    assert set(b) == {"obs", "id", "done"} and b["id"] is ids and len(b) == 3
    assert torch.equal(b.tensor("id"), torch.arange(N))
    b.validate(SCHEMA)
