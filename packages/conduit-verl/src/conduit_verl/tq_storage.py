"""Conduit as a TransferQueue storage backend, registered under the name ``Conduit``.

A verl user selects it with one hydra override::

    transfer_queue.backend.storage_backend=Conduit

Three parts, each registered through TransferQueue's own registries:

* :class:`~conduit_verl.unit.ConduitStorageUnit` (a Ray actor, one or more per cluster, spread over the
  nodes; its own module, which a unit's process imports without TransferQueue or tensordict):
  holds the bytes. Every tensor field is a :class:`~conduit_verl.columns.FieldStore`: the
  field's samples packed end to end in a Conduit storage (variable length costs what it
  holds), migrated to a larger placement when sequences grow. Python-object fields (uids,
  reward info) stay objects (read back as SimpleStorage reads them: a field whose values are
  all tensors comes back as one tensor).
* :class:`ConduitStorageManager` (``StorageManagerFactory`` name ``Conduit``): the client side
  TransferQueue builds in every process. A put packs each column once and ships it to the
  units as raw arrays; a get runs in the consuming worker and rebuilds the columns there,
  exactly as SimpleStorage returns them, optionally straight onto the worker's device.
* :func:`bootstrap` (``StorageBootstrapProvider`` name ``Conduit``): run by ``tq.init`` on the
  controller to start the units and fill in defaults.

Samples are routed to units by ``global_index % num_units``, as SimpleStorage does.

Configuration (``transfer_queue.backend.Conduit.*``, every key optional; verl's config has no ``Conduit``
section, so a hydra override adds a key with a leading ``+``: ``+transfer_queue.backend.Conduit.num_units=2``):

``num_units`` (1), ``capacity`` (1024 sample slots per field and unit before the first
migration), ``mean_length`` (256 elements per sample in the first placement; a first pool of
``capacity * mean_length`` elements beyond int64, or at one byte each, over the units a Ray node runs, beyond
the memory Ray has on that node, is refused by ``tq.init``, as a field's first put could never allocate it),
``growth`` (2.0, the placement map's factor, at least 1.01), ``max_items`` (null: unbounded),
``unit_num_cpus`` (0, or at least 0.0001, Ray's step; ``tq.init`` refuses units that together reserve more CPUs
than their node has, and stops them if one has not started within :data:`UNIT_START_TIMEOUT_S`),
``device`` (``cpu``; ``auto`` returns tensors on the reading process's accelerator; nothing else),
``delivery`` (``prefetch``; ``sync``, or ``off`` to leave verl's minibatch iteration alone:
see :mod:`conduit_verl.delivery`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from numbers import Integral, Real
from typing import Any, cast

import ray
import torch
from conduit import ConduitError, ConfigurationError, SchemaError, Telemetry
from omegaconf import DictConfig, OmegaConf, open_dict
from tensordict import NonTensorStack, TensorDict
from transfer_queue.metadata import BatchMeta, extract_field_schema
from transfer_queue.storage.bootstrap import StorageBootstrapProvider
from transfer_queue.storage.managers.base import StorageManager, StorageManagerFactory
from transfer_queue.utils.common import get_node_round_robin_scheduling_strategies

import conduit_verl.compat  # noqa: F401  (a unit built in this process raises compat's errors: see unit_errors)
from conduit_verl.columns import PoolLadder
from conduit_verl.compat import UnitTimeoutError
from conduit_verl.packing import (
    PackedColumn,
    concat_rows,
    from_wire,
    nested_or_stack,
    objects_from_wire,
    objects_to_wire,
    pack_column,
    select_rows,
    to_wire,
    unpack_column,
)
from conduit_verl.unit import ConduitStorageUnit, unit_name

__all__ = ["BACKEND", "DEFAULTS", "ConduitStorageUnit", "ConduitStorageManager", "bootstrap", "unit_name"]

logger = logging.getLogger(__name__)

#: the name TransferQueue knows this backend by
BACKEND = "Conduit"
NAMESPACE = "transfer_queue"

DEFAULTS: dict[str, Any] = {
    "num_units": 1,
    "capacity": 1024,
    "mean_length": 256,
    "growth": 2.0,
    "max_items": None,
    "unit_num_cpus": 0,
    "device": "cpu",
    "delivery": "prefetch",
    "call_timeout_s": 600,
}


#: run ids of the units this process started (bootstrap); their managers stop them on close
_OWNED_RUNS: set[str] = set()


def _with_defaults(cfg: Any) -> dict[str, Any]:
    given = cast("dict[str, Any]",
                 OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg or {}))
    out = dict(DEFAULTS)
    out.update({k: v for k, v in given.items() if v is not None or k == "max_items"})
    return out


#: Ray counts a resource in steps of 1/this; it refuses a share of a CPU finer than one step
_CPU_STEPS = 10_000

#: the keys that take a whole number (``max_items`` also null)
_WHOLE_NUMBERS = ("num_units", "capacity", "mean_length", "max_items")


def _validated(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` (defaults filled in) when every key is known and every value usable.

    ``device`` is ``cpu`` or ``auto``: a fixed device would be every reading process's, and verl's controller and
    agent loop have no accelerator.

    Raises:
        ConfigurationError: an unknown key or a bad value, named with the hydra path to fix.
    """
    where = f"transfer_queue.backend.{BACKEND}"
    unknown = sorted(set(cfg) - set(DEFAULTS) - {"_run_id"})
    if unknown:
        raise ConfigurationError(f"{where} has unknown key(s) {unknown}; known: {sorted(DEFAULTS)}.")
    for key in _WHOLE_NUMBERS:  # (int() would truncate 2.5 to 2 and take True as 1, silently)
        v = cfg[key]
        if not (v is None and key == "max_items") and (isinstance(v, bool) or not isinstance(v, Integral)):
            raise ConfigurationError(f"{where}.{key}={v!r}: give a whole number (e.g. {DEFAULTS[key] or 4096}).")
    try:
        units, cpus = int(cfg["num_units"]), float(cfg["unit_num_cpus"])
        PoolLadder(int(cfg["capacity"]), int(cfg["capacity"]) * int(cfg["mean_length"]), growth=float(cfg["growth"]),
                   max_items=None if cfg["max_items"] is None else int(cfg["max_items"]))
        if cfg["device"] != "auto":
            torch.device(str(cfg["device"]))
    except ConduitError as e:
        raise ConfigurationError(f"{where}: {e}") from None
    except (TypeError, ValueError, RuntimeError) as e:
        raise ConfigurationError(f"{where} has a value of the wrong type or form ({e}); see the defaults "
                                 f"{DEFAULTS}.") from None
    if isinstance(cfg["unit_num_cpus"], bool) or not 0 <= cpus < math.inf:  # (NaN passed, and Ray's start then
        # failed with an untyped "cannot convert float NaN to integer"; True was taken as 1 CPU)
        raise ConfigurationError(f"{where}.unit_num_cpus={cfg['unit_num_cpus']!r}: give a finite number of CPUs >= 0 "
                                 f"(e.g. 0, which reserves none, or 1).")
    if cpus and int(cpus * _CPU_STEPS) == 0:  # (Ray's own test: it refused the unit's start, with a ValueError)
        raise ConfigurationError(f"{where}.unit_num_cpus={cfg['unit_num_cpus']!r}: Ray counts CPUs in steps of "
                                 f"{1 / _CPU_STEPS:g}; give 0, which reserves none, or at least {1 / _CPU_STEPS:g}.")
    timeout = cfg["call_timeout_s"]
    if isinstance(timeout, bool) or not isinstance(timeout, Real) or not 0 < float(timeout) < math.inf:
        raise ConfigurationError(f"{where}.call_timeout_s={timeout!r}: give a finite number of seconds > 0 (e.g. "
                                 f"{DEFAULTS['call_timeout_s']:g}).")
    if units < 1 or cpus < 0 or int(cfg["mean_length"]) < 1:
        raise ConfigurationError(f"{where} needs num_units >= 1, mean_length >= 1 and unit_num_cpus >= 0; got "
                                 f"{units}, {cfg['mean_length']}, {cpus}.")
    _check_first_placement(cfg, where)
    if cfg["delivery"] not in ("prefetch", "sync", "off"):
        raise ConfigurationError(f"{where}.delivery={cfg['delivery']!r}; use prefetch, sync or off.")
    if cfg["device"] not in ("cpu", "auto"):  # one fixed device for every reading process: verl's controller and
        # agent loop have no accelerator (their first read would fail mid-run), and "meta" would drop the data
        raise ConfigurationError(f"{where}.device={cfg['device']!r}; use cpu, or auto to read onto each reading "
                                 f"process's own accelerator (CPU where it has none, as verl's controller).")
    return cfg


def _first_pool(cfg: dict[str, Any]) -> tuple[int, int]:
    """(elements, bytes) of the first placement of each tensor field on each unit, the bytes a lower bound.

    A unit allocates a tensor field's first placement whole when the field's first put arrives
    (:class:`~conduit_verl.columns.FieldStore`, rung 0 of :class:`~conduit_verl.columns.PoolLadder`): a packed pool of
    ``capacity * mean_length`` elements and ``min(capacity, max_items)`` slots, each with at least 25 bytes of
    bookkeeping (start, length and held elements, int64; alive, bool). At one byte per element (the smallest dtype)
    that is a lower bound of what each field needs on each unit.
    """
    capacity, mean_length = int(cfg["capacity"]), int(cfg["mean_length"])
    slots = capacity if cfg["max_items"] is None else min(capacity, int(cfg["max_items"]))
    elements = capacity * mean_length
    return elements, elements + 25 * slots


def _check_first_placement(cfg: dict[str, Any], where: str) -> None:
    """Refuse a ``capacity`` x ``mean_length`` whose first pool (:func:`_first_pool`) is beyond int64 elements: no
    tensor can hold it, and a field's first put failed only there, with an untyped TypeError. (Whether its bytes fit
    the memory of the nodes the units run on is :func:`_check_unit_memory`'s.)

    Raises:
        ConfigurationError: the pool's elements exceed int64.
    """
    elements, need = _first_pool(cfg)
    if elements > _INT64_MAX:
        raise ConfigurationError(
            f"{where}.capacity={cfg['capacity']} x {where}.mean_length={cfg['mean_length']} = {elements} elements in "
            f"each tensor field's first pool, beyond what a tensor can hold (int64, {_INT64_MAX}); that is at least "
            f"{need} bytes per field and unit. Lower capacity or mean_length (the pool grows when sequences need it).")


def _node_memory(resources: dict[str, Any]) -> int:
    """The bytes of memory Ray has on a node of these ``resources``: its ``memory`` resource (for tasks and actors)
    plus its object store, which Ray sizes from that node's own memory (a container's limit included) unless the
    node was started with ``--memory`` / ``--object-store-memory``; 0 when the node says neither."""
    return int(float(resources.get("memory", 0)) + float(resources.get("object_store_memory", 0)))


def _check_unit_memory(cfg: dict[str, Any], units: Counter[str], nodes: dict[str, dict[str, Any]]) -> None:
    """Refuse a first pool (:func:`_first_pool`) that the ``units`` pinned to one node could never allocate there
    together: each unit allocates it for each tensor field at the field's first put, in its own
    process on its own node, so the bound is that node's memory as Ray has it (:func:`_node_memory`), not the memory
    of the machine that runs ``tq.init`` (a node that says none is not checked).

    Raises:
        ConfigurationError: a node has less memory than the first pools of one tensor field on its units need.
    """
    where = f"transfer_queue.backend.{BACKEND}"
    elements, need = _first_pool(cfg)
    for node_id, count in units.items():
        memory = _node_memory(nodes.get(node_id, {}))
        if memory and count * need > memory:
            raise ConfigurationError(
                f"{where}.capacity={cfg['capacity']} x {where}.mean_length={cfg['mean_length']} sizes each tensor "
                f"field's first pool at {elements} elements: at least {need} bytes per field and unit (at one byte "
                f"per element), and the {count} storage unit(s) placed on Ray node {node_id[:12]} need "
                f"{count * need} bytes for one field, more than the {memory} bytes of memory Ray has on that node, so "
                f"a field's first put could never allocate it. Lower capacity or mean_length (the pool grows when "
                f"sequences need it). Nothing was started.")


_INT64_MAX = 2**63 - 1

#: how long :func:`bootstrap` waits for the units to start (Ray holds a unit back while its node's CPUs are taken)
UNIT_START_TIMEOUT_S = 600.0


def _check_unit_cpus(cfg: dict[str, Any], units: Counter[str], nodes: dict[str, dict[str, Any]]) -> None:
    """Refuse units that could never start: the ``units`` pinned to one node reserve more CPUs together than the
    node has (its ``nodes`` resources; Ray would hold the last ones back for good, and ``tq.init`` wait for them).

    Raises:
        ConfigurationError: a node has fewer CPUs than its units reserve.
    """
    cpus = float(cfg["unit_num_cpus"])
    if cpus <= 0:
        return
    for node_id, count in units.items():
        has = float(nodes.get(node_id, {}).get("CPU", 0.0))
        if count * cpus > has:
            raise ConfigurationError(
                f"transfer_queue.backend.{BACKEND}: {count} storage unit(s) with unit_num_cpus={cpus:g} "
                f"are placed on Ray node {node_id[:12]}, which has {has:g} CPUs, so they could "
                f"never all start; lower unit_num_cpus (0 reserves none) or num_units (units go round-robin over "
                f"the alive nodes). Nothing was started.")


def _await_units(handles: dict[str, Any], cfg: dict[str, Any]) -> None:
    """Wait (at most :data:`UNIT_START_TIMEOUT_S`) until every unit answers (the caller stops them all on a failure).

    Raises:
        ConfigurationError: a unit did not start in time (its node's CPUs are held by other tasks or actors).
    """
    calls = [h.stats.remote() for h in handles.values()]
    ready, waiting = ray.wait(calls, num_returns=len(calls), timeout=UNIT_START_TIMEOUT_S)
    if waiting:
        raise ConfigurationError(
            f"{len(waiting)} of {len(calls)} Conduit storage unit(s) did not start within "
            f"{UNIT_START_TIMEOUT_S:g} s: Ray holds them back while their nodes' CPUs are taken by other tasks or "
            f"actors (each unit reserves transfer_queue.backend.{BACKEND}.unit_num_cpus="
            f"{float(cfg['unit_num_cpus']):g}); lower unit_num_cpus (0 reserves none) or free CPUs. No unit "
            f"was left running.")
    ray.get(ready)  # a unit that failed to start raises here


#: the name and namespace ``tq.init`` gives TransferQueue's controller actor
CONTROLLER = "TransferQueueController"
#: how long :func:`_undo_tq_start` waits for Ray to forget the stopped controller's name
CONTROLLER_GONE_S = 30.0


def _undo_tq_start() -> None:
    """After :func:`bootstrap` failed inside ``tq.init``: stop the controller ``tq.init`` started for it, and forget it
    (as ``tq.close`` does), so that the next ``tq.init``, in any process, starts TransferQueue afresh.

    ``tq.init`` (TransferQueue 0.1.x) starts its controller, then bootstraps the storage, then gives the controller
    its config. When the bootstrap raises, the controller is left running with no config, and every later ``tq.init``
    finds it and waits for that config forever. Only such a controller is stopped: this process's, still without a
    config, while no storage or client was set up (a call from anywhere else changes nothing).
    """
    try:
        import transfer_queue.interface as tqi
    except ImportError:
        return
    controller = getattr(tqi, "_TQ_CONTROLLER", None)
    if controller is None or getattr(tqi, "_TQ_STORAGE", None) != {} or getattr(tqi, "_TQ_CLIENT", None) is not None:
        return  # not inside tq.init's first start in this process
    try:
        if ray.get(controller.get_config.remote(), timeout=CONTROLLER_GONE_S) is not None:
            return  # a configured TransferQueue: not ours to stop
    except Exception:  # noqa: BLE001  (a controller that cannot answer is as unusable as one without a config)
        pass
    tqi.close()  # kills the controller and forgets it (and the empty storage record)
    deadline = time.monotonic() + CONTROLLER_GONE_S
    while time.monotonic() < deadline:  # a retry that still found the dead controller by name would fail
        try:
            ray.get_actor(CONTROLLER, namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.1)
    logger.warning("Conduit storage: TransferQueue's controller, stopped after the storage failed to start, still "
                   "has its name after %g s; a tq.init now may fail on it (call tq.init again)", CONTROLLER_GONE_S)


@StorageBootstrapProvider.register_provider(BACKEND)
def bootstrap(conf: DictConfig) -> dict[str, Any]:
    """Start the storage units (``tq.init`` calls this once, in the process that creates the controller).

    When it raises inside ``tq.init``, the controller ``tq.init`` started is stopped (:func:`_undo_tq_start`): the
    error reaches ``tq.init``'s caller, and a later ``tq.init`` (with a corrected config) starts TransferQueue
    afresh instead of waiting forever for the failed one.

    The handles it returns (unit name -> handle) become TransferQueue's storage record of the run
    (``transfer_queue.interface._TQ_STORAGE["Conduit"]``) and are the only handles the units' creator holds, so Ray
    stops the units once ``tq.close()`` drops that record (handles from ``ray.get_actor`` do not keep them alive).
    That is what stops them after a ``tq.init`` that failed past this bootstrap (TransferQueue's own later steps: its
    metrics exporter refusing ``metrics.port``, building its client), which built no client whose storage manager
    would; nothing here may keep those handles elsewhere. Such a ``tq.init`` leaves TransferQueue's controller running
    with its config stored: call ``tq.close()`` before ``tq.init`` again (without it, ``tq.init`` attaches to that
    controller, ignores the config it is given and skips what failed, as it does for any backend).

    Raises:
        ConfigurationError: ``transfer_queue.backend.Conduit`` has an unknown key or a bad value, or its units
            reserve more CPUs than their nodes have, or a field's first pools on the units of a node exceed the
            memory Ray has there (nothing started); or a unit did not start within
            :data:`UNIT_START_TIMEOUT_S` (the units started are stopped).

    Any other error of a unit's start (Ray refusing it, e.g. another actor holds its name; the unit failing in its own
    process) reaches the caller as Ray raised it, the units this start had started stopped first.
    """
    try:
        return _start_units(conf)
    except BaseException:
        with contextlib.suppress(Exception):  # the bootstrap's error is the one to report
            _undo_tq_start()
        raise


def _start_units(conf: DictConfig) -> dict[str, Any]:
    """:func:`bootstrap`, but for undoing ``tq.init``'s start when it fails."""
    backend = conf.backend
    checked = _validated(_with_defaults(backend.get(BACKEND)))
    n = int(checked["num_units"])
    strategies = get_node_round_robin_scheduling_strategies(n)
    # the units each alive node would run, and its resources (one query of Ray for both checks)
    units = Counter(s.node_id for s in strategies)
    nodes = {node["NodeID"]: node.get("Resources", {}) for node in ray.nodes() if node.get("Alive", False)}
    _check_unit_cpus(checked, units, nodes)
    _check_unit_memory(checked, units, nodes)
    with open_dict(backend):
        if backend.get(BACKEND) is None:
            backend[BACKEND] = {}
        cfg = _with_defaults(backend[BACKEND])
        cfg["_run_id"] = uuid.uuid4().hex[:12]
        backend[BACKEND] = cfg
    handles: dict[str, Any] = {}
    try:
        for rank in range(n):
            name = unit_name(cfg["_run_id"], rank)
            handles[name] = ConduitStorageUnit.options(  # type: ignore[attr-defined]
                name=name, namespace=NAMESPACE, scheduling_strategy=strategies[rank],
                num_cpus=float(cfg["unit_num_cpus"])).remote(cfg)
        _await_units(handles, cfg)
    except BaseException:
        # Ray refused a unit's start (e.g. its name is taken), a unit failed or did not start in time, or an
        # interrupt: the units started so far are stopped before the error goes on. Otherwise they would live, holding
        # their memory and unit_num_cpus, as long as anything held the error (its traceback has the only handles to
        # them: an except block retrying tq.init, a logger, a REPL). A unit already gone (with its node) is skipped.
        for h in handles.values():
            with contextlib.suppress(Exception):
                ray.kill(h)
        raise
    _OWNED_RUNS.add(cfg["_run_id"])
    logger.info("Conduit storage: %d unit(s) started (run %s)", n, cfg["_run_id"])
    return handles


@StorageManagerFactory.register(BACKEND)
class ConduitStorageManager(StorageManager):
    """TransferQueue's storage manager for the Conduit backend (one per TransferQueue client)."""

    def __init__(self, controller_info: Any, config: Any, zmq_context: Any = None) -> None:
        cfg = _with_defaults(config)
        if "_run_id" not in cfg:
            raise SchemaError("transfer_queue.backend.Conduit has no _run_id: the Conduit units were not started. "
                              "Call tq.init with backend.storage_backend=Conduit from the driver first.")
        super().__init__(controller_info, config, zmq_context)
        self.cfg = cfg
        self.units = [ray.get_actor(unit_name(cfg["_run_id"], r), namespace=NAMESPACE)
                      for r in range(int(cfg["num_units"]))]
        self.device = self._resolve_device(str(cfg["device"]))
        self.telemetry = Telemetry()
        #: the kinds unit 0 confirmed to puts of this client that then stored (:meth:`_UnitState.claim`): a put of a
        #: field in its claimed kind, dtype and at most its rank asks no more (a put in flight holds its own claim)
        self._claimed: dict[str, tuple[str | None, int]] = {}
        #: unit 0's :attr:`_UnitState.generation` when :attr:`_claimed` was filled (None: not asked yet)
        self._claims_generation: int | None = None

    @staticmethod
    def _resolve_device(spec: str) -> torch.device:
        if spec == "auto":
            return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
                torch.device("cpu")
        return torch.device(spec)

    @property
    def delivery(self) -> str:
        """How the consuming worker iterates minibatches: ``prefetch``, ``sync`` or ``off``."""
        return str(self.cfg["delivery"])

    def _route(self, gis: list[int]) -> dict[int, list[int]]:
        """unit rank -> batch positions, in batch order."""
        routes: dict[int, list[int]] = {}
        n = len(self.units)
        for pos, g in enumerate(gis):
            routes.setdefault(int(g) % n, []).append(pos)
        return routes

    async def put_data(self, data: TensorDict, metadata: BatchMeta,
                       data_parser: Callable[[Any], Any] | None = None) -> None:
        """Store ``data``'s rows under ``metadata``'s global indexes, on the units they route to.

        With several units a put is all-or-nothing, in two phases: every unit it reaches prepares its part (checks it
        and reserves its samples against ``max_items``, :meth:`_UnitState.prepare`; the others check that they hold no
        field in another kind, dtype or rank), then unit 0 claims the kind of each field this client has not stored yet
        since the last checkpoint restore (by any client; :meth:`_UnitState.claim`: of two racing puts bringing a field
        in another kind, dtype or a higher rank, the second is refused there), and only then does every unit commit its
        part. A racing put that would not fit beside a prepared one is refused in its own prepare phase. A put that
        fails before its commits were sent aborts its prepared parts and gives back its claims (a claim another put in
        flight also holds stays). A process that dies between prepare and commit cannot abort: its prepared parts hold a
        lease (a Ray object this process owns) and go when a unit sees Ray lost it, at that unit's next put (within
        seconds of the death), and so do its claims on unit 0, at unit 0's next claim (before it sends any commit it
        waits until unit 0 kept its claims for good, :meth:`_UnitState.keep`, so a claim is never given back while a
        unit stores part of the put). A client that dies while its commits are under way leaves the parts that arrived
        stored and the others dropped; it never told TransferQueue's controller of the put, so readers are not handed
        its fields for those samples (a dead client's overwrite of values already listed is the exception: its
        samples on the units its commits reached read the new values). A clear that reaches a unit between a put's
        prepare and commit applies to the put (its commit there skips the cleared samples), as it would had the put
        stored. A commit is refused only when its unit lost the prepared part (the unit died, or a checkpoint restore
        ran during the put); the other units' parts then stay stored.

        Raises:
            SchemaError: a column disagrees with its field's kind, dtype or rank on any unit, or with the claim of a
                first put that came before; nothing of this put is stored.
            CapacityError: a unit would exceed ``max_items`` (counting the samples of puts in flight there);
                nothing of this put is stored.
        """
        t0 = time.perf_counter()
        n = metadata.size
        if data.batch_size[0] != n:
            raise SchemaError(f"put of {data.batch_size[0]} rows with metadata for {n} samples")
        if n == 0:
            return
        if data_parser is not None:
            raise NotImplementedError("data_parser is not supported by the Conduit backend (verl does not use it); "
                                      "parse the values before the put.")
        columns = {k: pack_column(data.get(k), n, k) for k in data.keys()}
        gis = [int(g) for g in metadata.global_indexes]
        routes = self._route(gis)
        parts: list[tuple[int, list[int], Any]] = []
        nbytes = 0
        for rank, positions in routes.items():
            rows = torch.tensor(positions, dtype=torch.int64)
            payload: dict[str, Any] = {}
            for k, col in columns.items():
                if isinstance(col, PackedColumn):
                    part = col if len(routes) == 1 else select_rows(col, rows)
                    nbytes += part.values.numel() * part.values.element_size()
                    payload[k] = to_wire(part)
                else:
                    payload[k] = col if len(routes) == 1 else [col[p] for p in positions]
            parts.append((rank, [gis[p] for p in positions], objects_to_wire(payload)))
        if len(self.units) == 1:  # one unit: its calls are serialised, and its put stores every column or none
            await self._answers([(0, self.units[0].put.remote(parts[0][1], parts[0][2]))], "a put")
        else:
            await self._put_over_units(parts, columns, routes)
        self.telemetry.record("put", n, nbytes, t0, time.perf_counter())
        self._trace()
        await self.notify_data_update(metadata.partition_ids[0], gis, extract_field_schema(data))

    async def _put_over_units(self, parts: list[tuple[int, list[int], Any]], columns: dict[str, Any],
                              routes: dict[int, list[int]]) -> None:
        """Store ``parts`` (rank, global indexes, payload) on several units, all or nothing (see :meth:`put_data`)."""
        token = uuid.uuid4().hex
        asked = committing = False
        try:
            lease = ray.put(token)  # owned by this process: lost with it, which frees its prepared parts on the units
            refs = [(rank, part_gis, ray.put(payload)) for rank, part_gis, payload in parts]
            phase = [(rank, self.units[rank].prepare.remote(token, part_gis, ref, [lease]))
                     for rank, part_gis, ref in refs]
            if len(parts) < len(self.units):  # a unit the put does not reach still refuses a field it holds in another
                # kind, dtype or rank
                empty = objects_to_wire({k: to_wire(_no_rows(c)) if isinstance(c, PackedColumn) else []
                                         for k, c in columns.items()})
                phase += [(r, self.units[r].check.remote([], empty)) for r in range(len(self.units)) if r not in routes]
            answers = await self._answers([*phase, (0, self.units[0].generation.remote())], "a put's preparation")
            held: list[dict[str, int]] = answers[:-1]
            generation: int = answers[-1]
            if generation != self._claims_generation:  # a checkpoint restore (from any client) dropped unit 0's
                # claims since this client cached its own: they no longer guard a racing first put, ask again
                self._claimed.clear()
                self._claims_generation = generation
            widths: dict[str, int] = {}
            for unit_widths in held:  # a field new to a unit takes the rank limit held elsewhere
                for name, width in unit_widths.items():
                    widths[name] = max(widths.get(name, 0), width)
            # the prepare phases of two puts can pass before either stores: unit 0 (whose calls are serialised) claims
            # each field's kind, dtype and rank limit, so the second of two racing first puts is refused before it
            # stores (unless it brings a lower rank: then it is padded to the claimed limit); this put holds the
            # claims until it stored (then for good) or failed (then it gives them back)
            # (a tensor field's rank limit: at least what a unit holds it at; after a checkpoint restore unit 0 knows
            # nothing of a field only other units hold, and a lower-rank put would claim a limit below theirs)
            kinds = {k: (str(c.dtype).removeprefix("torch."), max(int(c.shapes.shape[1]), widths.get(k, 0)))
                     if isinstance(c, PackedColumn) else (None, 0) for k, c in columns.items()}
            confirmed = {k: kind for k, kind in self._claimed.items() if k in kinds}
            ask = {k: kind for k, kind in kinds.items() if not self._knows(k, kind)}
            if ask:
                asked = True
                ((_, got),) = await self._answers([(0, self.units[0].claim.remote(ask, token, [lease]))],
                                                  "a put's claim of new fields")
                confirmed.update(got)
            for name, (dtype, width) in confirmed.items():
                if dtype is not None:
                    widths[name] = max(widths.get(name, 0), width)
            if asked:  # unit 0 keeps the claims for good before any commit is sent: Ray orders no calls to
                # different actors, so a keep merely sent first could still be undelivered when this process dies
                # with a commit stored, and unit 0 would give back the claim of a field a unit holds
                await self._answers([(0, self.units[0].keep.remote(token))], "a put's claim of new fields")
            committing = True  # from here parts may be stored
            await self._answers([(rank, self.units[rank].commit.remote(token, widths)) for rank, _, _ in parts],
                                "a put's commit")
        except BaseException:
            # not awaited (this task may be cancelled); Ray runs them after this put's earlier calls to each unit
            undo: list[Any] = [self.units[rank].abort for rank, _, _ in parts]
            if asked and not committing:  # (after a keep unit 0 ran, a release gives back nothing)
                undo.append(self.units[0].release)
            for method in undo:
                with contextlib.suppress(Exception):
                    method.remote(token)
            raise
        self._claimed.update(confirmed)  # stored: kinds this client need not ask for again

    def _knows(self, name: str, kind: tuple[str | None, int]) -> bool:
        """Whether unit 0 confirmed ``name``'s kind and dtype to this client, with a rank limit ``kind`` keeps."""
        have = self._claimed.get(name)
        return have is not None and have[0] == kind[0] and kind[1] <= have[1]

    async def get_data(self, metadata: BatchMeta) -> TensorDict:
        t0 = time.perf_counter()
        n = metadata.size
        if n == 0:
            return TensorDict({}, batch_size=0)
        fields = list(metadata.field_names)
        gis = [int(g) for g in metadata.global_indexes]
        routes = self._route(gis)
        replies = await self._answers([(r, self.units[r].get.remote([gis[p] for p in pos], fields))
                                       for r, pos in routes.items()], "a read")
        parts = [objects_from_wire(r) for r in replies]
        order = [p for pos in routes.values() for p in pos]  # batch position of each row as received
        inverse = torch.empty(n, dtype=torch.int64)
        inverse[torch.tensor(order, dtype=torch.int64)] = torch.arange(n, dtype=torch.int64)
        out: dict[str, Any] = {}
        nbytes = 0
        for f in fields:
            _same_kind(f, [p[f] for p in parts])
            if isinstance(parts[0][f], dict):
                col = concat_rows([from_wire(p[f]) for p in parts]) if len(parts) > 1 else from_wire(parts[0][f])
                col = select_rows(col, inverse) if len(parts) > 1 else _owned(col)
                nbytes += col.values.numel() * col.values.element_size()
                t = unpack_column(col)
                out[f] = t if self.device.type == "cpu" else t.to(self.device)
            else:
                items = [x for p in parts for x in p[f]]
                obj = _objects_column([items[int(i)] for i in inverse] if len(parts) > 1 else items)
                out[f] = obj.to(self.device) if isinstance(obj, torch.Tensor) and self.device.type != "cpu" else obj
        self.telemetry.record("get", n, nbytes, t0, time.perf_counter())
        self._trace()
        return TensorDict(out, batch_size=n)

    async def clear_data(self, metadata: BatchMeta) -> None:
        gis = [int(g) for g in metadata.global_indexes]
        routes = self._route(gis)
        await self._answers([(r, self.units[r].clear.remote([gis[p] for p in pos])) for r, pos in routes.items()],
                            "a clear")

    def _trace(self) -> None:
        """With ``CONDUIT_VERL_TRACE_DIR`` set, keep this process's call totals in a JSON file there."""
        trace_dir = os.environ.get("CONDUIT_VERL_TRACE_DIR")
        if not trace_dir:
            return
        os.makedirs(trace_dir, exist_ok=True)
        rec = {"pid": os.getpid(), "run": self.cfg["_run_id"], "telemetry": self.telemetry.summary()}
        path = os.path.join(trace_dir, f"storage-{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(rec, f)
        os.replace(path + ".tmp", path)

    async def save_checkpoint(self, checkpoint_dir: str) -> None:
        """Each unit writes its samples to ``checkpoint_dir/conduit_unit_<rank>.pt``.

        A relative ``checkpoint_dir`` (verl's ``trainer.default_local_dir`` is one, and TransferQueue hands it on as
        given) is taken from this process's working directory, not from each unit's (another directory, and on
        another node another machine); with several nodes it must be on a file system they share at the same path.
        """
        checkpoint_dir = os.path.abspath(checkpoint_dir)
        os.makedirs(checkpoint_dir, exist_ok=True)
        await self._answers([(r, u.save.remote(os.path.join(checkpoint_dir, f"conduit_unit_{r}.pt")))
                             for r, u in enumerate(self.units)], "a checkpoint save")

    async def load_checkpoint(self, checkpoint_dir: str) -> None:
        """Each unit restores what :meth:`save_checkpoint` wrote (same ``num_units``): all or none. Every unit first
        reads and checks its file (:meth:`_UnitState.stage`); only when all did does any replace what it holds.

        Raises:
            FileNotFoundError: a unit's file is missing (another ``num_units``); nothing is changed.
            SchemaError: a unit's file cannot be read (truncated, corrupt) or was not written by a Conduit unit of
                this ``num_units``; nothing is changed.

        A relative ``checkpoint_dir`` is taken from this process's working directory (as :meth:`save_checkpoint`).
        """
        checkpoint_dir = os.path.abspath(checkpoint_dir)
        paths = [os.path.join(checkpoint_dir, f"conduit_unit_{r}.pt") for r in range(len(self.units))]
        missing = [p for p in paths if not os.path.exists(p)]
        if missing:
            raise FileNotFoundError(f"Conduit checkpoint files missing: {missing}; restore with the num_units the "
                                    f"checkpoint was written with.")
        try:
            await self._answers([(r, u.stage.remote(paths[r])) for r, u in enumerate(self.units)],
                                "a checkpoint restore")
        except BaseException:
            for u in self.units:
                with contextlib.suppress(Exception):
                    u.unstage.remote()
            raise
        self._claimed.clear()  # unit 0 forgets its claims too: the restored samples are what the fields hold
        await self._answers([(r, u.install_staged.remote()) for r, u in enumerate(self.units)], "a checkpoint restore")

    def close(self) -> None:
        """Close TransferQueue's sockets; when this is the storage manager of ``tq.init``'s client in the process
        that started the units (``tq.close()`` closes that client), stop them too.

        ``tq.close()`` stops only SimpleStorage's units itself; Conduit's go here, and with the storage record it drops
        first (:func:`bootstrap`: the only way after a ``tq.init`` that failed before it built its client). Any other
        client's manager (TransferQueue builds more, e.g. for a ``StreamingDataset``) closes its sockets only: the
        units serve ``tq.init``'s client until ``tq.close()``.
        """
        run = self.cfg.get("_run_id")
        if run in _OWNED_RUNS and self._serves_tq_client():
            _OWNED_RUNS.discard(run)
            for u in getattr(self, "units", []):
                try:
                    ray.kill(u)
                except Exception:  # already gone with its node
                    pass
        super().close()

    def __del__(self) -> None:
        """Close the sockets of a manager nobody closed; never stop the units (a collected client is no
        ``tq.close()``; the units of a process that exits go with it, see :mod:`conduit_verl.unit`)."""
        with contextlib.suppress(Exception):  # (at interpreter exit modules may be half torn down)
            StorageManager.close(self)

    def _serves_tq_client(self) -> bool:
        """Whether this manager is the one of the client ``tq.init`` made in this process."""
        import transfer_queue.interface as tq_interface

        return getattr(getattr(tq_interface, "_TQ_CLIENT", None), "storage_manager", None) is self

    def stats(self) -> list[dict[str, Any]]:
        """Each unit's fields, placements, migrations and call telemetry (each unit within ``call_timeout_s``)."""
        refs: list[Any] = [u.stats.remote() for u in self.units]
        _, waiting = ray.wait(refs, num_returns=len(refs), timeout=float(self.cfg["call_timeout_s"]))
        if waiting:
            raise self._late([refs.index(w) for w in waiting], "a stats request")
        with _unit_errors():
            return ray.get(refs)

    async def _answers(self, calls: list[tuple[int, Any]], what: str) -> list[Any]:
        """The answers to ``calls`` ((unit rank, the call's ``ObjectRef``) pairs), in order, each within the backend's
        ``call_timeout_s``; the first error a unit raised, as :func:`_unit_errors` passes it.

        Raises:
            UnitTimeoutError: a unit did not answer in time (its process or host stopped answering while Ray still
                counts it alive: without a bound this call would wait forever). The calls may still run on the
                units; what they do stands as it would have.
        """
        if not calls:  # (asyncio.wait refuses an empty set: a clear of no samples raised ValueError)
            return []
        tasks = [asyncio.ensure_future(ref) for _, ref in calls]
        try:
            with _unit_errors():
                done, pending = await asyncio.wait(tasks, timeout=float(self.cfg["call_timeout_s"]),
                                                   return_when=asyncio.FIRST_EXCEPTION)
                failed = [t for t in tasks if t in done and t.exception() is not None]
                if failed:
                    raise cast(BaseException, failed[0].exception())
                if pending:
                    raise self._late([rank for (rank, _), t in zip(calls, tasks, strict=True) if t in pending], what)
            return [t.result() for t in tasks]
        finally:  # (this call raised, or was cancelled: stop waiting for the rest)
            for t in tasks:
                if not t.done():
                    t.cancel()

    def _late(self, ranks: list[int], what: str) -> UnitTimeoutError:
        return UnitTimeoutError(
            f"Conduit storage unit(s) {sorted(set(ranks))} of run {self.cfg['_run_id']} did not answer {what} within "
            f"call_timeout_s={float(self.cfg['call_timeout_s']):g} s (the process or its host stopped answering, "
            f"though Ray counts it alive). Check those units' nodes; raise transfer_queue.backend.{BACKEND}."
            f"call_timeout_s for calls that legitimately take longer.")


@contextlib.contextmanager
def _unit_errors() -> Iterator[None]:
    """Around calls to the storage units: a Conduit error a unit raised reaches the caller as itself.

    Ray hands a unit's exception over as ``RayTaskError(<its type>)``, whose message starts with Ray's remote
    traceback; a :class:`~conduit.ConduitError` (the adapter's own typed errors included) is re-raised as the
    unit's error, its own message first, with the Ray error (the remote traceback) as its ``__cause__``. Any
    other error passes as Ray raised it.
    """
    try:
        yield
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, ConduitError):
            raise e.cause from e
        raise


def _no_rows(col: PackedColumn) -> PackedColumn:
    """``col`` without its samples: its dtype and shape-row width only."""
    return PackedColumn(col.values[:0], col.lengths[:0], col.shapes[:0])


def _same_kind(name: str, parts: list[Any]) -> None:
    """Check that the units' parts of field ``name`` (wire columns or object lists) can form one column.

    Raises:
        SchemaError: the units hold the field in different kinds or dtypes (racing first puts are refused by unit
            0's claim, so only units written otherwise, e.g. by a restore of mismatched checkpoint files, get here).
    """
    kinds = {f"tensors of {p['dtype']}" if isinstance(p, dict) else "Python objects" for p in parts}
    if len(kinds) > 1:
        raise SchemaError(f"Field {name!r} is held as {' and as '.join(sorted(kinds))} on different Conduit storage "
                          f"units (e.g. restored from checkpoint files of different runs), so they cannot be read as "
                          f"one column; put the values again under another field name, in one kind and dtype.")


def _objects_column(items: list[Any]) -> torch.Tensor | NonTensorStack:
    """An object field's values as SimpleStorage returns them: when every value is a tensor, one tensor (0-d values
    stacked densely, others a jagged, else strided, nested tensor); otherwise a ``NonTensorStack``."""
    if items and all(isinstance(x, torch.Tensor) for x in items):
        return torch.stack(items) if all(x.dim() == 0 for x in items) else nested_or_stack(items)
    return NonTensorStack(*items)


def _owned(col: PackedColumn) -> PackedColumn:
    """Tensors that own writable memory (Ray hands read-only shared memory to readers)."""
    return PackedColumn(col.values.clone(), col.lengths.clone(), col.shapes.clone())
