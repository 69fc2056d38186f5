"""Schedulers not serving a buffer yet, and ``Overlapped.trim_buffers`` with items of no bytes.

Each case was a known defect: ``close``, ``flush``, ``pending``, ``prepared``, ``release_buffers`` and the other
calls of an ``Overlapped`` or ``Automatic`` built but not passed to a buffer raised a bare ``AttributeError``; and
``trim_buffers(..., item_bytes=0)`` (a schema of ragged fields only) raised ``ZeroDivisionError``.
"""

from __future__ import annotations

import pytest
import torch
from conduit import Automatic, ExperienceDataPlane, ExperienceSchema, Field, Overlapped
from conduit.errors import ConfigurationError


@pytest.mark.parametrize("make", [Overlapped, Automatic], ids=["overlapped", "automatic"])
def test_a_scheduler_serving_no_buffer_has_nothing_to_flush_close_or_report(make: type) -> None:
    sched = make()
    sched.flush()
    sched.close()
    sched.close()
    assert sched.pending() == []
    sched.invalidate("contents")
    # closing it changed nothing: it still serves a buffer afterwards
    edp = ExperienceDataPlane(ExperienceSchema(obs=Field((2,))), capacity=16, scheduler=sched)
    try:
        edp.ingest({"obs": torch.ones(4, 2)})
        edp.flush()
        assert edp.deliver(2)[0].batch_size == 2
    finally:
        edp.close()


def test_an_overlapped_serving_no_buffer_holds_no_buffers_and_refuses_what_depends_on_one() -> None:
    sched = Overlapped(g_del=2)
    assert sched.prepared == 0
    assert sched.drain()
    sched.release_buffers()
    sched.trim_buffers(0, 4, 8, room_for_a_chunk=False)
    with pytest.raises(ConfigurationError, match="scheduler="):
        sched.retune(g_del=4)
    with pytest.raises(ConfigurationError, match="scheduler="):
        _ = sched.priority_staleness
    assert sched.g_del == 2  # the refused retune changed nothing


def test_an_automatic_serving_no_buffer_is_not_calibrated_and_has_no_granularities_yet() -> None:
    sched = Automatic()
    assert not sched.calibrated
    for name in ("g_ing", "g_del"):
        with pytest.raises(ConfigurationError, match="scheduler="):
            getattr(sched, name)


def test_trim_buffers_with_items_of_no_bytes_keeps_the_buffers_and_refuses_negative_sizes() -> None:
    sched = Overlapped(g_ing=1, g_del=2, overlap=False)
    edp = ExperienceDataPlane(ExperienceSchema(obs=Field((2,))), capacity=64, scheduler=sched)
    try:
        edp.ingest({"obs": torch.ones(16, 2)})
        edp.flush()
        edp.deliver(4)
        edp.deliver(4)  # (the chunk's second batch: its buffer is idle now)
        held = sched._ring.held_rows()
        assert held > 0
        sched.trim_buffers(0, 4, 0, room_for_a_chunk=True)  # (items of no bytes never exceed a budget)
        assert sched._ring.held_rows() == held
        for bad in (-1, float("nan")):
            with pytest.raises(ConfigurationError, match="item_bytes"):
                sched.trim_buffers(0, 4, bad, room_for_a_chunk=False)
        assert sched._ring.held_rows() == held
        sched.trim_buffers(0, 4, 8, room_for_a_chunk=False)  # a real budget still lets go of the idle ones
        assert sched._ring.held_rows() < held
    finally:
        edp.close()
