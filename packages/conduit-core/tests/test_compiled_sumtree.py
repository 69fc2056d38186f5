"""The compiled sum tree (``conduit.semantics._sumtree``): built where it should be, chosen by the sampler, refusing
bad writes before it changes anything, and portable through pickles to installs without it. Its sums, minima and
searches are checked against brute force with NumPy's trees in ``test_semantics.py``."""

from __future__ import annotations

import math
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conduit import ExperienceDataPlane, ExperienceSchema, Field, PrioritizedSampler, PriorityError, Replay
from conduit._native import load_kernels
from conduit.semantics import replay as replay_module
from conduit.semantics import sumtree
from conduit.semantics.sumtree import COMPILED, CompiledSumTree, SumTree, sum_tree

needs_compiled = pytest.mark.skipif(not COMPILED, reason="no compiled kernels in this install "
                                                         "(test_the_compiled_tree_is_built says whether expected)")


def test_the_compiled_tree_is_built() -> None:
    """CI installs with a C compiler and sets CONDUIT_REQUIRE_COMPILED=1: there the kernels (the sum tree's and the
    ingestion row store's) must have been built (a broken build hook would otherwise only make prioritized replay
    and ingestion slower). Anywhere, the sampler takes the tree this install's flag names."""
    if os.environ.get("CONDUIT_REQUIRE_COMPILED") == "1":
        assert COMPILED, ("conduit.semantics._sumtree was not compiled: see the warning conduit-core's build hook "
                          "(packages/conduit-core/hatch_build.py) printed during the install")
        from conduit.storage import columnar

        assert columnar._rows is not None, "conduit.storage._rows was not compiled: see the build hook's warning"
    edp = ExperienceDataPlane(ExperienceSchema(x=Field(())), capacity=8, semantics=Replay(PrioritizedSampler()))
    try:
        tree = edp.semantics.sampler._tree  # type: ignore[attr-defined]
        assert type(tree) is (CompiledSumTree if COMPILED else SumTree), type(tree)
    finally:
        edp.close()


@needs_compiled
def test_bad_writes_are_refused_before_anything_changes() -> None:
    t = CompiledSumTree(10)
    t.set(np.arange(10), np.arange(1.0, 11.0))
    before = (t.state(), t.total, t.min, t.find(np.array([0.5, 54.9])).tolist())
    bad = [
        (IndexError, lambda: t.set(np.array([3, 10]), np.array([1.0, 1.0]))),  # the second slot is out of range
        (IndexError, lambda: t.set(np.array([-1]), np.array([1.0]))),
        (IndexError, lambda: t.set_one(10, 1.0)),
        (ValueError, lambda: t.set(np.array([2, 3]), np.array([5.0, np.nan]))),  # the first is fine, the second not
        (ValueError, lambda: t.set(np.array([2]), np.array([-1.0]))),
        (ValueError, lambda: t.set_one(2, np.inf)),
        (ValueError, lambda: t.load(np.full(10, -1.0))),
        (ValueError, lambda: t.load(np.ones(9))),
    ]
    for error, call in bad:
        with pytest.raises(error):
            call()
        after = (t.state(), t.total, t.min, t.find(np.array([0.5, 54.9])).tolist())
        assert np.array_equal(after[0], before[0]) and after[1:] == before[1:], f"{error.__name__} changed the tree"


@needs_compiled
def test_a_pickled_compiled_tree_loads_where_the_kernels_are_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint that pickles the buffer (SRL's) may be loaded by an install built without a C compiler: it
    gets NumPy's tree, with the same weights and searches."""
    t = CompiledSumTree(300)
    w = np.random.default_rng(0).random(300) * (np.arange(300) % 7 != 0)
    t.set(np.arange(300), w)
    blob = pickle.dumps(t)
    same = pickle.loads(blob)
    assert type(same) is CompiledSumTree and np.array_equal(same.state(), w)
    monkeypatch.setattr(sumtree, "COMPILED", False)
    moved = pickle.loads(blob)
    assert type(moved) is SumTree and np.array_equal(moved.state(), w)
    assert moved.total == pytest.approx(t.total, rel=1e-12) and moved.min == t.min
    u = np.random.default_rng(1).random(1000) * w.sum()
    assert np.array_equal(moved.find(u), t.find(u))
    assert isinstance(sum_tree(4), SumTree)


@needs_compiled
def test_the_compiled_tree_lands_rounding_overshoots_on_a_positive_weight() -> None:
    """Draws at or past the total (rounding in ``random() * total``) land on the last slot with weight, never on a
    zero-weight slot after it, and with no weight at all on slot 0."""
    t = CompiledSumTree(100)
    assert t.find(np.array([0.0, 5.0])).tolist() == [0, 0] and t.total == 0.0 and t.min == np.inf
    t.set(np.array([10, 40]), np.array([1.0, 2.0]))
    assert t.find(np.array([0.999, 1.0, 2.999, 3.0, 1e9])).tolist() == [10, 40, 40, 40, 40]


# -- the sampler's one-call draw and priority update --------------------------------------------------------------
class GeneralPathTree(CompiledSumTree):
    """The compiled tree under another type: the sampler draws and updates through its general NumPy code on it
    (find, get, weigh, set), so the one-call kernels can be checked against that code on identical sums."""


def planes(capacity: int, alpha: float, monkeypatch: pytest.MonkeyPatch) -> tuple[ExperienceDataPlane, ...]:
    """Two prioritized buffers of one seed: the first draws and updates in one call, the second by the general path."""
    made = []
    for tree in (CompiledSumTree, GeneralPathTree):
        monkeypatch.setattr(replay_module, "sum_tree", tree)
        made.append(ExperienceDataPlane(ExperienceSchema(x=Field(())), capacity=capacity,
                                        semantics=Replay(PrioritizedSampler(alpha=alpha, beta=0.4), seed=3)))
    monkeypatch.undo()
    assert [type(e.semantics.sampler._tree) for e in made] == [CompiledSumTree, GeneralPathTree]  # type: ignore[attr-defined]
    return tuple(made)


def _numpy_power_is_libm() -> bool:
    """Whether NumPy's float64 ``**`` gives the C library's ``pow`` here (the kernels call ``pow``). NumPy computes it
    with Intel's SVML on CPUs with AVX-512, which differs in the last bit for some inputs."""
    x = np.random.default_rng(0).random(4096) * 3
    return all(float(a) == math.pow(float(b), 0.6) for a, b in zip(np.power(x, 0.6), x, strict=True))


#: the kernels' weights equal NumPy's bit for bit for every alpha (else for alpha 0, 0.5, 1 and 2 only)
LIBM_POWER = _numpy_power_is_libm()


def same_state(a: ExperienceDataPlane, b: ExperienceDataPlane, exact: bool = True) -> None:
    sa, sb = a.semantics.sampler, b.semantics.sampler  # type: ignore[attr-defined]
    if exact:
        assert np.array_equal(sa._tree.state(), sb._tree.state()), "the trees' weights differ"
    else:
        assert np.allclose(sa._tree.state(), sb._tree.state(), rtol=1e-12, atol=0), "the trees' weights differ"
    assert sa._max_priority == sb._max_priority, (sa._max_priority, sb._max_priority)


def outcome(call):  # noqa: ANN001, ANN201
    """What ``call()`` returned, or the type and message of what it raised."""
    try:
        return "returned", call()
    except Exception as e:  # noqa: BLE001 - compared between the two paths
        return type(e).__name__, str(e)


@needs_compiled
@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.6, 1.0, 2.0])
def test_one_call_draws_and_updates_equal_the_general_path(alpha: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over a random run (ingestion with and without priorities, the ring wrapping, draws at several betas, updates
    by NumPy arrays and tensors naming live, evicted, repeated and never-issued handles, bad priorities), the
    one-call kernels give the general path's slots, handles, probabilities and float32 weights bit for bit, the
    same counts, refusals and messages, and leave the same weights and largest priority behind. (Where NumPy's
    float64 power is not the C library's, alphas other than 0, 0.5, 1 and 2 give weights within a few ulps.)"""
    exact = alpha in (0.0, 0.5, 1.0, 2.0) or LIBM_POWER
    fused, general = planes(37, alpha, monkeypatch)
    rng = np.random.default_rng(int(alpha * 10))
    issued = 0
    for step in range(400):
        op = rng.integers(4)
        if op == 0 or issued == 0:
            k = int(rng.integers(1, 12))
            prios = None if rng.random() < 0.5 else torch.from_numpy(rng.random(k) * (rng.random(k) > 0.2))
            for e in (fused, general):
                e.ingest({"x": torch.arange(issued, issued + k, dtype=torch.float32)}, priorities=prios)
            issued += k
        elif op == 1:
            n = int(rng.integers(1, 40))
            beta = [None, 0.0, 0.4, 0.5, 1.0, 2.0, 3.7][int(rng.integers(7))]
            got = [outcome(lambda e=e, n=n, beta=beta: e.deliver(n, beta=beta)) for e in (fused, general)]
            assert [g[0] for g in got] == [g[0] for g in got[:1]] * 2, (step, got)
            if got[0][0] == "returned":
                (ba, ia), (bb, ib) = got[0][1], got[1][1]
                assert torch.equal(ba["x"], bb["x"]), step
                for name in ("handles", "probabilities", "weights"):
                    x, y = getattr(ia, name), getattr(ib, name)
                    assert x.dtype == y.dtype and (torch.equal(x, y) if exact or name == "handles" else
                                                   torch.allclose(x, y, rtol=1e-6, atol=0)), (step, name, x, y)
                assert ia.weights.dtype == torch.float32 and torch.equal(ba["x"].long(), ia.handles), step
            else:
                assert got[0] == got[1], (step, got)
        else:
            k = int(rng.integers(0, 10))
            h = rng.integers(max(0, issued - 80), issued + (1 if rng.random() < 0.1 else 0), size=k)
            p = rng.random(k) * 3
            if k and rng.random() < 0.1:
                p[rng.integers(k)] = [np.nan, -1.0, np.inf, 1e300][int(rng.integers(4))]
            if op == 3:  # tensors: float32 priorities and int64 handles, as a learner's TD errors come
                h, p = torch.from_numpy(h), torch.from_numpy(p).float()
            got = [outcome(lambda e=e, h=h, p=p: e.update_priorities(h, p)) for e in (fused, general)]
            assert got[0] == got[1], (step, got)
        same_state(fused, general, exact)
    assert issued > 3 * 37, "the ring should have wrapped several times"
    for e in (fused, general):
        e.close()


def largest_accepted(sampler: PrioritizedSampler) -> float:
    """The largest priority ``sampler.check_range`` takes (bisected on float64's spacing)."""
    limit = sampler._log_limit()
    lo, hi = math.exp(limit - 1e-9), float(np.finfo(np.float64).max)
    while math.nextafter(lo, math.inf) < hi:
        mid = lo + (hi - lo) / 2
        lo, hi = (mid, hi) if math.log(mid) <= limit else (lo, mid)
    return lo


@needs_compiled
@pytest.mark.parametrize(("capacity", "alpha"), [(1, 2.0), (2, 1.0), (4, 2.0), (37, 1.5)])
def test_a_full_buffer_of_the_largest_priority_accepted_sums_to_a_finite_total(
        capacity: int, alpha: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """The range check promises that a priority it takes, raised to alpha and summed over a full buffer, stays
    finite. At the exact bound ``log`` rounded priorities through whose sum (or, for one item at alpha 2, whose
    square) was inf: the one-call update wrote an infinite weight and the general path raised a ValueError. Now
    both paths take the largest priority accepted and keep a finite total, and refuse one twice as large with
    ``PriorityError``, nothing changed."""
    for e in planes(capacity, alpha, monkeypatch):
        sampler = e.semantics.sampler  # type: ignore[attr-defined]
        e.ingest({"x": torch.zeros(capacity)})
        top = largest_accepted(sampler)
        assert e.update_priorities(np.arange(capacity), np.full(capacity, top)) == capacity
        assert math.isfinite(sampler._tree.total) and sampler._tree.total > 0
        info = e.deliver(4)[1]
        assert bool(torch.isfinite(info.probabilities).all() and torch.isfinite(info.weights).all())
        before = sampler._tree.state().copy()
        with pytest.raises(PriorityError, match="too large"):
            e.update_priorities(np.arange(capacity), np.full(capacity, 2 * top))
        assert np.array_equal(sampler._tree.state(), before)
        e.close()


def test_an_ingested_priority_too_large_is_refused_before_anything_is_stored() -> None:
    """For one item at alpha 2, 1.3407807929942817e154 squared is inf: the ingestion's range check refuses it, so
    the item is not stored (before, the check let it through, the storage stored the item and evicted the old
    one, and only then did the tree refuse the weight)."""
    e = ExperienceDataPlane(ExperienceSchema(x=Field(())), capacity=1,
                            semantics=Replay(PrioritizedSampler(alpha=2.0), seed=3))
    e.ingest({"x": torch.zeros(1)})
    with pytest.raises(PriorityError, match="too large"):
        e.ingest({"x": torch.ones(1)}, priorities=torch.tensor([1.3407807929942817e154], dtype=torch.float64))
    assert (e.storage.oldest, e.storage.next_handle, float(e.deliver(1)[0]["x"][0])) == (0, 1, 0.0)
    e.close()


@needs_compiled
@pytest.mark.parametrize(("alpha", "priority"), [(float("nan"), 2.0), (-1.0, 0.0), (math.inf, 2.0), (2.0, 1e200)])
def test_the_update_kernel_writes_only_weights_set_would_take(alpha: float, priority: float) -> None:
    """Called directly, the update kernel leaves input whose weight would not be finite and >= 0 (a NaN, negative or
    infinite alpha; a power that overflows) to the general path (None), the tree unchanged."""
    t = CompiledSumTree(4)
    t.set(np.arange(4), np.ones(4))
    got = sumtree._kernels.update(t._sums, t._mins, t._leaves, t._p, 4, np.array([1]), np.array([priority]), alpha,
                                  0, 4, math.inf)
    assert got is None and np.array_equal(t.state(), np.ones(4)), (got, t.state())


@needs_compiled
def test_a_one_call_draw_that_lands_on_a_zero_weight_is_redrawn_as_the_general_path_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``draw`` returns None for a draw on a zero weight (only when every weight is zero on this tree, but the
    sampler must not depend on that): the sampler then finds and redraws from the same uniforms, consuming the
    generator as the general path does."""
    t = CompiledSumTree(5)
    assert t.draw(np.array([0.3]), 0.4, 0) is None  # all weights zero
    fused, general = planes(16, 0.6, monkeypatch)
    for e in (fused, general):
        e.ingest({"x": torch.arange(16, dtype=torch.float32)})
    monkeypatch.setattr(CompiledSumTree, "draw", lambda *a: None)
    for _ in range(3):
        (ba, ia), (bb, ib) = fused.deliver(8), general.deliver(8)
        assert torch.equal(ba["x"], bb["x"]) and torch.equal(ia.handles, ib.handles)
        assert torch.equal(ia.weights, ib.weights) and torch.equal(ia.probabilities, ib.probabilities)
    for e in (fused, general):
        e.close()


@needs_compiled
def test_the_one_call_update_hands_back_what_it_cannot_take_unchanged() -> None:
    """``set_by_handle`` returns None, writing nothing, for every input the general path must convert or refuse,
    and otherwise skips evicted handles and reports the largest priority it applied."""
    t = CompiledSumTree(10)
    t.set(np.arange(10), np.arange(1.0, 11.0))
    before = t.state()
    h, p = np.array([12, 15, 19]), np.array([1.0, 4.0, 2.0])  # oldest 10, next 20: all live
    refused = [
        (h.astype(np.int32), p), (h, p.astype(np.float32)), (h[::2], p[:2]), (h, p[:2]),
        (np.array([12, 20]), p[:2]), (np.array([-1, 12]), p[:2]),
        (h, np.array([1.0, np.nan, 2.0])), (h, np.array([1.0, -0.5, 2.0])), (h, np.array([1.0, np.inf, 2.0])),
        (h, np.array([1.0, 1e300, 2.0])),
        (np.arange(12, 18)[::2].copy(), np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])[::2]),  # non-contiguous priorities
    ]
    for hh, pp in refused:
        assert t.set_by_handle(hh, pp, 0.6, 10, 20, 5.0) is None, (hh, pp)
        assert np.array_equal(t.state(), before), (hh, pp)
    assert t.set_by_handle(np.array([5, 12, 3, 12]), np.array([9.0, 4.0, 8.0, 0.25]), 0.5, 10, 20, 5.0) == (2, 4.0)
    after = before.copy()
    after[2] = 0.5  # handle 12 -> slot 2, the later of its two priorities, ** 0.5; 5 and 3 were evicted
    assert np.array_equal(t.state(), after) and t.total == pytest.approx(after.sum())
    assert t.set_by_handle(np.array([4]), np.array([7.0]), 0.5, 10, 20, 5.0) == (0, 0.0)  # evicted only
    assert t.set_by_handle(np.array([], dtype=np.int64), np.array([]), 0.5, 10, 20, 5.0) == (0, 0.0)
    assert np.array_equal(t.state(), after)


# -- the kernels called directly: arguments they must refuse ----------------------------------------------------------
@needs_compiled
@pytest.mark.parametrize("call", ["K.set_one(s, m, l, P, 1, 0, 1.0)", "K.set(s, m, l, P, 1, np.zeros(1, np.int64), "
                                  "np.ones(1))", "K.build(s, m, l, P, 1)",
                                  "K.find(s, P, 1, np.array([0.5]), np.empty(1, np.int64))"])
def test_a_tree_size_whose_double_overflows_is_refused(call: str) -> None:
    """2P overflowed the size checks (P = 2**62), and the kernels wrote far past the arrays (a segfault): run in a
    child process, so a crash fails this test instead of ending the run."""
    code = textwrap.dedent(f"""
        import numpy as np
        from conduit.semantics.sumtree import _kernels as K
        s, m, l, P = np.zeros(2), np.full(2, np.inf), np.zeros(1), 2 ** 62
        try:
            {call}
        except ValueError:
            print("refused")
        """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "refused" in r.stdout, (r.returncode, r.stderr[-500:])


@needs_compiled
def test_the_kernels_refuse_arrays_of_another_type_and_report_the_first_bad_argument() -> None:
    """Buffers are taken by their format, not only their item size (int64 priorities were read as float64 bits),
    and a failed argument conversion is reported as itself, not as a SystemError of the next one."""
    K = sumtree._kernels  # noqa: N806
    t = CompiledSumTree(4)
    t.set(np.arange(4), np.ones(4))
    before = t.state()
    assert t.set_by_handle(np.array([0]), np.array([3]), 1.0, 0, 4, np.inf) is None  # int64 priorities
    assert t.set_by_handle(np.array([0.0]), np.array([3.0]), 1.0, 0, 4, np.inf) is None  # float handles
    for bad in (lambda: K.set(t._sums, t._mins, t._leaves, t._p, 4, np.array([1]), np.array([3])),
                lambda: K.set(t._sums, t._mins, t._leaves, t._p, 4, np.array([1.0]), np.array([3.0])),
                lambda: K.find(t._sums, t._p, 4, np.array([0.5]), np.empty(1))):
        with pytest.raises(TypeError):
            bad()
    assert np.array_equal(t.state(), before)

    class Weight:
        def __float__(self) -> float:
            return 1.0

    with pytest.raises(TypeError):
        K.set_one(t._sums, t._mins, t._leaves, t._p, 4, "x", Weight())
    with pytest.raises(TypeError):
        t.set_one(1.5, 1.0)  # (a fractional slot was truncated)
    assert np.array_equal(t.state(), before)
    assert CompiledSumTree(np.int64(8)).capacity == 8


def test_a_module_compiled_from_an_older_source_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """An install can leave a module compiled before a kernel was added (an editable install whose source moved
    on): it counts as no kernels, so the trees take NumPy's path instead of failing on the missing kernel."""
    import types

    old = types.ModuleType("conduit.semantics._sumtree")
    for name in sumtree.KERNELS[:-1]:  # the last one missing
        setattr(old, name, lambda *a: None)
    monkeypatch.setitem(sys.modules, "conduit.semantics._sumtree", old)
    assert load_kernels("conduit.semantics._sumtree", sumtree.KERNELS) is None
    setattr(old, sumtree.KERNELS[-1], lambda *a: None)
    assert load_kernels("conduit.semantics._sumtree", sumtree.KERNELS) is old
