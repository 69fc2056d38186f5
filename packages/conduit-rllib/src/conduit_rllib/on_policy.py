"""On-policy delivery for RLlib's Learner: train batches in, minibatches out, through ``conduit.OnPolicy``.

RLlib's PPO Learner turns a rollout into one train batch (its learner connector adds
advantages and value targets) and then cuts it into minibatches for ``num_epochs`` passes.
:class:`MinibatchFeed` takes over the cutting: the train batch is ingested into a
:class:`conduit.ExperienceDataPlane` with :class:`conduit.OnPolicy` semantics under the
version of the policy that produced it, sealed, and delivered as M minibatches per epoch
(each row exactly once per epoch) or, with ``minibatch_size`` (what the PPO learner uses), as
RLlib's cyclic minibatches of exactly that size (each row in every epoch, a few rows once more
to fill the last minibatch); never mixing versions, stale rollouts dropped or refused. While
minibatch k trains the feed is already gathering minibatch k + 1 on a worker thread.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import numpy as np
import torch
from conduit import (
    CapacityError,
    ConfigurationError,
    DevicePlacement,
    EmptyBufferError,
    ExperienceBatch,
    ExperienceDataPlane,
    ExperienceSchema,
    OnPolicy,
    Placement,
    SampleInfo,
    SchemaError,
    Synchronous,
)
from conduit.batch import as_tensor
from conduit.checks import is_bool, is_int
from conduit.scheduling.worker import Job, Worker
from conduit.semantics.onpolicy import check_version
from ray.rllib.core.columns import Columns
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch

from conduit_rllib.errors import UnsupportedConfigError
from conduit_rllib.transitions import storable_field

__all__ = ["MinibatchFeed"]


#: a column's layout: its leaf field's name (a flat column), or a dict / tuple of layouts (a nested one)
Layout = Any


def _leaf(name: str, col: Any) -> torch.Tensor:
    """One array of a train-batch column (``name``: its field's name) as a tensor, refused typed if unstorable."""
    if isinstance(col, np.ndarray) and col.dtype.kind in "OSUVMm":  # objects, strings, records, dates
        raise UnsupportedConfigError(f"Train-batch column {name!r} holds {col.dtype} values; Conduit's "
                                     f"on-policy delivery takes numeric arrays per column. Drop the column "
                                     f"from the train batch (or encode it as numbers).")
    try:
        t = as_tensor(col)
    except TypeError as e:  # a NumPy dtype torch has no counterpart for (e.g. np.longdouble)
        raise UnsupportedConfigError(f"Train-batch column {name!r} holds {col.dtype} values, which torch "
                                     f"cannot hold ({e}); cast the column to a torch-supported dtype "
                                     f"(e.g. float64) or drop it from the train batch.") from e
    if t.dim() == 0:  # (the rows are counted from a column's first dimension)
        raise SchemaError(f"Train-batch column {name!r} is a single value (a 0-d array), not one row per "
                          f"timestep; give it a first dimension of the batch's rows (e.g. col[None] "
                          f"repeated per row) or drop it from the train batch.")
    return t


def _flatten(name: str, col: Any, cols: dict[str, torch.Tensor]) -> Layout:
    """Add the arrays of column ``name`` to ``cols`` and return its layout. A dict or tuple (a Dict/Tuple
    action or observation space) is flattened depth first: its arrays become fields named by their path
    (``actions[move]``, ``actions[1]``), one row per timestep each."""
    if isinstance(col, (torch.Tensor, np.ndarray)):
        if name in cols:
            raise UnsupportedConfigError(f"Train-batch column {name!r} occurs twice once nested columns are "
                                         f"flattened (Conduit names a nested array by its path, e.g. "
                                         f"'actions[move]'); rename one of them.")
        cols[name] = _leaf(name, col)
        return name
    if isinstance(col, Mapping) and col:
        return {key: _flatten(f"{name}[{key}]", value, cols) for key, value in col.items()}
    if isinstance(col, tuple) and col:
        return tuple(_flatten(f"{name}[{i}]", value, cols) for i, value in enumerate(col))
    raise UnsupportedConfigError(f"Train-batch column {name!r} is a {type(col).__name__}; Conduit's on-policy "
                                 f"delivery takes arrays with one row per timestep, or dicts and tuples of them "
                                 f"(nested action and observation spaces). Convert or drop the column, or build "
                                 f"this config without conduit_rllib.enable.")


def _columns(batch: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Layout]]:
    """The train batch's arrays as flat fields (nested columns flattened, see :func:`_flatten`), and each
    column's layout to rebuild it from them (:func:`_nest`). SampleBatch bookkeeping (``_``-prefixed columns
    that are no arrays) is left out."""
    cols: dict[str, torch.Tensor] = {}
    layout: dict[str, Layout] = {}
    for name, col in batch.items():
        if name.startswith("_") and not isinstance(col, (torch.Tensor, np.ndarray)):
            continue  # SampleBatch bookkeeping
        if name in (Columns.STATE_IN, Columns.STATE_OUT):
            raise UnsupportedConfigError(f"Train-batch column {name!r} holds a recurrent module's state; Conduit's "
                                         f"on-policy delivery cuts minibatches by timestep and cannot keep "
                                         f"sequences whole. Use a feed-forward module, or build this config "
                                         f"without conduit_rllib.enable (RLlib's own minibatching).")
        layout[name] = _flatten(name, col, cols)
    return cols, layout


def _nest(layout: Layout, cols: Mapping[str, torch.Tensor]) -> Any:
    """The column of ``layout`` rebuilt from the delivered fields ``cols`` (dicts and tuples as ingested)."""
    if isinstance(layout, str):
        return cols[layout]
    if isinstance(layout, dict):
        return {key: _nest(sub, cols) for key, sub in layout.items()}
    return tuple(_nest(sub, cols) for sub in layout)


def _cyclic_plan(n: int, size: int, epochs: int, total: int = 0) -> tuple[int, int]:
    """(minibatches, passes) of RLlib's cyclic iterator over ``n`` rows: ``total`` minibatches of ``size`` rows
    when ``total > 0`` (several learners in lock step), else ceil(epochs * n / size); they walk
    ceil(minibatches * size / n) passes over the rows."""
    k = total if total > 0 else -(-epochs * n // size)
    return k, -(-k * size // n)


def _join(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The rows of ``parts`` (same columns) one after another, in fresh memory: one concatenation per column."""
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


class _CyclicOrder(OnPolicy):
    """RLlib's minibatch order: ``MiniBatchCyclicIterator`` walks the first epoch in the train
    batch's own order and reshuffles only when an epoch is covered; so here epoch 0 is the
    identity and each later epoch a seeded permutation (with ``shuffle``).

    With ``cycle`` (a minibatch size) it also makes RLlib's cuts: the epochs form one stream of
    rows cut into ``K = ceil(E * N / cycle)`` minibatches of exactly ``cycle`` rows (``K = total``
    when ``total > 0``: RLlib's ``num_total_minibatches``, which keeps several learners in lock step). Conduit
    delivers the stream as pieces that end at an epoch's end or at a minibatch's end (the feed
    joins the pieces of one minibatch), and when ``E * N`` is no multiple of ``cycle`` the last
    minibatch is filled from the head of one more pass (``num_epochs`` is then the passes the
    current rollout needs; ``rllib_epochs`` keeps E).
    """

    def __init__(self, *, cycle: int | None = None, total: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._rollout_seed = 0  # seeds the current rollout's shuffled epochs (see epoch_order)
        if cycle is not None and (isinstance(cycle, bool) or not isinstance(cycle, int) or cycle <= 0):
            raise ConfigurationError(f"minibatch_size must be a positive int, got {cycle!r}.")
        if isinstance(total, bool) or not isinstance(total, int) or total < 0:
            raise ConfigurationError(f"num_total_minibatches must be an int >= 0 (0: count them from the epochs), "
                                     f"got {total!r}.")
        self.cycle = cycle
        self.total = total
        self.rllib_epochs = self.num_epochs

    def epoch_order(self, n: int, epoch: int) -> torch.Tensor:
        """Epoch 0 in the batch's order, each later one a permutation seeded by the rollout's one draw from the
        feed's generator (taken as epoch 0 starts), so the generator advances once per rollout whatever its rows and
        passes. Learners that cut shards of different sizes in lock step thus keep equal generators, and RLlib's
        restore, which loads learner 0's state into every learner, leaves each one the order it had."""
        if epoch == 0:
            self._rollout_seed = int(torch.randint(1 << 62, (1,), generator=self._gen))
            return torch.arange(n)
        if not self.shuffle:
            return torch.arange(n)
        return torch.randperm(n, generator=torch.Generator().manual_seed(self._rollout_seed + epoch))

    def epoch_sizes(self, n: int, epoch: int) -> list[int]:
        if self.cycle is None:
            return super().epoch_sizes(n, epoch)
        k, passes = _cyclic_plan(n, self.cycle, self.rllib_epochs, self.total)
        if epoch == 0:
            self.num_epochs = passes  # this rollout's passes (checked by OnPolicy against the sizes)
        lo, hi = epoch * n, min((epoch + 1) * n, k * self.cycle)
        cuts = [lo, *range((lo // self.cycle + 1) * self.cycle, hi, self.cycle), hi]
        return [b - a for a, b in zip(cuts, cuts[1:], strict=False)]

    def state_dict(self) -> dict[str, Any]:
        return dict(super().state_dict(), num_epochs=self.num_epochs)  # the current rollout's passes

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)  # validates
        passes = state.get("num_epochs")
        if isinstance(passes, int) and not isinstance(passes, bool) and passes > 0:
            self.num_epochs = passes


class MinibatchFeed:
    """An on-policy minibatch source for one RLModule, backed by a Conduit data plane.

    Keyword Args:
        num_minibatches: M, minibatches per epoch (the learner sets it per rollout with
            :meth:`configure`).
        minibatch_size: instead of M, RLlib's cyclic cuts of exactly this many rows (see
            :meth:`configure`).
        num_epochs: E, passes over each rollout.
        max_staleness: versions a rollout may lag the policy and still be delivered.
        on_stale: ``"drop"`` (skip it, counted) or ``"raise"`` (:class:`conduit.StaleExperienceError`).
        shuffle: reshuffle each epoch after the first (the first keeps the batch's order, as
            RLlib's ``MiniBatchCyclicIterator`` does).
        seed: seeds the per-epoch permutations.
        placement: where rollouts live (default: the device the train batch is on).
        prefetch: gather minibatch k + 1 on a worker thread while k trains.
        capacity: rows of storage at least (default 0: sized by the rollouts). This bounds what may
            wait for delivery; see below.

    Raises:
        conduit.ConfigurationError: an argument is invalid (e.g. ``capacity=-1``, ``prefetch="no"``, a
            ``placement`` that is no :class:`conduit.Placement`), checked here rather than at the first ingest.

    How much may wait: rollouts ingested and not yet fully delivered (sealed or still open; the one
    being delivered counts whole until its last minibatch) wait in storage of :attr:`capacity` rows.
    The storage is sized when a rollout arrives while nothing waits, to ``max(capacity, the smallest
    power of two >= 2 x that rollout's rows)``, and does not grow while anything waits. So
    ``capacity // rows`` rollouts of the size that sized it can wait: at least two, and with the default
    ``capacity`` 0 two or three (2 of 1000 rows in 2048, 3 of 300 in 1024); an ingest that would
    exceed :attr:`capacity` raises :class:`conduit.CapacityError` and ingests nothing. The PPO learner
    keeps one rollout waiting at a time; to queue more yourself, pass ``capacity`` >= the rows you let
    wait. (A bound in rows, not rollouts: rows are what storage costs, and rollouts need not be of one
    size.) The capacity travels in :meth:`state_dict`, so a restored feed holds what the saved one held, not
    what the first rollout after the restore would size.
    """

    def __init__(self, *, num_minibatches: int = 1, num_epochs: int = 1, max_staleness: int = 0,
                 on_stale: Literal["drop", "raise"] = "drop", shuffle: bool = True, seed: int = 0,
                 placement: Placement | None = None, prefetch: bool = True, capacity: int = 0,
                 minibatch_size: int | None = None) -> None:
        self._sem_args: dict[str, Any] = dict(num_minibatches=num_minibatches, num_epochs=num_epochs,
                                              max_staleness=max_staleness, on_stale=on_stale, shuffle=shuffle,
                                              seed=seed, cycle=minibatch_size, total=0)
        _CyclicOrder(**self._sem_args)  # validate now: errors at construction
        if placement is not None and not isinstance(placement, Placement):
            raise ConfigurationError(f"placement must be a conduit Placement (e.g. HostPlacement() or "
                                     f"DevicePlacement('cuda')) or None (the train batch's device), got {placement!r}.")
        if not is_bool(prefetch):  # (a string such as "no" is truthy: it prefetched)
            raise ConfigurationError(f"prefetch must be True or False, got {prefetch!r}.")
        if not is_int(capacity) or capacity < 0:
            raise ConfigurationError(f"capacity must be an int >= 0 (rows of storage; 0: sized by the rollouts), "
                                     f"got {capacity!r}.")
        self.placement = placement
        self.prefetch = bool(prefetch)
        self.capacity = int(capacity)
        self._min_capacity = self.capacity  # the capacity asked for: a restored state's is raised to it
        self.edp: ExperienceDataPlane | None = None
        #: the columns of the rollouts :attr:`edp` holds, each a field's name or (nested) a dict/tuple of them
        self._layout: dict[str, Layout] = {}
        self.module_id: str | None = None
        #: SampleInfo of every minibatch of the rollout being (or last) delivered, in order
        self.delivered: list[SampleInfo] = []
        self._policy_version = 0
        self._pool: Worker | None = None
        self._lock = threading.Lock()
        self._restored: dict[str, Any] | None = None  # loaded state waiting for the next data plane
        # delivered but never handed to the caller (a prefetched minibatch, or the head of one whose next piece
        # could not be delivered, when an iteration stopped): the next minibatches() starts with it
        self._held: tuple[dict[str, torch.Tensor], int, SampleInfo] | None = None
        # the prefetch an iteration started and did not take (yet): whoever comes first (that iteration taking it,
        # its end, or the next minibatches()) claims it, so it is held exactly once, in order
        self._inflight: Job[tuple[ExperienceBatch, SampleInfo]] | None = None
        # close() calls so far: an iteration begun before one (on another thread) is refused from then on
        self._closes = 0

    # -- configuration -----------------------------------------------------------------------
    @property
    def semantics(self) -> OnPolicy:
        if self.edp is None:
            return _CyclicOrder(**self._sem_args)
        sem = self.edp.semantics
        assert isinstance(sem, OnPolicy)
        return sem

    def _idle(self) -> bool:
        """Nothing is waiting for delivery: no rollout pending, no delivery held, and no prefetch out (a
        stopped iteration's prefetch may hold its rollout's last minibatch while the plane is already empty)."""
        if self._prefetch_out():
            return False
        if self.edp is None:
            return True
        sem = self.semantics
        return sem.pending_rollouts == 0 and len(self.edp) == 0 and self._held is None

    def _settle(self) -> None:
        """Wait for the gather a stopped iteration left running, if any (bounded: a delivery never waits for
        data). What it delivered stays in flight, for the next iteration to claim."""
        job = self._inflight
        if job is not None:
            job.wait()

    def _prefetch_out(self) -> bool:
        """Whether a prefetch is running or has delivered what nobody has taken yet (one that failed
        delivered nothing)."""
        job = self._inflight
        if job is None:
            return False
        if not job.done():
            return True
        try:
            job.result()
        except Exception:  # noqa: BLE001 - nothing was delivered
            return False
        return True

    def configure(self, *, num_minibatches: int = 1, num_epochs: int, shuffle: bool,
                  minibatch_size: int | None = None, num_total_minibatches: int = 0) -> None:
        """Set M (or the minibatch size), E and shuffling for the next rollout (only while nothing is
        waiting for delivery).

        Keyword Args:
            num_minibatches: M minibatches per epoch, sizes differing by at most one.
            minibatch_size: instead of M, RLlib's cuts (``MiniBatchCyclicIterator``): each minibatch
                has exactly this many rows and there are ``ceil(num_epochs * N / minibatch_size)`` of
                them for a rollout of N rows. The epochs are walked as one stream, so a minibatch may
                end one epoch and begin the next; each row is delivered in each of the ``num_epochs``
                epochs, and when ``num_epochs * N`` is no multiple of ``minibatch_size`` the last
                minibatch is filled with the head of one more pass (its ``ceil(...) * minibatch_size -
                num_epochs * N`` rows train once more, as in RLlib).
            num_total_minibatches: with ``minibatch_size``, exactly this many minibatches instead when > 0
                (RLlib's count for several learners in lock step, each cutting its own shard): the stream of
                passes goes on, or stops, at that many.
            num_epochs: E.
            shuffle: reshuffle each epoch after the first.

        Raises:
            conduit.ConfigurationError: rollouts are still pending, or the values are invalid (never rounded:
                ``num_epochs=2.5`` is refused, not made 2); nothing changes then.
        """
        args = dict(self._sem_args, num_minibatches=num_minibatches, num_epochs=num_epochs, shuffle=shuffle,
                    cycle=minibatch_size, total=num_total_minibatches)
        _CyclicOrder(**args)  # validates (never rounds: num_epochs=2.5 is refused, not made 2)
        args.update(num_minibatches=int(num_minibatches), num_epochs=int(num_epochs), shuffle=bool(shuffle))
        if args == self._sem_args:
            return
        if not self._idle():
            raise ConfigurationError("Cannot change minibatching while a rollout is waiting for delivery; "
                                     "consume it first.")
        self._sem_args = args
        if self.edp is not None:
            sem = self.semantics
            assert isinstance(sem, _CyclicOrder)
            sem.num_minibatches, sem.num_epochs, sem.shuffle = args["num_minibatches"], args["num_epochs"], \
                args["shuffle"]
            sem.cycle, sem.total, sem.rllib_epochs = args["cycle"], args["total"], args["num_epochs"]

    def _ensure(self, cols: dict[str, torch.Tensor], n: int, layout: dict[str, Layout]) -> ExperienceDataPlane:
        fields = {name: storable_field(f"train-batch column {name!r}", tuple(col.shape[1:]), col.dtype)
                  for name, col in cols.items()}
        schema = ExperienceSchema(fields)
        device = next(iter(cols.values())).device
        edp = self.edp
        same = edp is not None and edp.schema == schema and layout == self._layout
        if edp is not None and same and n <= edp.capacity and edp.storage.device == device:
            return edp
        if edp is not None and not self._idle():
            if not same:
                # (dtypes and row shapes too: a column whose shape changed has the same name; and the nesting:
                # a tuple where a dict was)
                raise SchemaError(f"A rollout of {schema!r} (columns {layout}) arrived while one of {edp.schema!r} "
                                  f"(columns {self._layout}) is waiting; consume it first.")
            return edp  # too large: the ingest raises CapacityError
        if edp is not None:  # idle: its state goes on in the new plane (kept here should building that fail)
            self._restored = self.state_dict()
            edp.close()
            self.edp = None
        state = None if self._restored is None else self._full_state(self._restored)
        cap = max(self.capacity, 1 << int(np.ceil(np.log2(max(2 * n, 2)))))
        sem = _CyclicOrder(**self._sem_args)
        # a prefetch delivers one minibatch ahead, into the next delivery buffer: one buffer more than a plane's
        # default keeps each minibatch valid as long as without prefetch (until the one after the next is asked
        # for), also when prefetch is switched on later
        scheduler = Synchronous()
        scheduler.output_depth = Synchronous.output_depth + 1
        self.edp = ExperienceDataPlane(schema, capacity=cap, semantics=sem, scheduler=scheduler,
                                       placement=self.placement or DevicePlacement(device), device=device)
        self._layout = layout
        self._restored = None
        if state is not None:  # nothing is pending: carry the permutation RNG and counters over
            sem.load_state_dict(state)
        sem.policy_version = self._policy_version
        self.capacity = cap
        return self.edp

    # -- ingestion ----------------------------------------------------------------------------
    def ingest(self, module_id: str, batch: Mapping[str, Any], *, version: int) -> None:
        """Add a train batch (RLlib column -> array, one row per timestep) produced by policy ``version``.

        A column may also be a dict or tuple of such arrays, nested to any depth (the actions of a Dict/Tuple
        action space, a Dict observation): each array is stored as its own field, and every minibatch carries
        the column rebuilt as it came (same keys, same order, tuples as tuples), its arrays cut row for row
        with the others.

        Raises:
            UnsupportedConfigError: a column (or an array nested in one) is no numeric array, a column holds a
                recurrent module's state (``state_in``/``state_out``), or a second module is fed; nothing is
                ingested then.
            conduit.SchemaError: a column is a single value (a 0-d array), not one row per timestep; nothing is
                ingested then.
            conduit.ConfigurationError: ``version`` is not an integer (a NumPy or 0-d tensor integer is fine;
                a bool, float or string is refused, never rounded); nothing is ingested then.
            conduit.CapacityError: the rows waiting for delivery and this batch's would exceed
                :attr:`capacity` (see the class docstring); nothing is ingested. Deliver what waits first
                (:meth:`minibatches`), or build the feed with a larger ``capacity``.
            conduit.SchemaError / conduit.ConfigurationError: as :meth:`conduit.ExperienceDataPlane.ingest`.
        """
        version = check_version(version)
        cols, layout = _columns(batch)
        if not cols:
            raise SchemaError("The train batch has no columns.")
        n = int(next(iter(cols.values())).shape[0])
        with self._lock:
            if self.module_id is not None and module_id != self.module_id and not self._idle():
                raise UnsupportedConfigError(f"This feed serves module {self.module_id!r}, whose rollout waits for "
                                             f"delivery; give module {module_id!r}'s rows a feed of their own (one "
                                             f"feed per RLModule, as the PPO learner's conduit_feeds).")
            self.module_id = module_id
            edp = self._ensure(cols, n, layout)
            try:
                edp.ingest(cols, version=version)
            except CapacityError as e:
                raise CapacityError(
                    f"A rollout of {n} rows does not fit next to the {len(edp)} rows waiting for delivery "
                    f"({self.semantics.pending_rollouts} sealed rollout(s), the one being delivered counted whole, "
                    f"plus any rows ingested but not sealed) in this feed's storage of capacity {edp.capacity} rows, "
                    f"which grows only while nothing waits; nothing of it was ingested. Deliver the waiting "
                    f"rollouts first (minibatches()), or build the feed with MinibatchFeed(capacity=R) for up to "
                    f"R rows waiting.") from e

    def seal(self) -> None:
        """Close the current rollout: it becomes deliverable."""
        if self.edp is not None:
            self.edp.seal()

    def set_policy_version(self, version: int) -> None:
        """The learner's policy is now ``version``; staleness is measured against it.

        Raises:
            conduit.ConfigurationError: ``version`` is not an integer (a bool, float or string is refused,
                never rounded); the version is then unchanged.
        """
        v = check_version(version)
        if self.edp is not None:
            self.edp.set_policy_version(v)
        self._policy_version = v

    def drop_leftovers(self) -> None:
        """Drop what an abandoned iteration left pending (call after moving the policy version past it).

        An update that stopped mid-epoch (its ``_update`` raised) leaves its rollout waiting. The next
        update drops it here, before configuring and ingesting its own rollout, so the leftover neither
        blocks a change of M nor is delivered. Does nothing unless this feed drops every rollout behind
        the policy (``max_staleness=0``, ``on_stale="drop"``, as
        :class:`~conduit_rllib.learner.ConduitOnPolicyLearner` builds it): only then are all pending
        rollouts stale.
        """
        sem = self.semantics
        if sem.max_staleness != 0 or sem.on_stale != "drop":
            return
        # let a gather the abandoned iteration started finish first (waited for as the job it is: a no-op submitted
        # behind it would never run should a close() on another thread stop the worker meanwhile)
        self._settle()
        with self._lock:
            self._inflight = None  # what that gather delivered belongs to the abandoned rollout: dropped with it
            self._held = None  # the head of a minibatch of the abandoned rollout: dropped with it
            while not self._idle():
                try:
                    self._deliver()  # stale: dropped by the semantics, then EmptyBufferError
                except EmptyBufferError:
                    return

    @property
    def dropped_items(self) -> int:
        """Rows of stale rollouts skipped so far (``on_stale="drop"``)."""
        if self.edp is None:
            return 0 if self._restored is None else int(self._restored["dropped_items"])
        return self.semantics.dropped_items

    # -- checkpoint -----------------------------------------------------------------------------
    _STATE_KEYS = ("policy_version", "rng", "dropped_items", "last_sealed")

    def state_dict(self, *, drop_pending: bool = False) -> dict[str, Any]:
        """What outlives an update: the policy version, the epoch-permutation RNG, the drop count, the
        version of the last sealed rollout and the storage's :attr:`capacity` (rows).

        Exact between iterations: with nothing waiting for delivery, a feed that loads the state delivers
        what this one delivers from here on. A rollout still waiting (ingested, sealed, or partly delivered:
        an iteration in progress, or one that stopped mid-epoch) and a minibatch held for the next iteration
        are not saved, so a feed restored from such a state could not deliver the rest of them: that is
        refused (below) unless ``drop_pending``. A gather a stopped iteration left running is waited for
        first (a delivery may start an epoch, which draws its permutation from the RNG), so the state does
        not depend on the threads' timing. The state is a copy: changing it does not change this feed.

        Keyword Args:
            drop_pending: return, instead, the state this feed goes on from once what is waiting is dropped:
                its rollouts' rows counted in ``dropped_items`` (as a drop for staleness counts them), a held
                minibatch discarded. That is exactly what follows an update of
                :class:`~conduit_rllib.learner.ConduitOnPolicyLearner` that stopped part-way, as its next update
                drops the leftover (:meth:`drop_leftovers`). This feed itself keeps what is waiting.

        Raises:
            conduit.ConfigurationError: something is waiting for delivery and ``drop_pending`` is False; nothing
                changes. Checkpoint between iterations (once :meth:`minibatches` is exhausted).
        """
        self._settle()
        if self.edp is None and self._restored is not None:  # (a copy: the caller may change what it gets)
            return dict(self._restored, policy_version=self._policy_version,  # (set_policy_version since)
                        rng=self._restored["rng"].clone(), capacity=self.capacity)
        full = self.semantics.state_dict()
        waiting = [r for r in (full["cur"], *full["sealed"], full["open"]) if r is not None]
        if not drop_pending and not self._idle():
            held = " and a minibatch delivered but not handed over yet" if self._held or self._prefetch_out() else ""
            raise ConfigurationError(
                f"This on-policy feed has {len(waiting)} rollout(s) waiting for delivery{held} (an iteration in "
                f"progress, or one that stopped part-way); a state cannot carry them, so a feed restored from it "
                f"would not deliver the rest. Checkpoint between iterations, once minibatches() is exhausted (for "
                f"a learner: between updates), or call state_dict(drop_pending=True) for the state this feed goes on "
                f"from once what is waiting is dropped.")
        dropped = full["dropped_items"] + (sum(int(r[2]) for r in waiting) if drop_pending else 0)
        return {"policy_version": self._policy_version, "rng": full["rng"].clone(),
                "dropped_items": dropped, "last_sealed": full["last_sealed"], "capacity": self.capacity}

    def _full_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """An idle ``OnPolicy`` state carrying ``state``'s values."""
        return dict(_CyclicOrder(**self._sem_args).state_dict(), **{k: state[k] for k in self._STATE_KEYS})

    def check_state_dict(self, state: Any) -> None:
        """Raise what :meth:`load_state_dict` would for ``state``, changing nothing (e.g. to check it before
        restoring something else that may still refuse its own part).

        Raises:
            conduit.ConfigurationError: the state is damaged.
        """
        if not isinstance(state, Mapping) or any(k not in state for k in self._STATE_KEYS):
            raise ConfigurationError(f"This on-policy feed state is damaged (expected the keys {self._STATE_KEYS}); "
                                     f"load an undamaged MinibatchFeed.state_dict().")
        cap = state.get("capacity", 0)  # (a state saved before the capacity was kept: none)
        if not is_int(cap) or cap < 0:
            raise ConfigurationError(f"This on-policy feed state is damaged: its capacity is {cap!r}, not an int >= 0 "
                                     f"(rows of storage); load an undamaged MinibatchFeed.state_dict().")
        # (validates the versions, the drop count and the RNG state as the data plane does)
        _CyclicOrder(**self._sem_args).load_state_dict(self._full_state(state))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; whatever was waiting for delivery is discarded. The feed keeps a copy of
        ``state``'s RNG tensor (changing either later does not change the other). Its :attr:`capacity` becomes
        the saved one's (at least the ``capacity`` this feed was built with), so the next rollout is stored as
        in the saved feed; a state saved without a capacity (by an older version) leaves this feed's as it is.
        Its versions are integers as :meth:`set_policy_version` takes them (a NumPy or 0-d tensor integer is kept
        as an int; a version may be negative, as the data plane allows).

        Raises:
            conduit.ConfigurationError: the state is damaged (nothing changes then): a key missing, a version that is
                no integer (a bool, float or text; never rounded), a ``dropped_items`` or ``capacity`` that is no int
                >= 0, or an ``rng`` that is no ``torch.Generator`` state.
        """
        self.check_state_dict(state)
        self._settle()  # let a running gather finish before the data plane goes (as in drop_leftovers)
        with self._lock:
            if self.edp is not None:
                self.edp.close()
                self.edp = None
            self._held = self._inflight = None
            # a copy of the RNG state: the caller's tensor stays the caller's (checked a tensor above)
            last_sealed = state["last_sealed"]  # (integers of any kind checked above: kept as plain ints)
            self._restored = {"policy_version": int(state["policy_version"]), "rng": state["rng"].clone(),
                              "dropped_items": int(state["dropped_items"]),
                              "last_sealed": None if last_sealed is None else int(last_sealed)}
            self._policy_version = self._restored["policy_version"]
            if "capacity" in state:
                self.capacity = max(self._min_capacity, int(state["capacity"]))

    # -- delivery -------------------------------------------------------------------------------
    def _deliver(self, closes: int | None = None) -> tuple[ExperienceBatch, SampleInfo]:
        """The next delivery; for an iteration begun when :attr:`_closes` was ``closes``, the closed error once a
        close() followed (read after the data plane: a close counts itself before it drops the plane)."""
        edp = self.edp
        if closes is not None and closes != self._closes:
            raise self._closed_error()
        if edp is None:
            raise EmptyBufferError("No rollout was ingested; ingest one and seal it.")
        try:
            return edp.deliver()
        except ConfigurationError as e:
            if closes is not None and closes != self._closes:  # the plane was closed by close() meanwhile
                raise self._closed_error() from e
            raise

    @staticmethod
    def _closed_error() -> ConfigurationError:
        return ConfigurationError("This MinibatchFeed was closed (close() ran on another thread) while an iteration "
                                  "of minibatches() was in progress: its rollout was dropped (counted in "
                                  "dropped_items) and the iteration cannot go on. Ingest and seal a new rollout, "
                                  "then iterate minibatches() again.")

    def _record(self, info: SampleInfo) -> None:
        if info.epoch == 0 and info.minibatch == 0:
            self.delivered = []
        self.delivered.append(info)

    def _to_rllib(self, cols: dict[str, torch.Tensor], env_steps: int | None) -> MultiAgentBatch:
        assert self.module_id is not None
        rows = int(next(iter(cols.values())).shape[0])
        batch = SampleBatch({name: _nest(layout, cols) for name, layout in self._layout.items()})
        return MultiAgentBatch({self.module_id: batch}, env_steps=rows if env_steps is None else env_steps)

    def minibatches(self, *, env_steps: int | None = None) -> Iterator[MultiAgentBatch]:
        """Every minibatch of the oldest waiting rollout, as RLlib train batches: M per epoch for E
        epochs, or, with ``minibatch_size``, RLlib's ``ceil(E * N / minibatch_size)`` minibatches of
        exactly ``minibatch_size`` rows (each joined from the pieces Conduit delivered; ``delivered``
        lists the pieces).

        The first delivery happens now, so an empty or stale buffer raises here. With ``prefetch``
        the next delivery is gathered while the caller trains on the current minibatch; a minibatch is
        valid until the caller asks for the one after the next (with ``minibatch_size``: until it asks
        for the next one, whose pieces may reuse its buffers). When an iteration stops early (the
        caller's training raised, or a piece could not be delivered), what was delivered but not handed
        over (the prefetched minibatch, or the head of a minibatch that spans an epoch boundary) is kept,
        and the next call starts with it: prefetching never changes the rows delivered, and a minibatch
        is never handed over in part. A minibatch whose rollout went stale between two of its pieces is
        dropped with the rollout (never joined with another rollout's rows).

        Keyword Args:
            env_steps: the env steps each minibatch reports (``MultiAgentBatch.env_steps()``, what
                RLlib sums into ``num_env_steps_trained``). RLlib's own iterator reports the whole
                train batch's env steps on every minibatch; default: the minibatch's rows.

        A :meth:`close` on another thread while an iteration is in progress ends it: its next step raises
        :class:`conduit.ConfigurationError` (a minibatch already handed over stays valid as stated above).

        Raises:
            conduit.EmptyBufferError: nothing sealed is waiting.
            conduit.StaleExperienceError: the rollout is too stale and ``on_stale="raise"``.
            conduit.ConfigurationError: ``env_steps`` is no int >= 0 (nothing is delivered then); or (from the
                iteration) the feed was closed on another thread meanwhile.
        """
        if env_steps is not None and (not is_int(env_steps) or env_steps < 0):  # (RLlib would sum it into results)
            raise ConfigurationError(f"env_steps must be None (each minibatch's rows) or an int >= 0 (the env steps "
                                     f"each minibatch reports, e.g. the train batch's env_steps()), got "
                                     f"{env_steps!r}.")
        closes = self._closes
        self._claim_inflight()  # an earlier iteration, stopped but not closed yet, prefetched the next delivery
        first = self._take_held()
        if first is None:
            first = self._piece(self._deliver(closes))
        return self._iterate(self._complete(first, closes), env_steps, closes)

    def _claim_inflight(self) -> None:
        """Hold what the prefetch of a stopped iteration delivered (see :meth:`minibatches`), once."""
        job, self._inflight = self._inflight, None
        if job is None:
            return
        job.wait()
        try:
            batch, info = job.result()
        except Exception:  # noqa: BLE001 - nothing was delivered: the next call delivers it again
            return
        self._record(info)
        self._held = ({k: batch.tensor(k).clone() for k in batch}, batch.batch_size, info)

    def _take_held(self) -> tuple[dict[str, torch.Tensor], int, SampleInfo] | None:
        """The held delivery (see :meth:`minibatches`), unless its rollout has gone stale since (then it is
        dropped with the rollout, or StaleExperienceError with ``on_stale="raise"``, still held)."""
        held = self._held
        if held is None:
            return None
        sem = self.semantics
        version = held[2].version
        assert version is not None  # on-policy deliveries carry their rollout's version
        if sem.stale(version):
            if sem.on_stale == "raise":
                raise sem.stale_error(version)
            self._held = None
            return None  # the rest of its rollout is dropped by the next delivery
        self._held = None
        return held

    def _piece(self, delivery: tuple[ExperienceBatch, SampleInfo]) -> tuple[dict[str, torch.Tensor], int, SampleInfo]:
        batch, info = delivery
        self._record(info)
        return {k: batch.tensor(k) for k in batch}, batch.batch_size, info

    def _complete(self, head: tuple[dict[str, torch.Tensor], int, SampleInfo], closes: int
                  ) -> tuple[dict[str, torch.Tensor], int, SampleInfo]:
        """``head`` joined with the pieces that continue its minibatch into the next epochs (RLlib's cuts).

        The pieces are collected and joined once (one concatenation per column), so a minibatch of P
        pieces copies each of its rows at most twice, however large P is (a minibatch far larger than the
        rollout spans many epochs): a piece is copied out of Conduit's reused delivery buffers only when
        the next delivery could overwrite it (``scheduler.output_depth``). ``closes``: the iteration's
        :attr:`_closes` (see :meth:`_deliver`).
        """
        cols, rows, info = head
        edp = self.edp
        sem = self.semantics
        size = sem.cycle if isinstance(sem, _CyclicOrder) else None
        if size is None or rows >= size or info.last:
            return head
        if edp is None:  # dropped since the head was delivered: a close() on another thread
            raise self._closed_error()
        valid_for = max(1, int(edp.scheduler.output_depth))  # deliveries a delivered piece stays valid for
        parts, owned = [cols], [False]  # a part's tensors, and whether they are fresh memory (not a delivery buffer)
        while rows < size and not info.last:
            for i in range(len(parts) - valid_for + 1):  # the next delivery may reuse these parts' buffers
                if not owned[i]:
                    parts[i], owned[i] = {k: v.clone() for k, v in parts[i].items()}, True
            try:
                batch, nxt = self._deliver(closes)
            except BaseException:
                # keep the head for the next call: its continuation is still waiting (fresh memory: the
                # pieces' buffers are reused by later deliveries); not once a close() dropped that continuation
                # (checked under the lock close() drops what is held under, after counting itself)
                held = (_join(parts) if len(parts) > 1 else {k: v.clone() for k, v in parts[0].items()}, rows, info)
                with self._lock:
                    if closes == self._closes:
                        self._held = held
                raise
            self._record(nxt)
            piece = {k: batch.tensor(k) for k in batch}
            if nxt.epoch != (info.epoch or 0) + 1 or nxt.minibatch != 0:
                # the head's rollout went stale and was dropped: another rollout begins; the head goes with it
                parts, owned, rows = [piece], [False], batch.batch_size
            else:
                parts.append(piece)
                owned.append(False)
                rows += batch.batch_size
            info = nxt
        return (parts[0] if len(parts) == 1 else _join(parts)), rows, info

    def _iterate(self, first: tuple[dict[str, torch.Tensor], int, SampleInfo],
                 env_steps: int | None, closes: int) -> Iterator[MultiAgentBatch]:
        pending: Job[tuple[ExperienceBatch, SampleInfo]] | None = None
        current = first
        try:
            while True:
                cols, _, info = current
                if not info.last and self.prefetch and closes == self._closes:
                    pool = self._pool  # (read once: a close() on another thread may drop it meanwhile)
                    if pool is None:
                        pool = self._pool = Worker("conduit-minibatch")
                        weakref.finalize(self, pool.stop)  # dropped without close(): the thread ends
                    try:
                        pending = self._inflight = pool.submit(self._deliver, closes)
                    except ConfigurationError:
                        pass  # the worker was stopped by a close() on another thread: the next step raises (below)
                # (a minibatch delivered is handed over, also when the feed was closed since: it is valid as ever)
                yield self._to_rllib(cols, env_steps)
                if info.last:
                    return
                if closes != self._closes:  # closed (on another thread) since the iteration began
                    raise self._closed_error()
                if pending is not None:
                    job, pending = pending, None
                    if self._inflight is not job:  # claimed by a later minibatches() (or discarded): this
                        return  # iteration was stopped
                    self._inflight = None
                    current = self._complete(self._piece(job.result()), closes)
                else:
                    current = self._complete(self._piece(self._deliver(closes)), closes)
        finally:
            # the caller stopped early: keep what the gather delivered for later (unless claimed or discarded
            # since). Never wait for it here: this may run as the garbage collector finalises the iteration, on
            # any thread, the prefetch thread itself included (which would wait for itself); a gather still
            # running stays in flight, and the next minibatches() (or drop_leftovers, load_state_dict, close)
            # claims it
            if pending is not None and self._inflight is pending and pending.done():
                self._claim_inflight()

    def close(self) -> None:
        """Stop the prefetch thread and the data plane.

        What was waiting for delivery is discarded (its rollouts' rows counted in ``dropped_items``: the state
        kept is ``state_dict(drop_pending=True)``), and a later :meth:`ingest` starts a new data plane (and
        thread) that continues that state. A :meth:`drop_leftovers` or :meth:`load_state_dict` running on another
        thread meanwhile returns (it waits for the in-flight gather only, never for the stopped thread). An
        iteration of :meth:`minibatches` in progress on another thread raises :class:`conduit.ConfigurationError`
        at its next step (never waits for the stopped thread).
        """
        with self._lock:
            self._closes += 1  # first: an iteration that finds the plane or the worker gone finds this too
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown()
        with self._lock:
            self._held = self._inflight = None
            if self.edp is not None:
                self._restored = self.state_dict(drop_pending=True)  # what was waiting is dropped (counted)
                self.edp.close()
                self.edp = None
