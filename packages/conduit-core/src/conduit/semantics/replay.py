"""Replay semantics: sampling from a FIFO-evicting buffer, uniform or prioritized."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from numbers import Integral, Real
from typing import Any

import numpy as np
import torch

from conduit.batch import host_array
from conduit.checks import is_bool
from conduit.errors import CapacityError, ConfigurationError, EmptyBufferError, PriorityError
from conduit.semantics.base import RingHandles, SampleInfo, Selection, Semantics, check_seed
from conduit.semantics.sumtree import CompiledSumTree, sum_tree
from conduit.storage.base import MAX_HANDLE, AppendResult, Storage

__all__ = ["Replay", "Sampler", "UniformSampler", "PrioritizedSampler"]


def _finite_non_negative(x: object) -> bool:
    """Whether ``x`` is a real number (not a bool), finite and >= 0."""
    if type(x) is float:  # the common case, without the ABC check (a delivery's beta)
        return 0.0 <= x < math.inf
    return not isinstance(x, bool) and isinstance(x, Real) and 0 <= float(x) < math.inf


_FLOAT64_MAX = float(np.finfo(np.float64).max)
#: the dtypes of the arrays the compiled priority update takes as they are (a byte-swapped one is another object)
_INT64, _FLOAT64 = np.dtype(np.int64), np.dtype(np.float64)

#: the most items one replay delivery draws (a batch of more is refused, typed, before anything is drawn)
MAX_DRAW = 2**31 - 1


class Sampler(ABC):
    """Chooses slots among the live items of a storage.

    Contract for implementations:
      * draws are a deterministic function of the seed and the call sequence;
      * ``sample`` never returns an evicted slot;
      * state round-trips through ``state_dict``/``load_state_dict``.
    """

    #: whether this sampler keeps priorities (and accepts ``update_priorities``)
    prioritized: bool = False

    def reset(self, storage: Storage, seed: int) -> None:
        self.storage = storage

    def on_append(self, result: AppendResult, priorities: torch.Tensor | None) -> None:  # noqa: B027
        """Track appended and evicted items."""

    @abstractmethod
    def sample(self, n: int, *, replace: bool, beta: float | None) -> Selection: ...

    def draw_state(self) -> Any:
        """The RNG state a draw advances, for :meth:`rewind_draws` (None: this sampler cannot rewind)."""
        return None

    def rewind_draws(self, state: Any) -> None:  # noqa: B027
        """Put back an RNG state :meth:`draw_state` returned."""

    def update(self, handles: torch.Tensor | np.ndarray, priorities: torch.Tensor | np.ndarray) -> int:
        raise ConfigurationError(f"{type(self).__name__} keeps no priorities; use PrioritizedSampler.")

    @abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def _slots(self, handles: torch.Tensor) -> torch.Tensor:
        """The ring slots of live ``handles``."""
        st = self.storage
        if st.next_handle <= st.capacity:  # the ring has not wrapped: handle == slot
            return handles
        return torch.remainder(handles, st.capacity)


#: a draw of n distinct items from m rejects repeats (O(n log n), independent of m) while
#: ``n * DISTINCT_BY_REJECTION <= m``, and takes the head of a permutation of all m (``randperm``, O(m)) when n is a
#: larger fraction of them. Measured on CPU (torch 2.13, NumPy 2.4, one thread): the two cost the same near
#: n = m / 20 for m = 1e4 and 1e5 and near m / 10 for m = 1e6 (randperm ~8 ns per item; the rejection ~100 ns per
#: item drawn once repeats must be sorted out); below m of a few thousand randperm is a few microseconds cheaper.
#: For n = 512: 13 us against 9 ms at m = 1e6, 37 us against 39 us at m = 1e4
DISTINCT_BY_REJECTION = 16


def draw_distinct(m: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` distinct offsets in ``[0, m)`` (int64), drawn from ``gen``: every ``n``-subset is equally likely and
    its order uniformly random, exactly, and the draw is a function of ``gen``'s state alone.

    A small ``n`` costs O(n log n), not O(m): offsets are drawn with replacement (a few more than ``n``, for the
    repeats) and the first ``n`` distinct ones are kept, in draw order; too few distinct ones draw more. The result
    is the first ``n`` distinct values of an i.i.d. uniform stream, whose law no relabelling of ``[0, m)`` changes,
    so every ordered ``n``-tuple of distinct offsets is equally likely. A large ``n`` (see
    :data:`DISTINCT_BY_REJECTION`) takes the head of a uniform permutation instead. ``n <= m`` is the caller's to
    check.
    """
    if n == 0:
        return torch.empty(0, dtype=torch.int64)
    if n * DISTINCT_BY_REJECTION > m:
        return torch.randperm(m, generator=gen)[:n]
    draws = torch.randint(0, m, (n + n * n // m + 8,), generator=gen).numpy()
    if n * n < 2 * m:  # the first n hold no repeat with probability ~exp(-n^2 / 2m) > 1/e: check that first
        head = np.sort(draws[:n])
        if not bool((head[1:] == head[:-1]).any()):
            return torch.from_numpy(draws[:n])
    while True:
        _, first = np.unique(draws, return_index=True)  # where each value first occurs
        if first.shape[0] >= n:
            break
        more = torch.randint(0, m, (2 * (n - first.shape[0]) + 8,), generator=gen).numpy()
        draws = np.concatenate([draws, more])
    first.sort()
    return torch.from_numpy(draws[first[:n]])


class UniformSampler(Sampler):
    """Every live item is equally likely; with ``replace=False`` a draw has no repeats (every ``n``-subset of the
    live items equally likely, in a uniformly random order), at a cost that does not grow with the live items
    while ``n`` is small beside them (:func:`draw_distinct`).
    """

    def reset(self, storage: Storage, seed: int) -> None:
        super().reset(storage, seed)
        self._gen = torch.Generator().manual_seed(seed)

    def sample(self, n: int, *, replace: bool, beta: float | None) -> Selection:
        st = self.storage
        lo, hi = st.oldest, st.next_handle
        cap = st.capacity
        if hi - lo == cap and hi > cap:
            # a full, wrapped ring: every slot is live, so draw slots; their handles are computed if read
            slots = (torch.randint(0, cap, (n,), generator=self._gen) if replace
                     else draw_distinct(cap, n, self._gen))
            return Selection(slots, SampleInfo(handles=RingHandles(slots, lo, cap)))
        if replace:
            # the live handles directly: the same draws as ``randint(hi - lo) + lo``, one tensor op fewer
            handles = torch.randint(lo, hi, (n,), generator=self._gen)
        else:
            handles = draw_distinct(hi - lo, n, self._gen)
            if lo:
                handles = handles + lo
        return Selection(self._slots(handles), SampleInfo(handles=handles))

    def draw_state(self) -> Any:
        return self._gen.get_state()

    def rewind_draws(self, state: Any) -> None:
        self._gen.set_state(state)

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self._gen.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._gen.set_state(state["rng"])


class PrioritizedSampler(Sampler):
    """Proportional prioritized replay (Schaul et al.): ``P(i) = p_i^alpha / sum_j p_j^alpha``.

    New items get the largest priority seen so far (1.0 at first) unless the ingestion
    gives priorities. Importance weights are ``(N * P(i))^-beta`` divided by the largest
    possible weight, ``(N * min_j P(j))^-beta``. Priority updates name items by handle;
    updates for evicted handles are ignored (never applied to a slot's new occupant), and a
    handle never issued (negative, or not below the next handle) refuses the whole update.

    Args:
        alpha: priority exponent (0 gives uniform sampling).
        beta: default importance-weight exponent (a ``deliver(beta=...)`` overrides it).
        max_from_ingest: whether priorities given at ingestion count as "seen" for later
            items' default (True); with False only updates raise it, as RLlib's buffers do.
    """

    prioritized = True

    def __init__(self, *, alpha: float = 0.6, beta: float = 0.4, max_from_ingest: bool = True) -> None:
        if not (_finite_non_negative(alpha) and _finite_non_negative(beta)):
            raise ConfigurationError(f"alpha and beta must be finite numbers >= 0, got alpha={alpha!r}, "
                                     f"beta={beta!r}.")
        if not is_bool(max_from_ingest):  # (bool("no") is True: the opposite of what was asked)
            raise ConfigurationError(f"max_from_ingest must be True or False, got {max_from_ingest!r}.")
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.max_from_ingest = bool(max_from_ingest)

    def reset(self, storage: Storage, seed: int) -> None:
        super().reset(storage, seed)
        self._tree = sum_tree(storage.capacity)
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self._max_priority = 1.0

    @staticmethod
    def check_beta(beta: object) -> None:
        """:class:`ConfigurationError` unless ``beta`` is a finite number >= 0 (the importance-weight exponent)."""
        if not _finite_non_negative(beta):
            raise ConfigurationError(f"beta must be a finite number >= 0, got {beta!r}.")

    @staticmethod
    def check_handles(handles: torch.Tensor | np.ndarray) -> np.ndarray:
        """Handles as int64 NumPy, or :class:`PriorityError` when they are not integers (e.g. the
        priorities passed where the handles go: truncated, they would name other items)."""
        try:
            raw = np.asarray(host_array(handles) if isinstance(handles, torch.Tensor) else handles)
        except RuntimeError as e:  # torch cannot read them (a meta tensor holds no values, a nested one no shape)
            raise PriorityError(f"Handles must be the int64 handles a delivery returned (a tensor or array with "
                                f"values), got one torch cannot read ({e}).") from e
        if raw.size and raw.dtype.kind not in "iu":
            raise PriorityError(f"Handles must be integers (the int64 handles a delivery returned), got dtype "
                                f"{raw.dtype}; pass info.handles first, then the priorities.")
        if raw.size and raw.dtype.kind == "u" and int(raw.max()) > MAX_HANDLE:  # (as int64 it would read negative)
            raise PriorityError(f"Handle {int(raw.max())} was never issued (handles are int64); pass the info.handles "
                                f"a delivery returned. No priority was changed.")
        return raw.astype(np.int64, copy=False).reshape(-1)

    @staticmethod
    def check(priorities: torch.Tensor | np.ndarray) -> np.ndarray:
        """Priorities as float64 NumPy, or :class:`PriorityError` if any is NaN, inf or negative, or not a number.

        Floating tensors of any width are read by value, including those NumPy has no type for
        (``bfloat16``, ``float8``): every such value is exact in float64.
        """
        return PrioritizedSampler._checked(priorities)[0]

    @staticmethod
    def _checked(priorities: torch.Tensor | np.ndarray) -> tuple[np.ndarray, float]:
        """:meth:`check`, and the largest priority (0.0 for none), which the check reads anyway."""
        try:
            if isinstance(priorities, torch.Tensor):
                if priorities.dtype is torch.bool:
                    raise TypeError("bool values")  # (True would be read as priority 1)
                if priorities.is_complex():
                    raise TypeError("complex values")  # NumPy would drop the imaginary parts with a warning
                if priorities.is_floating_point():
                    priorities = priorities.detach().to("cpu", torch.float64)
                p = np.asarray(host_array(priorities), dtype=np.float64).reshape(-1)
            else:
                if np.iscomplexobj(priorities):
                    raise TypeError("complex values")
                kind = np.asarray(priorities).dtype.kind
                if kind in "bUS" or kind == "O" and any(isinstance(x, (str, bytes, bool, np.bool_))
                                                         for x in np.asarray(priorities).flat):
                    raise TypeError("bool or string values")  # (NumPy would read "1.0" as 1.0 and True as 1.0)
                if kind == "O" and any(x is None for x in np.asarray(priorities).flat):
                    raise TypeError("None values")  # (NumPy would read None as NaN, and the refusal would say "nan")
                p = np.asarray(priorities, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError, RuntimeError) as e:  # (RuntimeError: a meta or nested tensor torch cannot read)
            raise PriorityError(f"Priorities must be real numbers (a float tensor or array, one per item), got "
                                f"{type(priorities).__name__} ({e}); pass e.g. |td_error| + 1e-6.") from e
        if not p.size:
            return p, 0.0
        top = p.max()
        if not (p.min() >= 0 and top < np.inf):  # NaN fails both comparisons
            bad = ~np.isfinite(p) | (p < 0)
            raise PriorityError(f"{int(bad.sum())} priorities are NaN, infinite or negative (first: "
                                f"{p[bad][0]}); pass finite values >= 0, e.g. |td_error| + 1e-6.")
        return p, float(top)

    def on_append(self, result: AppendResult, priorities: torch.Tensor | None) -> None:
        cap = self.storage.capacity
        # Evicted items whose slots the new ones take need no zeroing: the new weights overwrite them.
        vacated = max(result.evicted_from, result.first + result.count - cap)
        if result.evicted_to > vacated:
            ev = np.arange(vacated, result.evicted_to, dtype=np.int64)
            self._tree.set(ev % cap, np.zeros(ev.shape[0]))
        if result.count == 1 and priorities is None:  # one env step per call is common
            self._tree.set_one(result.first % cap, self._max_priority ** self.alpha)
        elif result.count:
            slots = np.arange(result.first, result.first + result.count, dtype=np.int64) % cap
            if priorities is None:
                vals = np.full(result.count, self._max_priority ** self.alpha)
            else:
                p = self.check(priorities)
                if self.max_from_ingest:
                    self._max_priority = max(self._max_priority, float(p.max(initial=0.0)))
                vals = p ** self.alpha
            self._tree.set(slots, vals)

    def check_range(self, p: np.ndarray, *, top: float | None = None) -> None:
        """:class:`PriorityError` if a priority of ``p`` (checked by :meth:`check`) is so large that its
        ``p ** alpha``, summed over a full buffer of such items, overflows float64: the sum tree would hold
        inf, and every draw would land on one item with an infinite weight. ``top``: ``p``'s largest, when known."""
        top = float(p.max(initial=0.0)) if top is None else top
        if top <= 0 or self.alpha == 0:
            return
        log_limit = self._log_limit()
        if math.log(top) > log_limit:
            raise PriorityError(f"Priority {top:g} is too large: raised to alpha={self.alpha:g} and summed over up to "
                                f"{self._tree.capacity} items it overflows float64 (priorities up to "
                                f"{math.exp(min(log_limit, math.log(_FLOAT64_MAX))):.3g} are safe); clip or scale the "
                                f"priorities (e.g. the TD errors) first.")

    def _underflow(self) -> float:
        """The priority below which ``priority ** alpha`` is 0 in float64 (0 for alpha 0: every priority is 1)."""
        return 0.0 if self.alpha == 0 else math.exp(math.log(5e-324) / self.alpha)

    def _log_limit(self) -> float:
        """The largest ``log(priority)`` whose ``priority ** alpha``, summed over a full buffer, stays below half
        of float64's largest (inf for alpha 0; the half is room for the rounding of ``log``, ``**`` and the
        tree's additions, which at the exact bound overflowed); see :meth:`check_range`."""
        if self.alpha == 0:
            return math.inf
        return (math.log(_FLOAT64_MAX / 2) - math.log(self._tree.capacity)) / self.alpha

    def sample(self, n: int, *, replace: bool, beta: float | None) -> Selection:
        if not replace:
            raise ConfigurationError("PrioritizedSampler draws with replacement; use replace=True.")
        if beta is not None:
            self.check_beta(beta)
        tree = self._tree
        total = tree.total
        if total <= 0:
            raise EmptyBufferError(f"Every live item has priority 0 (or one so small that its priority ** alpha "
                                   f"underflows float64 to 0: below about {self._underflow():.3g} at "
                                   f"alpha={self.alpha:g}), so none can be drawn; update priorities with positive "
                                   f"values (e.g. |td_error| + 1e-6).")
        u = self._rng.random(n)
        st = self.storage
        # the compiled tree draws, weighs and finds the handles in one call (None: a draw needs redrawing, below)
        drawn = (tree.draw(u, self.beta if beta is None else float(beta), st.oldest)
                 if type(tree) is CompiledSumTree else None)
        if drawn is None:
            slots, probs, weights = self._drawn(u * total, beta)
            # as Storage.handles_of, in NumPy (nothing evicted yet: handle == slot)
            handles = slots.copy() if st.oldest == 0 else st.oldest + (slots - st.oldest) % st.capacity
        else:
            slots, handles, probs, weights = drawn
        info = SampleInfo(handles=torch.from_numpy(handles), weights=torch.from_numpy(weights),
                          probabilities=torch.from_numpy(probs))
        return Selection(torch.from_numpy(slots), info)

    def _drawn(self, x: np.ndarray, beta: float | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The slots of prefix sums ``x``, redrawing those that land on a zero weight, with their
        probabilities and float32 importance weights (:meth:`weigh`)."""
        total = self._tree.total
        slots = self._tree.find(x)
        leaf = self._tree.get(slots)
        for _ in range(8):  # rounding can land on a zero leaf at an interval edge: redraw those
            if leaf.min() > 0:
                break
            zero = leaf <= 0
            slots[zero] = self._tree.find(self._rng.random(int(zero.sum())) * total)
            leaf = self._tree.get(slots)
        probs, weights = self.weigh(leaf, beta)
        return slots, probs, weights.astype(np.float32)

    def priorities(self, slots: np.ndarray) -> np.ndarray:
        """What ``slots`` are drawn in proportion to now (their ``priority ** alpha``; 0 for no item)."""
        return self._tree.get(slots)

    def weigh(self, leaf: np.ndarray, beta: float | None) -> tuple[np.ndarray, np.ndarray]:
        """Probabilities and importance weights of draws of items with :meth:`priorities` ``leaf`` (all > 0), against
        the priorities held now; ``beta`` None: the sampler's."""
        b = self.beta if beta is None else float(beta)
        # (N * P(i))^-b / (N * min_j P(j))^-b, as (min_j p_j / p_i)^b: in (0, 1], so no priorities however far
        # apart overflow it (the quotient form raised for 1e-300 beside 1e300)
        return leaf / self._tree.total, (self._tree.min / leaf) ** b

    def update(self, handles: torch.Tensor | np.ndarray, priorities: torch.Tensor | np.ndarray) -> int:
        tree = self._tree
        if type(tree) is CompiledSumTree:
            # checked, filtered and written in one call; None: the input needs the conversions or the refusals below
            h: object = None
            p: object = None
            try:
                h = host_array(handles) if type(handles) is torch.Tensor else handles
                p = (host_array(priorities.detach().to("cpu", torch.float64))
                     if type(priorities) is torch.Tensor and priorities.is_floating_point() else priorities)
            except RuntimeError:  # a tensor torch cannot read (meta, nested): refused by the checks below
                pass
            if type(h) is np.ndarray and type(p) is np.ndarray and h.dtype is _INT64 and p.dtype is _FLOAT64:
                st = self.storage
                done = tree.set_by_handle(h, p, self.alpha, st.oldest, st.next_handle, self._log_limit())
                if done is not None:
                    if done[0]:
                        self._max_priority = max(self._max_priority, done[1])
                    return done[0]
        p, top = self._checked(priorities)
        h = self.check_handles(handles)
        if h.shape != p.shape:
            raise PriorityError(f"Got {h.shape[0]} handles and {p.shape[0]} priorities; pass one priority "
                                f"per handle.")
        if not h.size:
            return 0
        self.check_range(p, top=top)
        st = self.storage
        if not (h.min() >= st.oldest and h.max() < st.next_handle):
            if h.min() < 0 or h.max() >= st.next_handle:
                bad = int(h[(h < 0) | (h >= st.next_handle)][0])
                raise PriorityError(f"Handle {bad} was never issued (issued handles are [0, {st.next_handle})); pass "
                                    f"the info.handles a delivery returned. No priority was changed.")
            live = h >= st.oldest  # the rest were evicted: their updates are ignored
            h, p = h[live], p[live]
            if not h.size:
                return 0
            top = float(p.max())
        self._tree.set(h % st.capacity, p ** self.alpha)
        self._max_priority = max(self._max_priority, top)
        return int(h.size)

    def check_live(self, oldest: int, next_handle: int) -> None:
        """:class:`ConfigurationError` when a slot that holds no live item (handles ``[oldest, next_handle)``)
        has a priority: a draw would land on it (a damaged checkpoint)."""
        cap = self._tree.capacity
        if next_handle - oldest >= cap:
            return
        live = np.zeros(cap, dtype=bool)
        live[np.arange(oldest, next_handle, dtype=np.int64) % cap] = True
        leaves = self._tree.state()
        if np.any(leaves[~live] > 0):
            raise ConfigurationError(f"This checkpoint's priorities name {int(np.count_nonzero(leaves[~live] > 0))} "
                                     f"slots that hold no live item (live handles [{oldest}, {next_handle})); the "
                                     f"checkpoint is damaged.")

    def draw_state(self) -> Any:
        return self._rng.bit_generator.state

    def rewind_draws(self, state: Any) -> None:
        self._rng.bit_generator.state = state

    def state_dict(self) -> dict[str, Any]:
        # (tensors and plain Python values only: torch.load's default weights_only=True refuses NumPy arrays)
        return {"rng": self._rng.bit_generator.state, "leaves": torch.from_numpy(self._tree.state()),
                "max_priority": self._max_priority, "alpha": self.alpha}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raw = state["leaves"]
        leaves = np.asarray(raw, dtype=np.float64)
        max_priority = float(state["max_priority"])
        # float64 as saved (a float32 tree would load rounded: the draws would not continue exactly)
        exact = getattr(raw, "dtype", None) in (torch.float64, np.float64)
        if not (exact and leaves.shape == (self._tree.capacity,) and _finite_non_negative(max_priority)
                and bool(np.all((leaves >= 0) & (leaves < np.inf)))):
            raise ConfigurationError(f"This checkpoint's priorities are damaged (leaves of shape {leaves.shape} and "
                                     f"dtype {getattr(raw, 'dtype', type(raw).__name__)} for "
                                     f"{self._tree.capacity} slots, NaN, infinite or negative values, or "
                                     f"max_priority={max_priority!r}); load an undamaged state_dict().")
        # the leaves are priorities raised to the saver's alpha (absent in older checkpoints): under another alpha
        # the loaded items and the later ones would be weighted by two different exponents
        alpha = state.get("alpha", self.alpha)
        if not (_finite_non_negative(alpha) and float(alpha) == self.alpha):
            raise ConfigurationError(f"This checkpoint's priorities were raised to alpha={alpha!r}, this sampler's "
                                     f"alpha is {self.alpha!r}; load it into a buffer built with "
                                     f"PrioritizedSampler(alpha={alpha!r}).")
        self._rng.bit_generator.state = state["rng"]
        self._tree.load(leaves)
        self._max_priority = max_priority


class Replay(Semantics):
    """Replay semantics: a bounded buffer with FIFO eviction, sampled by a :class:`Sampler`.

    Args:
        sampler: ``UniformSampler()`` (default) or ``PrioritizedSampler(alpha=..., beta=...)``.
        seed: seeds the sampler; the same seed and call sequence give the same draws.
    """

    kind = "replay"

    def __init__(self, sampler: Sampler | None = None, *, seed: int = 0) -> None:
        if sampler is not None and not isinstance(sampler, Sampler):
            fix = (f"{sampler.__name__}()" if isinstance(sampler, type) and issubclass(sampler, Sampler)
                   else "UniformSampler() or PrioritizedSampler(alpha=..., beta=...)")
            raise ConfigurationError(f"Replay's sampler must be a conduit Sampler instance, e.g. {fix}; got "
                                     f"{sampler!r}.")
        self.sampler = sampler if sampler is not None else UniformSampler()
        self.seed = check_seed(seed)

    def bind(self, storage: Storage) -> None:
        super().bind(storage)
        self.sampler.reset(storage, self.seed)

    def check_ingest(self, n: int, *, version: int | None, priorities: torch.Tensor | None) -> None:
        if priorities is not None:
            if not self.sampler.prioritized:
                raise ConfigurationError("Priorities were given, but this buffer samples uniformly; "
                                         "use Replay(PrioritizedSampler()) or drop the priorities.")
            p = PrioritizedSampler.check(priorities)
            if p.shape[0] != n:
                raise PriorityError(f"Got {p.shape[0]} priorities for {n} items; pass one per item.")
            if isinstance(self.sampler, PrioritizedSampler):
                self.sampler.check_range(p)

    def on_append(self, result: AppendResult, *, version: int | None, priorities: torch.Tensor | None) -> None:
        self.sampler.on_append(result, priorities)

    def select(self, n: int | None, *, replace: bool = True, beta: float | None = None, **unknown: Any) -> Selection:
        if unknown:
            raise ConfigurationError(f"Replay delivery takes the options replace= and beta=, not "
                                     f"{', '.join(sorted(unknown))}; check the spelling.")
        if beta is not None and not self.sampler.prioritized:
            raise ConfigurationError(f"beta applies only to prioritized replay (importance weights), and this buffer's "
                                     f"{type(self.sampler).__name__} keeps no priorities; drop beta={beta!r} or use "
                                     f"Replay(PrioritizedSampler()).")
        if type(n) is not int and (isinstance(n, bool) or not isinstance(n, Integral)) or n <= 0:
            raise ConfigurationError(f"Replay delivery needs a positive batch size n (an int), got {n!r}.")
        if replace is not True and replace is not False:
            if not is_bool(replace):  # (a string such as "no" is truthy: it drew with replacement)
                raise ConfigurationError(f"replace must be True or False, got {replace!r}.")
            replace = bool(replace)
        n = int(n)
        if n > MAX_DRAW:
            raise ConfigurationError(f"A delivery of {n} items is more than one call draws (at most {MAX_DRAW}); ask "
                                     f"for fewer, e.g. in several deliveries.")
        size = len(self.storage)
        if size == 0:
            raise EmptyBufferError("The buffer is empty; ingest experience before sampling.")
        if not replace and n > size:
            raise CapacityError(f"Cannot draw {n} distinct items from {size}; ask for at most {size} "
                                f"or sample with replacement.")
        return self.sampler.sample(n, replace=replace, beta=beta)

    def check_live(self, oldest: int, next_handle: int) -> None:
        if isinstance(self.sampler, PrioritizedSampler):
            self.sampler.check_live(oldest, next_handle)

    def draw_state(self) -> Any:
        return self.sampler.draw_state()

    def rewind_draws(self, state: Any) -> None:
        self.sampler.rewind_draws(state)

    def update_priorities(self, handles: torch.Tensor | np.ndarray, priorities: torch.Tensor | np.ndarray) -> int:
        """Set new priorities; returns how many handles were live (the rest were evicted and ignored).

        Raises:
            PriorityError: bad priorities, a length mismatch, or a handle never issued (nothing changed).
        """
        return self.sampler.update(handles, priorities)

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
