"""The compiled sum tree (``conduit.semantics._sumtree``): built where it should be, chosen by the sampler, refusing
bad writes before it changes anything, and portable through pickles to installs without it. Its sums, minima and
searches are checked against brute force with NumPy's trees in ``test_semantics.py``."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
from conduit import ExperienceDataPlane, ExperienceSchema, Field, PrioritizedSampler, Replay
from conduit.semantics import sumtree
from conduit.semantics.sumtree import COMPILED, CompiledSumTree, SumTree, sum_tree

needs_compiled = pytest.mark.skipif(not COMPILED, reason="no compiled kernels in this install "
                                                         "(test_the_compiled_tree_is_built says whether expected)")


def test_the_compiled_tree_is_built() -> None:
    """CI installs with a C compiler and sets CONDUIT_REQUIRE_COMPILED=1: there the kernels must have been built
    (a broken build hook would otherwise only make prioritized replay slower). Anywhere, the sampler takes the
    tree this install's flag names."""
    if os.environ.get("CONDUIT_REQUIRE_COMPILED") == "1":
        assert COMPILED, ("conduit.semantics._sumtree was not compiled: see the warning conduit-core's build hook "
                          "(packages/conduit-core/hatch_build.py) printed during the install")
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
