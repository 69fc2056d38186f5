"""Safe granularity ranges, derived from what the framework already states.

The framework tells Conduit two things: whether the algorithm is on- or off-policy, and
(on-policy) M, the number of minibatch updates one rollout feeds. From those alone:

* **off-policy**: ``g_ing`` in ``1 .. g_ing_max`` rollouts per ingestion call (batching
  rollouts delays when the newest become drawable by at most ``g_ing - 1`` rollouts), and
  ``g_del`` in ``1 .. g_del_max`` batches per delivery call, prepared ahead (a prioritized
  draw may then miss up to ``g_del`` priority updates, and ``g_del`` batches of output
  buffers are kept per chunk);
* **on-policy**: ``g_ing`` in ``{1/M, 2/M, ..., 1}`` of a rollout per ingestion call
  (pipelining parts of one rollout, never mixing rollouts), and ``g_del = 1/M``: one
  minibatch per delivery call, so freshness is checked minibatch by minibatch.

The caps are the user's only knobs: ``g_ing_max`` bounds ingestion lag, ``g_del_max``
bounds priority staleness, and ``memory_budget`` bounds the delivery buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from conduit.checks import is_bool, is_int
from conduit.errors import ConfigurationError
from conduit.scheduling.buffers import buffers_needed
from conduit.semantics.base import Semantics
from conduit.semantics.onpolicy import OnPolicy

__all__ = ["GranularityRange", "g_del_fitting", "safe_ranges"]


@dataclass(frozen=True)
class GranularityRange:
    """The granularities a job may use without leaving its semantics."""

    on_policy: bool
    #: candidate ingestion granularities (rollouts, or fractions of a rollout on-policy)
    g_ing: tuple[float, ...]
    #: candidate delivery granularities (batches per call, or ``1/M`` on-policy)
    g_del: tuple[float, ...]
    #: M, minibatches per rollout (on-policy; None off-policy or when only a minibatch size is known)
    num_minibatches: int | None = None

    def describe(self) -> str:
        # (on-policy values are k/M: a denominator bound below M would print 1/2000 as 0)
        bound = max(1024, self.num_minibatches or 1)

        def fmt(v: float) -> str:
            f = Fraction(v).limit_denominator(bound)
            return str(f.numerator) if f.denominator == 1 else f"{f.numerator}/{f.denominator}"
        m = "M not given: whole rollouts only" if self.num_minibatches is None else f"M={self.num_minibatches}"
        kind = f"on-policy ({m})" if self.on_policy else "off-policy"
        return (f"{kind}: g_ing in {{{', '.join(fmt(g) for g in self.g_ing)}}}, "
                f"g_del in {{{', '.join(fmt(g) for g in self.g_del)}}}")


def safe_ranges(*, on_policy: bool, num_minibatches: int | None = None, g_ing_max: int = 8, g_del_max: int = 8,
                batch_bytes: int | None = None, memory_budget: int | None = None,
                output_depth: int = 2) -> GranularityRange:
    """The safe ranges for a job described only by on/off-policy and M.

    Keyword Args:
        on_policy: the algorithm's kind.
        num_minibatches: M (on-policy). Without it only whole rollouts are ingested.
        g_ing_max: cap on rollouts per ingestion call (off-policy).
        g_del_max: cap on batches per delivery call (off-policy).
        batch_bytes: bytes of one delivered batch; with ``memory_budget``, caps ``g_del``
            so the delivery buffers (``buffers_needed`` chunks of ``g_del`` batches) fit.
        memory_budget: bytes the delivery buffers may take.
        output_depth: deliveries a delivered batch stays valid for.

    Counts and bytes are ints (numpy integers too), never bools.

    Raises:
        ConfigurationError: an argument of the wrong type or below its bound, or a memory
            budget too small for even one batch per delivery call.

    Examples:
        >>> safe_ranges(on_policy=False, g_ing_max=4, g_del_max=4).describe()
        'off-policy: g_ing in {1, 2, 3, 4}, g_del in {1, 2, 3, 4}'
        >>> safe_ranges(on_policy=True, num_minibatches=4).describe()
        'on-policy (M=4): g_ing in {1/4, 1/2, 3/4, 1}, g_del in {1/4}'
    """
    if not is_bool(on_policy):  # (a string such as "no" would be truthy)
        raise ConfigurationError(f"on_policy must be True or False, got {on_policy!r}.")
    for name, v in (("g_ing_max", g_ing_max), ("g_del_max", g_del_max), ("output_depth", output_depth)):
        if not is_int(v) or v < 1:
            raise ConfigurationError(f"{name} must be an int >= 1, got {v!r}.")
    for name, b in (("batch_bytes", batch_bytes), ("memory_budget", memory_budget)):
        if b is not None and (not is_int(b) or b < 0):
            raise ConfigurationError(f"{name} must be None or an int >= 0 (bytes), got {b!r}.")
    if num_minibatches is not None and (not is_int(num_minibatches)
                                        or num_minibatches < 1):  # (off-policy M bounds nothing, but is still M)
        raise ConfigurationError(f"num_minibatches (M) must be a positive int, got {num_minibatches!r}.")
    # numpy integers are ints too (a count read from a config array): plain ints from here on
    g_ing_max, g_del_max, output_depth = int(g_ing_max), int(g_del_max), int(output_depth)
    batch_bytes = None if batch_bytes is None else int(batch_bytes)
    memory_budget = None if memory_budget is None else int(memory_budget)
    num_minibatches = None if num_minibatches is None else int(num_minibatches)
    if on_policy:
        m = num_minibatches or 1
        return GranularityRange(True, tuple(k / m for k in range(1, m + 1)), (1 / m,), num_minibatches)
    fits = g_del_fitting(g_del_max, batch_bytes=batch_bytes or 0, memory_budget=memory_budget,
                         output_depth=output_depth)
    if not fits:
        raise ConfigurationError(
            f"Even one batch per delivery call needs {buffers_needed(1, output_depth) * (batch_bytes or 0):,} bytes "
            f"of delivery buffers, over memory_budget={memory_budget:,} bytes; raise the budget or deliver "
            f"smaller batches.")
    return GranularityRange(False, tuple(float(g) for g in range(1, g_ing_max + 1)), tuple(float(g) for g in fits))


def g_del_fitting(g_del_max: int, *, batch_bytes: float, memory_budget: float | None,
                  output_depth: int) -> tuple[int, ...]:
    """The ``g_del`` in ``1..g_del_max`` whose delivery buffers (``buffers_needed`` chunks of ``g_del`` batches of
    ``batch_bytes``) fit ``memory_budget`` (every one without a budget or a size), in order; empty when none does.

    Not always ``1..k``: the buffers needed do not grow with ``g_del`` everywhere (``output_depth=6``: ``g_del=4``
    needs 16 batches, ``g_del=5`` 15), so a value may fit where a smaller one does not.
    """
    return tuple(g for g in range(1, int(g_del_max) + 1)
                 if memory_budget is None or not batch_bytes
                 or buffers_needed(g, output_depth) * g * batch_bytes <= memory_budget)



def ranges_for(semantics: Semantics, **caps: int | None) -> GranularityRange:
    """:func:`safe_ranges` for a buffer's semantics (on-policy M is read from it)."""
    if isinstance(semantics, OnPolicy):
        return safe_ranges(on_policy=True, num_minibatches=semantics.num_minibatches, **caps)  # type: ignore[arg-type]
    return safe_ranges(on_policy=False, **caps)  # type: ignore[arg-type]
