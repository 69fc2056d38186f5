"""``Telemetry.record`` with arguments that are not a call's.

``record()`` took anything and appended it to the queue; the fold that took the bad call (on whichever thread read
or recorded next) raised a raw ``TypeError`` after it had taken the queue, so every call other threads recorded
with it was lost: ``records`` and ``totals`` empty, an ``ExposureLog`` iteration measured from nothing. A bad call
is now refused where it is made, with :class:`ConfigurationError`, and nothing is recorded; NumPy and tensor counts
are kept as ints, as ``span()`` keeps them.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch
from conduit.errors import ConfigurationError
from conduit.telemetry import Telemetry

TIMEOUT = 60.0


def _record_on_a_worker(tel: Telemetry, calls: int) -> None:
    def work() -> None:
        for i in range(calls):
            tel.record("deliver", 1, 8, float(i), float(i) + 0.5)

    t = threading.Thread(target=work, name="recorder")
    t.start()
    t.join(TIMEOUT)
    assert not t.is_alive()


@pytest.mark.parametrize(("args", "match"), [
    (("update", 1, "8", 0.0, 1.0), "nbytes"),
    (("update", 1.5, 8, 0.0, 1.0), "items"),
    (("update", True, 8, 0.0, 1.0), "items"),
    (("update", torch.ones(2, dtype=torch.int64), 8, 0.0, 1.0), "items"),
    (("update", 1, 8, "0.0", 1.0), "start"),
    (("update", 1, 8, 0.0, None), "end"),
    (("update", 1, 8, 0.0, 10**400), "end"),
    ((["update"], 1, 8, 0.0, 1.0), "kind"),
    ((5, 1, 8, 0.0, 1.0), "kind"),
])
def test_a_bad_call_is_refused_where_it_is_made_and_the_other_threads_calls_stay(args: tuple[Any, ...],
                                                                                 match: str) -> None:
    tel = Telemetry(fold_every=1024)  # the worker's calls wait in the queue with the bad one
    _record_on_a_worker(tel, 10)
    with pytest.raises(ConfigurationError, match=match):
        tel.record(*args)
    assert len(tel.records) == 10  # was: TypeError here, and then 0: the fold lost them
    assert set(tel.totals) == {"deliver"} and tel.totals["deliver"].calls == 10
    assert tel.summary()["deliver"]["bytes"] == 80


def test_numpy_and_tensor_counts_and_times_are_recorded_as_python_numbers() -> None:
    tel = Telemetry()
    tel.record("update", np.int32(2), torch.tensor(16), np.float64(1.0), 2)
    (r,) = tel.records
    assert r[:5] == ("update", 2, 16, 1.0, 2.0)
    assert [type(v) for v in r[1:5]] == [int, int, float, float]


def test_nan_and_backwards_times_are_still_recorded_and_add_no_time() -> None:
    tel = Telemetry()
    tel.record("deliver", 1, 8, float("nan"), 1.0)
    tel.record("deliver", 1, 8, 2.0, 1.0)
    t = tel.totals["deliver"]
    assert (t.calls, t.items, t.nbytes, t.seconds) == (2, 2, 16, 0.0)
