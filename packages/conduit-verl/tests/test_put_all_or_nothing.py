"""A put over several Conduit storage units is all-or-nothing, and a failed put gives back only its own claims.

* Two puts that each span two units, with room on one unit for only one of them: both used to pass every unit's
  check before either stored, so the second's unit refused in the put phase while its other unit stored its part.
  A put now prepares its part on every unit (checked, and its samples reserved against ``max_items``) before any
  unit commits: the racing put is refused in its own prepare phase and leaves every unit as it was.
* A put that failed after unit 0 claimed its new field's kind gave the claim back while another put of that kind,
  which relied on the claim, was still storing: a third put could then claim the field in another kind, and the
  field ended up held in two kinds. A claim is now held by every put in flight that asked for it and goes only when
  the last of them gives it back without storing.

The puts run in real threads against real storage units (Ray actors); :class:`_Gates` holds a chosen put's calls to
the units at a chosen phase (a ``threading.Event`` says when it got there), so the interleaving is forced, not timed.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

pytestmark = pytest.mark.requires("verl")

#: how long a test waits for a thread to reach a gate or finish (a hang fails the test instead of blocking it)
WAIT_S = 120.0


# -- forcing the interleaving -------------------------------------------------------------------------
class _Gate:
    """Holds the unit calls of one put (its thread) until :meth:`open`; ``arrived`` is set when the first one
    got there."""

    def __init__(self, after: bool = False) -> None:
        self.after = after  # hold once the unit answered (the call ran there), not before sending it
        self.arrived = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._go: asyncio.Event | None = None

    async def wait(self) -> None:
        if self._go is None:
            self._loop, self._go = asyncio.get_running_loop(), asyncio.Event()
        self.arrived.set()
        await self._go.wait()

    def open(self) -> None:
        if self._loop is not None and self._go is not None:
            self._loop.call_soon_threadsafe(self._go.set)


class _GatedMethod:
    def __init__(self, method: Any, gate: _Gate) -> None:
        self.method, self.gate = method, gate

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        async def held() -> Any:
            if self.gate.after:
                out = await self.method.remote(*args, **kwargs)
                await self.gate.wait()
                return out
            await self.gate.wait()
            return await self.method.remote(*args, **kwargs)

        return held()


class _Gates:
    """The manager's unit handles, each wrapped: a call named in a gate's ``methods`` from a thread that registered
    that gate is held by it; every other call goes straight to the real unit."""

    def __init__(self) -> None:
        self.by_thread: dict[int, tuple[_Gate, tuple[str, ...]]] = {}

    def handle(self, real: Any) -> Any:
        gates = self

        class Handle:
            def __getattr__(self, name: str) -> Any:
                method = getattr(real, name)
                held = gates.by_thread.get(threading.get_ident())
                return _GatedMethod(method, held[0]) if held is not None and name in held[1] else method

        return Handle()


#: the calls of a put's store phase (before the fix every unit's ``put``, after it every unit's ``commit``)
STORE = ("put", "commit")


class _Put(threading.Thread):
    """One ``put_data`` on its own event loop in its own thread; ``error`` is what it raised (None: it stored)."""

    def __init__(self, manager: Any, data: TensorDict, meta: Any, gates: _Gates, gate: _Gate | None = None,
                 methods: tuple[str, ...] = STORE) -> None:
        super().__init__(daemon=True)
        self.manager, self.data, self.meta, self.gates = manager, data, meta, gates
        self.gate, self.methods = gate, methods
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[Any] | None = None

    def run(self) -> None:
        if self.gate is not None:
            self.gates.by_thread[threading.get_ident()] = (self.gate, self.methods)

        async def main() -> None:
            self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
            await self.manager.put_data(self.data, self.meta)

        try:
            asyncio.run(main())
        except BaseException as e:  # noqa: BLE001  (CancelledError included: the test inspects it)
            self.error = e
        finally:  # a later thread may get this thread's id
            self.gates.by_thread.pop(threading.get_ident(), None)

    def cancel(self) -> None:
        """Cancel the put (as an ``asyncio.wait_for`` timeout does) where it waits now."""
        assert self._loop is not None and self._task is not None
        self._loop.call_soon_threadsafe(self._task.cancel)

    def finish(self) -> BaseException | None:
        self.join(WAIT_S)
        assert not self.is_alive(), "a put did not finish"
        return self.error


def _reach(put: _Put) -> None:
    put.start()
    assert put.gate is not None and put.gate.arrived.wait(WAIT_S), "the put never reached its gate"


@contextmanager
def _gated(manager: Any) -> Iterator[_Gates]:
    gates, real = _Gates(), list(manager.units)
    manager.units = [gates.handle(u) for u in real]
    try:
        yield gates
    finally:
        manager.units = real


# -- the units' full state ----------------------------------------------------------------------------
def _state(manager: Any, tmp: Path) -> dict[int, dict[str, Any]]:
    """Every unit's fields, each as {global index: (shape row, values)} for tensors or {global index: value} for
    objects, read from the unit's own checkpoint; plus the sample counts its stats report."""
    import ray
    from conduit_verl.packing import from_wire

    out: dict[int, dict[str, Any]] = {}
    for rank, unit in enumerate(manager.units):
        path = tmp / f"state-{rank}.pt"
        ray.get(unit.save.remote(str(path)))
        saved = torch.load(path, weights_only=False)
        fields: dict[str, Any] = {}
        for name, f in saved["fields"].items():
            rows: dict[int, Any] = {}
            if f["gis"]:
                col = from_wire(f["column"], copy=True)
                values = col.values.split(col.lengths.tolist())
                for g, shape, v in zip(f["gis"], col.shapes.tolist(), values, strict=True):
                    rows[int(g)] = (f["dtype"], tuple(shape), v.tolist())
            fields[name] = rows
        for name, objs in saved["objects"].items():
            fields[name] = {int(g): v for g, v in objs.items()}
        stats = ray.get(unit.stats.remote())
        counts = {n: s["samples"] for n, s in stats["fields"].items()} | dict(stats["objects"])
        out[rank] = {"fields": fields, "counts": counts}
    return out


def _metas(client: Any, partition: str, keys: list[str]) -> Any:
    return client.kv_retrieve_meta(keys=keys, partition_id=partition, create=True)


def _key_on_unit(client: Any, partition: str, prefix: str, rank: int, units: int = 2) -> tuple[str, Any]:
    """One new key of ``partition`` whose global index routes to unit ``rank``, and its metadata."""
    for i in range(4 * units):
        meta = _metas(client, partition, [f"{prefix}{i}"])
        if int(meta.global_indexes[0]) % units == rank:
            return f"{prefix}{i}", meta
    raise AssertionError(f"no key of {prefix!r} routed to unit {rank}")


def _on_unit(client: Any, partition: str, prefix: str, rank: int, units: int = 2) -> Any:
    """Metadata of one new key whose global index routes to unit ``rank``."""
    return _key_on_unit(client, partition, prefix, rank, units)[1]


def _rows(values: list[float], uids: list[str]) -> TensorDict:
    n = len(values)
    return TensorDict({"r": torch.tensor(values, dtype=torch.float32).reshape(n, 1).expand(n, 2).contiguous(),
                       "uid": NonTensorStack(*uids)}, batch_size=[n])


def _expected(puts: list[tuple[Any, list[float], list[str]]]) -> dict[int, dict[str, Any]]:
    """The state of two units holding exactly ``puts`` (metadata, values, uids)."""
    out: dict[int, dict[str, Any]] = {r: {"fields": {"r": {}, "uid": {}}, "counts": {"r": 0, "uid": 0}}
                                      for r in range(2)}
    for meta, values, uids in puts:
        for g, v, u in zip(meta.global_indexes, values, uids, strict=True):
            unit = out[int(g) % 2]
            unit["fields"]["r"][int(g)] = ("float32", (1, 2), [v, v])  # shape row: ndim, then the shape
            unit["fields"]["uid"][int(g)] = u
            unit["counts"]["r"] += 1
            unit["counts"]["uid"] += 1
    return out


def _run(put: Callable[[], Any]) -> None:
    asyncio.run(put())


# -- gap 1: a put over several units is all-or-nothing ------------------------------------------------
@pytest.mark.slow
def test_racing_puts_over_two_units_store_all_or_nothing(tq_session: Any, tmp_path: Path) -> None:
    """Unit 0 has room for one more sample, unit 1 for two; two puts of one sample per unit race, the first held
    right before its store phase while the second runs whole. Exactly one may store; the other must raise
    CapacityError saying what to do and leave both units exactly as the winner alone leaves them (fields, indexes,
    values, counts). Once room is made, the refused put goes through: it left no reservation behind."""
    import transfer_queue as tq
    import verl  # noqa: F401  (verl loads its plugins: conduit-verl registers the "Conduit" backend)
    from conduit import CapacityError

    tq_session("Conduit", num_units=2, capacity=2, mean_length=2, max_items=2)
    client = tq.get_client()
    manager = client.storage_manager
    pre = _on_unit(client, "race", "pre", 0)
    _run(lambda: manager.put_data(_rows([9.0], ["pre"]), pre))
    one, two = _metas(client, "race", ["a0", "a1"]), _metas(client, "race", ["b0", "b1"])
    for meta in (one, two):
        assert sorted(int(g) % 2 for g in meta.global_indexes) == [0, 1], "each put must span both units"
    data = {"one": ([1.0, 2.0], ["a0", "a1"]), "two": ([3.0, 4.0], ["b0", "b1"])}

    with _gated(manager) as gates:
        first = _Put(manager, _rows(*data["one"]), one, gates, _Gate())
        _reach(first)  # every unit checked (or prepared) the first put; it waits before storing
        second = _Put(manager, _rows(*data["two"]), two, gates)
        second.start()
        second_error = second.finish()
        assert first.gate is not None
        first.gate.open()
        first_error = first.finish()

    errors = {"one": first_error, "two": second_error}
    refused = [k for k, e in errors.items() if e is not None]
    assert len(refused) == 1, f"exactly one of the two puts must be refused: {errors}"
    loser = refused[0]
    winner = "two" if loser == "one" else "one"
    err = errors[loser]
    assert isinstance(err, CapacityError), f"refused untyped: {err!r}"
    assert "max_items" in str(err) and "clear consumed samples" in str(err), f"says not what to do: {err}"
    metas = {"one": one, "two": two}
    want = _expected([(pre, [9.0], ["pre"]), (metas[winner], *data[winner])])
    got = _state(manager, tmp_path)
    assert got == want, (f"the refused put changed the units (loser {loser}, global indexes "
                         f"{list(metas[loser].global_indexes)}):\n got  {got}\n want {want}")

    _run(lambda: manager.clear_data(pre))  # room on unit 0 again: the refused put fits now
    _run(lambda: manager.put_data(_rows(*data[loser]), metas[loser]))
    want = _expected([(metas[winner], *data[winner]), (metas[loser], *data[loser])])
    assert _state(manager, tmp_path) == want, "the put refused before could not be stored once room was made"


# -- gap 2: a claim is held by every put in flight that relies on it -----------------------------------
class TestClaims:
    """The claim tests share one TransferQueue (``tq_shared``: two units, capacity 4, mean length 2); each puts its
    field under a name and in a partition of its own, so it claims a field no other test touched."""

    TQ_BACKEND = ("Conduit", {"num_units": 2, "capacity": 4, "mean_length": 2})

    @pytest.mark.slow
    def test_a_failed_put_keeps_the_claim_a_racing_put_of_its_kind_still_stores_under(self, tq_shared: Any,
                                                                                     tmp_path: Path) -> None:
        """Put A claims new field "f" as float32 and is held before storing; put B of "f" as float32 (to the other
        unit) passes the claim and is held before storing too; A is then cancelled. A third put of "f" as Python
        objects must be refused (SchemaError) and store nothing, B must store, and "f" must be held as float32
        tensors only (it used to be held as objects on one unit and float32 on the other)."""
        import transfer_queue as tq
        from conduit import SchemaError

        part, f = tq_shared("claim"), tq_shared("f")  # this test's partition and field
        client = tq.get_client()
        manager = client.storage_manager
        meta_a, meta_b = _on_unit(client, part, "a", 0), _on_unit(client, part, "b", 1)
        meta_c = _on_unit(client, part, "c", 0)

        with _gated(manager) as gates:
            a = _Put(manager, TensorDict({f: torch.tensor([[1.5]])}, batch_size=[1]), meta_a, gates, _Gate())
            _reach(a)  # A claimed "f" and waits before storing
            b = _Put(manager, TensorDict({f: torch.tensor([[2.5]])}, batch_size=[1]), meta_b, gates, _Gate())
            _reach(b)  # B passed the claim of "f" and waits before storing
            a.cancel()
            a_error = a.finish()
            assert isinstance(a_error, asyncio.CancelledError), f"put A should have been cancelled: {a_error!r}"
            c = _Put(manager, TensorDict({f: NonTensorStack("text")}, batch_size=[1]), meta_c, gates)
            c.start()
            c_error = c.finish()
            assert b.gate is not None
            b.gate.open()
            b_error = b.finish()

        assert b_error is None, f"put B, which passed the claim, was refused: {b_error!r}"
        assert isinstance(c_error, SchemaError), (f"a put of {f!r} as Python objects passed the claim while a put of "
                                                  f"it as float32 was storing: {c_error!r}")
        assert "tensor" in str(c_error) and "another field name" in str(c_error), f"says not what to do: {c_error}"
        got = _state(manager, tmp_path)
        held = {rank: u["fields"].get(f) for rank, u in got.items()}
        want_b = {int(meta_b.global_indexes[0]): ("float32", (1, 1), [2.5])}
        assert held == {0: None, 1: want_b}, f"{f!r} should be held by put B alone, as float32: {held}"

    @pytest.mark.slow
    def test_a_claim_goes_only_when_every_put_that_held_it_gave_it_back(self, tq_shared: Any, tmp_path: Path) -> None:
        """Puts A and B of new field "f" as float32 are each cancelled right after unit 0 answered their claim
        (neither stores). While B still holds the claim a put of "f" as objects is refused; once B gave it back too,
        the field is free and such a put stores (it used to stay claimed for good: a put cancelled while claiming
        never gave its claim back)."""
        import transfer_queue as tq
        from conduit import SchemaError

        part, f = tq_shared("hold"), tq_shared("f")  # this test's partition and field
        client = tq.get_client()
        manager = client.storage_manager
        meta_a, meta_b = _on_unit(client, part, "a", 0), _on_unit(client, part, "b", 1)
        meta_c, meta_d = _on_unit(client, part, "c", 0), _on_unit(client, part, "d", 1)
        objects = TensorDict({f: NonTensorStack("text")}, batch_size=[1])

        with _gated(manager) as gates:
            a = _Put(manager, TensorDict({f: torch.tensor([[1.5]])}, batch_size=[1]), meta_a, gates,
                     _Gate(after=True), methods=("claim",))
            _reach(a)
            b = _Put(manager, TensorDict({f: torch.tensor([[2.5]])}, batch_size=[1]), meta_b, gates,
                     _Gate(after=True), methods=("claim",))
            _reach(b)
            a.cancel()
            assert isinstance(a.finish(), asyncio.CancelledError)
            c = _Put(manager, objects, meta_c, gates)
            c.start()
            c_error = c.finish()
            assert isinstance(c_error, SchemaError), (f"put B still holds the claim of {f!r}, yet C passed it: "
                                                      f"{c_error!r}")
            b.cancel()
            assert isinstance(b.finish(), asyncio.CancelledError)
            d = _Put(manager, objects, meta_d, gates)
            d.start()
            d_error = d.finish()

        assert d_error is None, f"{f!r} stayed claimed after every put that held it failed without storing: {d_error!r}"
        held = {rank: u["fields"].get(f) for rank, u in _state(manager, tmp_path).items()}
        want_d = {int(meta_d.global_indexes[0]): "text"}
        assert held == {0: None, 1: want_d}, f"{f!r} should be D's object alone: {held}"


# -- the units' two phases, in process ------------------------------------------------------------------
def _wire(values: list[float]) -> dict[str, Any]:
    from conduit_verl.packing import PackedColumn, pack_column, to_wire

    col = pack_column(torch.tensor(values).reshape(-1, 1), len(values), "r")
    assert isinstance(col, PackedColumn)
    return {"r": to_wire(col), "uid": [f"u{v}" for v in values]}


def _unit_state(unit: Any) -> dict[str, Any]:
    return {"r": {g: unit.fields["r"].get([g]).values.tolist() for g in sorted(unit.fields["r"]._handle)}
            if "r" in unit.fields else {},
            "uid": dict(unit.objects.get("uid", {})), "pending": sorted(unit.pending)}


def test_prepared_samples_count_against_max_items_until_committed_or_aborted(tmp_path: Path) -> None:
    """A prepared put reserves its samples: a put (prepared or direct) that would not fit beside them is refused,
    typed, changing nothing; a clear of a reserved index does not let more in; abort frees the room; a restore drops
    the prepared puts, and committing one of them then is a typed error that says to put again."""
    from conduit import CapacityError, SchemaError
    from conduit_verl.tq_storage import DEFAULTS
    from conduit_verl.unit import _UnitState

    unit = _UnitState(dict(DEFAULTS, capacity=2, mean_length=2, max_items=2, num_units=2))
    unit.put([0], _wire([9.0]))
    unit.prepare("p", [2], _wire([1.0]))
    before = _unit_state(unit)
    for refused in (lambda: unit.prepare("q", [4], _wire([2.0])), lambda: unit.put([4], _wire([2.0]))):
        with pytest.raises(CapacityError, match="1 reserved by puts in flight"):
            refused()
        assert _unit_state(unit) == before, "a refused put changed the unit"
    unit.prepare("q", [0], _wire([5.0]))  # replaces a held sample: needs no room
    unit.clear([0])  # frees index 0, but "q" still brings it back: the room stays taken
    with pytest.raises(CapacityError):
        unit.prepare("r", [6], _wire([3.0]))
    unit.abort("q")
    unit.prepare("r", [6], _wire([3.0]))
    unit.commit("p", {})
    unit.commit("r", {})
    assert _unit_state(unit) == {"r": {2: [1.0], 6: [3.0]}, "uid": {2: "u1.0", 6: "u3.0"}, "pending": []}
    unit.save(str(tmp_path / "u.pt"))
    unit.clear([2, 6])
    unit.prepare("s", [8], _wire([4.0]))
    unit.load(str(tmp_path / "u.pt"))
    with pytest.raises(SchemaError, match="put the samples again"):
        unit.commit("s", {})
    assert _unit_state(unit) == {"r": {2: [1.0], 6: [3.0]}, "uid": {2: "u1.0", 6: "u3.0"}, "pending": []}


def test_a_claim_is_released_by_its_last_holder_only() -> None:
    """Holders "a" and "b" hold field f's claim: "a" giving it back leaves it ("b" may be storing); "b" giving it
    back frees it for another kind. A claim made without a holder stays."""
    from conduit import SchemaError
    from conduit_verl.tq_storage import DEFAULTS
    from conduit_verl.unit import _UnitState

    unit0 = _UnitState(dict(DEFAULTS, num_units=2))
    assert unit0.claim({"f": ("float32", 2)}, "a") == (["f"], {"f": ("float32", 2)})
    assert unit0.claim({"f": ("float32", 1)}, "b") == ([], {"f": ("float32", 2)})
    unit0.release("a")
    with pytest.raises(SchemaError, match="a put of it came first"):
        unit0.claim({"f": (None, 0)}, "c")
    unit0.release("c")  # holds nothing: changes nothing
    unit0.release("b")
    assert unit0.claim({"f": (None, 0)}, "d") == (["f"], {"f": (None, 0)}), "f stayed claimed with no holder left"
    unit0.claim({"g": ("int64", 1)})
    unit0.release("d")
    with pytest.raises(SchemaError):
        unit0.claim({"g": (None, 0)}, "e")
