"""The storage unit of Conduit's TransferQueue backend: the Ray actor that holds the samples.

:class:`ConduitStorageUnit` (one or more per cluster, started by :func:`conduit_verl.tq_storage.bootstrap`) wraps a
:class:`_UnitState`: every tensor field a :class:`~conduit_verl.columns.FieldStore`, every Python-object field a dict.

This module is what a unit's process imports (Ray loads the actor class from it), so it imports neither TransferQueue,
tensordict nor omegaconf (nor :mod:`conduit_verl.tq_storage` or :mod:`conduit_verl.compat`, which do): a unit starts
in about the time ``import torch, conduit`` takes. What crosses a Ray call to a unit is plain: wire columns
(:func:`~conduit_verl.packing.to_wire`: NumPy arrays) and lists of the Python objects put (a put's objects that are
tensordict objects import tensordict when Ray unpickles them in the unit). A read of a sample or field the unit does
not hold raises :mod:`conduit_verl.unit_errors`' stand-in, which reaches the caller as
:class:`conduit_verl.compat.MissingKeyError` / :class:`~conduit_verl.compat.MissingFieldError`.
"""

from __future__ import annotations

import logging
import time
from typing import Any, cast

import ray
import torch
from conduit import SchemaError, Telemetry

from conduit_verl.columns import (
    Appended,
    FieldStore,
    Migration,
    PoolLadder,
    check_indexes,
    dtype_error,
    kind_error,
    rank_error,
)
from conduit_verl.packing import PackedColumn, from_wire, objects_from_wire, objects_to_wire, select_rows, to_wire
from conduit_verl.unit_errors import missing_field, missing_key

__all__ = ["ConduitStorageUnit", "LEASE_CHECK_S", "unit_name"]

logger = logging.getLogger(__name__)


def unit_name(run_id: str, rank: int) -> str:
    """The Ray actor name of storage unit ``rank`` of the units :func:`~conduit_verl.tq_storage.bootstrap` started
    under ``run_id`` (in the namespace ``transfer_queue``)."""
    return f"ConduitStorageUnit#{run_id}#{rank}"


#: how a claim on unit 0 says why the field's kind is settled
_CAME_FIRST = " (a put of it came first)"


class _UnitState:
    """What one storage unit holds (plain Python; the Ray actor wraps it)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.ladder_args: dict[str, Any] = dict(items=int(config["capacity"]),
                                                elements=int(config["capacity"]) * int(config["mean_length"]),
                                                growth=float(config["growth"]), max_items=config.get("max_items"),
                                                pin_memory=torch.cuda.is_available())
        self.num_units = int(config.get("num_units", 1))
        self.fields: dict[str, FieldStore] = {}
        self.objects: dict[str, dict[int, Any]] = {}
        #: used on unit 0 only: field -> (dtype name, or None for Python objects; shape-row width) of each field a
        #: put claimed there (:meth:`claim`) before storing it on any unit
        self.claims: dict[str, tuple[str | None, int]] = {}
        #: used on unit 0 only: field -> the puts (their tokens) that hold its claim; a claim goes when the last
        #: holder gives it back (:meth:`release`), and stays for good once a holder is about to store (:meth:`keep`)
        self.holders: dict[str, set[str]] = {}
        #: used on unit 0 only: token of a put holding claims -> its lease (a Ray object the putting process owns):
        #: the claims of a put whose process died before it kept or gave them back go (:meth:`_forget_dead_holders`)
        self.leases: dict[str, Any] = {}
        #: puts prepared here and not yet committed or aborted: token -> (global indexes, wire columns, lease: a Ray
        #: object the putting process owns, lost when it dies, or None)
        self.pending: dict[str, tuple[list[int], dict[str, Any], Any]] = {}
        #: token of a prepared put -> its global indexes a clear named after it was prepared (its commit skips them)
        self.cleared: dict[str, set[int]] = {}
        #: a checkpoint read by :meth:`stage` and not yet installed: (tensor fields, object fields)
        self.staged: tuple[dict[str, FieldStore], dict[str, dict[int, Any]]] | None = None
        #: how many checkpoints this unit installed (:meth:`install_staged`, which drops the claims); on unit 0, a
        #: client's cached claims hold only in the generation unit 0 confirmed them in
        self.generation = 0
        self.telemetry = Telemetry()

    def check(self, gis: list[int], columns: dict[str, Any], widths: dict[str, int] | None = None,
              reserved: dict[str, set[int]] | None = None
              ) -> tuple[dict[str, PackedColumn | list[Any]], dict[str, FieldStore]]:
        """Raise what :meth:`put` would raise for this input, changing nothing; returns the decoded
        columns and the store each tensor column goes to (new stores are not kept yet).

        ``reserved`` (field -> global indexes that prepared puts will store, :meth:`prepare`) count against
        ``max_items`` as if stored.

        With no ``gis`` (zero-row columns) it checks only that each field agrees in kind, dtype and rank
        with what this unit holds: the manager asks so of the units a put does not reach.

        ``widths`` (field -> shape-row width held on other units) sizes a field new to this unit: a field
        keeps the rank limit of its first put on any unit, as it does on one unit (lower ranks are padded).

        Raises:
            SchemaError: a field switched kind, dtype or rank, a column's length is not ``len(gis)``, or ``gis``
                names a global index twice.
            CapacityError: a field (tensors or Python objects) would exceed ``max_items``.
        """
        decoded: dict[str, PackedColumn | list[Any]] = {}
        for name, w in columns.items():
            kind_is_tensor = isinstance(w, dict)
            if kind_is_tensor and name in self.objects or not kind_is_tensor and name in self.fields:
                held, brought = ("Python objects", "tensors") if kind_is_tensor else ("tensors", "Python objects")
                raise kind_error(name, held, brought)
            decoded[name] = from_wire(w) if kind_is_tensor else w
        stores: dict[str, FieldStore] = {}
        for name, col in decoded.items():  # every column is checked before any is written
            if isinstance(col, PackedColumn):
                store = self.fields.get(name)
                if store is None and not gis:  # nothing held to disagree with, nothing to store
                    continue
                if store is None:
                    width = max(col.shapes.shape[1], (widths or {}).get(name, 0))
                    store = FieldStore(name, col.dtype, width, PoolLadder(**self.ladder_args))
                store.check(gis, col, (reserved or {}).get(name, ()))
                stores[name] = store
            elif len(col) != len(gis):
                raise SchemaError(f"Field {name!r}: {len(col)} values for {len(gis)} global indexes.")
            else:
                check_indexes(name, [int(g) for g in gis], self.objects.get(name, {}), self.ladder_args["max_items"],
                              (reserved or {}).get(name, ()))
        return decoded, stores

    def _reserved(self, but: str | None = None) -> dict[str, set[int]]:
        """field -> the global indexes the prepared puts (all but the one of token ``but``) will store."""
        out: dict[str, set[int]] = {}
        for token, (gis, columns, _) in self.pending.items():
            if token != but:
                for name in columns:
                    out.setdefault(name, set()).update(gis)
        return out

    def prepare(self, token: str, gis: list[int], columns: dict[str, Any], lease: Any = None) -> dict[str, int]:
        """First phase of a put over several units: raise what :meth:`commit` would raise, and keep the columns
        under ``token`` with their samples reserved (a later put that would not fit beside them is refused here, so
        a prepared put's commit is not refused for room); returns what :meth:`held_widths` returns.

        ``lease``: a Ray ``ObjectRef`` the putting process owns. Ray loses the object with its owner, so when that
        process dies before committing or aborting, the reservation goes at the next prepare or put here that sees
        the loss (Ray reports it within seconds). Without a lease the reservation stays until commit, abort or
        :meth:`load`.

        Raises:
            SchemaError, CapacityError: as :meth:`check` (nothing is kept).
        """
        gis = [int(g) for g in gis]
        self._forget_dead_puts()
        _, stores = self.check(gis, columns, None, self._reserved(but=token))
        self.pending[token] = (gis, columns, lease)
        return self.held_widths(stores)

    def _forget_dead_puts(self) -> None:
        """Drop the prepared puts whose lease Ray lost with the process that owned it (it can no longer commit)."""
        for token in [t for t, (_, _, lease) in self.pending.items() if _owner_died(lease)]:
            del self.pending[token]
            self.cleared.pop(token, None)
            logger.warning("Conduit storage unit: dropped the put prepared under %s, whose process died before it "
                           "committed", token)

    def commit(self, token: str, widths: dict[str, int] | None = None) -> None:
        """Store the put prepared under ``token`` (``widths``: see :meth:`check`).

        Raises:
            SchemaError: no put is prepared under ``token`` (it was aborted, or a checkpoint restore dropped it):
                put the samples again.
        """
        if token not in self.pending:
            raise SchemaError(f"No put prepared under {token!r} on this Conduit storage unit (aborted, or dropped by "
                              f"a checkpoint restore); put the samples again.")
        gis, columns, _ = self.pending[token]
        gone = self.cleared.get(token)
        if gone:  # cleared after it reached this unit (:meth:`clear`)
            gis, columns = _without_rows(gis, columns, gone)
        if gis:
            self._write(gis, columns, widths, self._reserved(but=token))
        del self.pending[token]
        self.cleared.pop(token, None)

    def abort(self, token: str) -> None:
        """Drop the put prepared under ``token`` (its reservations go; unknown tokens are ignored)."""
        self.pending.pop(token, None)
        self.cleared.pop(token, None)

    def _kind_of(self, name: str) -> tuple[str | None, int] | None:
        """(dtype name or None for Python objects, shape-row width) of field ``name`` as claimed or held here."""
        if name in self.claims:
            return self.claims[name]
        if name in self.fields:
            store = self.fields[name]
            return str(store.dtype).removeprefix("torch."), store.width
        if name in self.objects:
            return None, 0
        return None

    def claim(self, kinds: dict[str, tuple[str | None, int]], holder: str | None = None, lease: Any = None
              ) -> tuple[list[str], dict[str, tuple[str | None, int]]]:
        """Check-and-set of the fields' kinds (the unit's calls are serialised, so of two racing first puts of a
        field in different kinds or dtypes, the second is refused here before it stores anything; of two in different
        ranks, the second is refused only when it brings the higher rank: a lower-rank one is accepted, and padded to
        the rank limit claimed first: whether both store or only the lower-rank one depends on which claim reaches
        this unit first).

        ``kinds``: field -> (dtype name, or None for Python objects; the column's shape-row width). Every field is
        checked against what was claimed (or is held) here before any is claimed; a field new here is claimed with
        the put's kind. ``holder`` (the put's token) holds every claim of ``kinds`` (new or already claimed): a claim
        is forgotten only when every put that held it gave it back (:meth:`release`: each failed before storing),
        and by :meth:`load`; once a holder is about to store, the claim is kept for good (:meth:`keep`), as claims of
        no holder are.

        ``lease`` (a Ray ``ObjectRef`` the putting process owns, lost when it dies): when that process dies before it
        kept or gave back its claims, they are given back at the next claim here that sees the loss (Ray reports it
        within seconds), so a dead client's claim does not fix the kind of a field that nothing stores. Without a
        lease they stay until kept, given back, or :meth:`load`.

        Returns:
            The fields this call claimed, and each field's claimed (dtype, width) (a lower-rank put of a tensor
            field is padded to the claimed width).

        Raises:
            SchemaError: a field was claimed (or is held) in another kind or dtype, or with a lower rank; nothing
                is claimed.
        """
        self._forget_dead_holders()
        for name, (dtype, width) in kinds.items():
            have = self._kind_of(name)
            if have is None:
                continue
            held_dtype, held_width = have
            if (held_dtype is None) != (dtype is None):
                held, brought = ("Python objects", "tensors") if dtype is not None else ("tensors", "Python objects")
                raise kind_error(name, held, brought, _CAME_FIRST)
            if dtype is not None and dtype != held_dtype:
                raise dtype_error(name, f"torch.{held_dtype}", f"torch.{dtype}", _CAME_FIRST)
            if dtype is not None and width > held_width:
                raise rank_error(name, held_width, width, _CAME_FIRST)
        new = [name for name in kinds if self._kind_of(name) is None]
        for name in new:
            self.claims[name] = kinds[name]
            if holder is not None:
                self.holders[name] = set()
        if holder is not None:
            for name in kinds:
                if name in self.holders:
                    self.holders[name].add(holder)
                    if lease is not None:
                        self.leases[holder] = lease
        return new, {name: cast("tuple[str | None, int]", self._kind_of(name)) for name in kinds}

    def release(self, holder: str) -> None:
        """Give back the claims ``holder`` holds (its put failed before storing anything); a claim another put still
        holds stays (that put may be storing the field), the others are forgotten."""
        self.leases.pop(holder, None)
        for name in [n for n, held_by in self.holders.items() if holder in held_by]:
            self.holders[name].discard(holder)
            if not self.holders[name]:
                del self.holders[name]
                self.claims.pop(name, None)

    def keep(self, holder: str) -> None:
        """The put ``holder`` is about to store: the claims it holds are kept for good (no put gives them back)."""
        self.leases.pop(holder, None)
        for name in [n for n, held_by in self.holders.items() if holder in held_by]:
            del self.holders[name]

    def _forget_dead_holders(self) -> None:
        """Give back the claims of the puts whose lease Ray lost with the process that owned it (it died before it
        kept or gave them back, so before it sent any commit)."""
        for token in [t for t, lease in self.leases.items() if _owner_died(lease)]:
            self.release(token)
            logger.warning("Conduit storage unit: gave back the claims of the put %s, whose process died before it "
                           "stored", token)

    def held_widths(self, stores: dict[str, FieldStore]) -> dict[str, int]:
        """The shape-row width of each of ``stores`` this unit already holds (what :meth:`check` returned)."""
        return {name: store.width for name, store in stores.items() if self.fields.get(name) is store}

    def put(self, gis: list[int], columns: dict[str, Any], widths: dict[str, int] | None = None) -> None:
        """Store the columns' samples under ``gis``: every column, or (on an error) none (``widths``: see
        :meth:`check`; samples reserved by prepared puts of live processes count against ``max_items``)."""
        self._forget_dead_puts()
        self._write(gis, columns, widths, self._reserved())

    def _write(self, gis: list[int], columns: dict[str, Any], widths: dict[str, int] | None,
               reserved: dict[str, set[int]]) -> None:
        """Store every column or none: all are checked, then every tensor column is appended to its field
        (:meth:`FieldStore.append`, which may migrate the field to make room), and only when all were does any
        become readable (:meth:`FieldStore.settle`); an append that fails (memory running out while a field grows)
        rolls back those appended before it."""
        t0 = time.perf_counter()
        decoded, stores = self.check(gis, columns, widths, reserved)
        appended: list[tuple[FieldStore, Appended]] = []
        nbytes = 0
        try:
            for name, col in decoded.items():
                if isinstance(col, PackedColumn) and name in stores:  # (not: a new field of no samples)
                    appended.append((stores[name], stores[name].append(gis, col)))
                    nbytes += col.values.numel() * col.values.element_size()
        except BaseException:
            for store, part in reversed(appended):
                store.rollback(part)
            raise
        for store, part in appended:  # every column is in: make them readable
            store.settle(part)
            self.fields[store.name] = store
        for name, col in decoded.items():
            if not isinstance(col, PackedColumn):
                objs = self.objects.setdefault(name, {})
                for g, v in zip(gis, col, strict=True):
                    objs[int(g)] = v
        self.telemetry.record("put", len(gis), nbytes, t0, time.perf_counter())

    def get(self, gis: list[int], fields: list[str]) -> dict[str, Any]:
        """The samples ``gis`` of each of ``fields``: a tensor field as a wire column (:func:`to_wire`), an object
        field as a list of its values.

        Raises:
            MissingKeyError: a field here lacks a sample of ``gis``; MissingFieldError (one too): no sample of the
                field is here. Built by :mod:`conduit_verl.unit_errors`: the caller of a unit actor gets
                :mod:`conduit_verl.compat`'s classes.
        """
        t0 = time.perf_counter()
        out: dict[str, Any] = {}
        nbytes = 0
        for name in fields:
            if name in self.fields:
                col = self.fields[name].get(gis)
                nbytes += col.values.numel() * col.values.element_size()
                out[name] = to_wire(col)
            elif name in self.objects:
                objs = self.objects[name]
                try:
                    out[name] = [objs[int(g)] for g in gis]
                except KeyError as e:
                    raise missing_key(f"Field {name!r} holds no sample with global index {e.args[0]}.") from None
            elif self.num_units > 1 and gis:  # another unit may hold the field: say which samples this one has
                held = sorted([*self.fields, *self.objects])
                raise missing_field(f"Field {name!r} holds no sample with global index {int(gis[0])}: the "
                                    f"Conduit storage unit for global_index % {self.num_units} == "
                                    f"{int(gis[0]) % self.num_units} holds none of it (its fields: {held}).")
            else:  # no unit holds the field (SimpleStorage raises a RuntimeError for a field its unit lacks, too)
                raise missing_field(f"No field {name!r} in Conduit storage; stored fields: "
                                    f"{sorted([*self.fields, *self.objects])}.")
        self.telemetry.record("get", len(gis), nbytes, t0, time.perf_counter())
        return out

    def clear(self, gis: list[int]) -> int:
        """Forget the samples ``gis``; returns how many a tensor field held.

        A put prepared here and not yet committed reached this unit before the clear, so the clear applies to it as
        it would to a stored put (as on SimpleStorage, where a put that reached its unit first is cleared): its commit
        stores only its other samples, so a cleared sample does not come back, nor land under a key the controller
        gave its freed global index to (its reservation stays until the commit or abort).
        """
        t0 = time.perf_counter()
        gone = {int(g) for g in gis}
        for token, (p_gis, _, _) in self.pending.items():
            hit = gone.intersection(p_gis)
            if hit:
                self.cleared.setdefault(token, set()).update(hit)
        held = 0
        for store in self.fields.values():
            held = max(held, store.clear(gis))
        for objs in self.objects.values():
            for g in gis:
                objs.pop(int(g), None)
        self.telemetry.record("clear", len(gis), 0, t0, time.perf_counter())
        return held

    def save(self, path: str) -> int:
        """Write every held sample (tensor fields packed, object fields as they are) to ``path``."""
        state: dict[str, Any] = {"format": 1, "num_units": self.num_units, "fields": {}, "objects": self.objects}
        for name, store in self.fields.items():
            gis = sorted(store._handle)
            col = store.get(gis) if gis else None
            state["fields"][name] = {"dtype": str(store.dtype).removeprefix("torch."), "width": store.width,
                                     "gis": gis, "column": None if col is None else to_wire(col)}
        torch.save(state, path)
        return sum(len(s) for s in self.fields.values())

    def load(self, path: str) -> int:
        """Replace the held samples with what :meth:`save` wrote to ``path``.

        Raises:
            SchemaError: ``path`` cannot be read (truncated, corrupt), was not written by a Conduit unit, or by one
                of another ``num_units`` (samples are routed by ``global_index % num_units``); nothing is changed.
            CapacityError: a field holds more samples than ``max_items``; nothing is changed.
        """
        self.stage(path)
        return self.install_staged()

    def stage(self, path: str) -> int:
        """First phase of a restore over several units: read and check ``path`` (as :meth:`load`) and keep what it
        holds aside, changing nothing held; :meth:`install_staged` then replaces the held samples with it and
        :meth:`unstage` forgets it. Returns the number of tensor samples read.

        Raises:
            SchemaError: as :meth:`load` (nothing is staged).
            CapacityError: a field, tensor or Python objects, holds more samples than this storage's ``max_items``
                (nothing is staged).
        """
        self.staged = None
        try:
            state = torch.load(path, weights_only=False)
        except (OSError, MemoryError):  # (a missing or unreadable path says so itself)
            raise
        except Exception as e:  # torch's, pickle's or an unpickled class's own error for bytes it cannot read
            raise SchemaError(f"{path} could not be read as a Conduit storage unit checkpoint ({type(e).__name__}: "
                              f"{e}): the file is truncated or corrupt, or was not written by a Conduit storage unit; "
                              f"restore from an intact copy of the checkpoint.") from None
        if not isinstance(state, dict) or state.get("format") != 1:
            raise SchemaError(f"{path} was not written by a Conduit storage unit.")
        saved_units = state.get("num_units", self.num_units)  # absent: written before it was recorded
        if saved_units != self.num_units:
            raise SchemaError(f"{path} was written with num_units={saved_units}, this storage has "
                              f"num_units={self.num_units}; samples are routed by global_index % num_units, so restore "
                              f"with transfer_queue.backend.Conduit.num_units={saved_units}.")
        for name, objs in state["objects"].items():  # (tensor fields are checked as they are put below)
            check_indexes(name, list(objs), (), self.ladder_args["max_items"])
        fields: dict[str, FieldStore] = {}
        for name, f in state["fields"].items():
            store = fields[name] = FieldStore(name, getattr(torch, f["dtype"]), f["width"],
                                              PoolLadder(**self.ladder_args))
            if f["gis"]:
                store.put(f["gis"], from_wire(f["column"], copy=True))
        self.staged = (fields, state["objects"])
        return sum(len(s) for s in fields.values())

    def install_staged(self) -> int:
        """Replace the held samples with what :meth:`stage` read (prepared puts and claims are dropped).

        Raises:
            SchemaError: nothing is staged.
        """
        if self.staged is None:
            raise SchemaError("No checkpoint is staged on this Conduit storage unit; restore with "
                              "tq.load_storage_checkpoint (it stages every unit's file first).")
        fields, objects = self.staged
        self.fields, self.objects, self.claims, self.holders, self.pending = fields, objects, {}, {}, {}
        self.cleared, self.staged, self.leases = {}, None, {}
        self.generation += 1  # the claims are gone: what clients cached of them no longer holds
        return sum(len(s) for s in fields.values())

    def unstage(self) -> None:
        """Forget what :meth:`stage` read (a restore refused on another unit)."""
        self.staged = None

    def stats(self) -> dict[str, Any]:
        return {
            "fields": {n: {"samples": len(s), "slots": s.storage.capacity,
                           "pool_elements": getattr(s.storage, "ragged_capacity", None), "tier": s.storage.tier,
                           "reserved_bytes": s.storage.nbytes()} for n, s in self.fields.items()},
            "objects": {n: len(o) for n, o in self.objects.items()},
            "migrations": [m for s in self.fields.values() for m in s.migrations],
            "prepared_puts": len(self.pending),
            "telemetry": self.telemetry.summary(),
        }


def _without_rows(gis: list[int], columns: dict[str, Any], gone: set[int]) -> tuple[list[int], dict[str, Any]]:
    """A prepared put's global indexes and wire columns without its samples of ``gone``."""
    keep = [p for p, g in enumerate(gis) if g not in gone]
    rows = torch.tensor(keep, dtype=torch.int64)
    out = {name: to_wire(select_rows(from_wire(w), rows)) if isinstance(w, dict) else [w[p] for p in keep]
           for name, w in columns.items()}
    return [gis[p] for p in keep], out


#: how long a unit asks the owner of a lease it does not hold a copy of (a dead owner's answer comes within ~1 s)
LEASE_CHECK_S = 2.0


def _owner_died(lease: Any) -> bool:
    """Whether Ray lost ``lease`` (an ``ObjectRef``) with the process that owned it; False for no lease, and when
    the owner does not answer within :data:`LEASE_CHECK_S`.

    A unit keeps a copy of a live lease once read; Ray drops that copy when the owner dies, and only a read that
    waits then learns the owner is gone (a read that does not wait times out, whatever the owner's state)."""
    if not isinstance(lease, ray.ObjectRef):
        return False
    for timeout in (0.0, LEASE_CHECK_S):
        try:
            ray.get(lease, timeout=timeout)
            return False
        except ray.exceptions.ObjectLostError:  # OwnerDiedError among them
            return True
        except ray.exceptions.GetTimeoutError:
            continue
    return False


@ray.remote(max_concurrency=1)  # type: ignore[call-overload]  # ray's option overload omits actor options
class ConduitStorageUnit:
    """A Ray actor holding a share of the samples in Conduit storage (calls are serialised)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.state = _UnitState(config)

    # Python-object columns cross these calls pickled (conduit_verl.packing.objects_to_wire), both ways
    def check(self, gis: list[int], columns: dict[str, Any], widths: dict[str, int] | None = None) -> dict[str, int]:
        """Raise what :meth:`put` would raise; returns the shape-row width of each tensor field this unit holds."""
        return self.state.held_widths(self.state.check(gis, objects_from_wire(columns), widths)[1])

    def put(self, gis: list[int], columns: dict[str, Any], widths: dict[str, int] | None = None) -> None:
        self.state.put(gis, objects_from_wire(columns), widths)

    def prepare(self, token: str, gis: list[int], columns: dict[str, Any], lease: list[Any] | None = None
                ) -> dict[str, int]:
        """See :meth:`_UnitState.prepare`; ``lease`` comes wrapped in a list (Ray would resolve a bare ``ObjectRef``
        argument to its value)."""
        return self.state.prepare(token, gis, objects_from_wire(columns), lease[0] if lease else None)

    def commit(self, token: str, widths: dict[str, int] | None = None) -> None:
        self.state.commit(token, widths)

    def abort(self, token: str) -> None:
        self.state.abort(token)

    def claim(self, kinds: dict[str, tuple[str | None, int]], holder: str | None = None,
              lease: list[Any] | None = None) -> tuple[list[str], dict[str, tuple[str | None, int]]]:
        """See :meth:`_UnitState.claim` (the manager asks unit 0); ``lease`` comes wrapped in a list, as in
        :meth:`prepare`."""
        return self.state.claim(kinds, holder, lease[0] if lease else None)

    def release(self, holder: str) -> None:
        """See :meth:`_UnitState.release`."""
        self.state.release(holder)

    def keep(self, holder: str) -> None:
        """See :meth:`_UnitState.keep`."""
        self.state.keep(holder)

    def get(self, gis: list[int], fields: list[str]) -> dict[str, Any]:
        return objects_to_wire(self.state.get(gis, fields))

    def generation(self) -> int:
        """See :attr:`_UnitState.generation` (the manager asks unit 0 whether its cached claims still hold)."""
        return self.state.generation

    def clear(self, gis: list[int]) -> int:
        return self.state.clear(gis)

    def stats(self) -> dict[str, Any]:
        return self.state.stats()

    def save(self, path: str) -> int:
        return self.state.save(path)

    def load(self, path: str) -> int:
        return self.state.load(path)

    def stage(self, path: str) -> int:
        """See :meth:`_UnitState.stage`."""
        return self.state.stage(path)

    def install_staged(self) -> int:
        return self.state.install_staged()

    def unstage(self) -> None:
        self.state.unstage()

    def migrations(self) -> list[Migration]:
        return self.state.stats()["migrations"]
