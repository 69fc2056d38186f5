"""Telemetry totals read while other threads record, and the command line's refusals (no hang, no traceback)."""

from __future__ import annotations

import threading

import pytest
from conduit.cli import main
from conduit.errors import ConfigurationError
from conduit.telemetry import Telemetry

TINY = ["--obs-dim", "4", "--batch", "8", "--rollout", "16", "--capacity", "64", "--iterations", "1"]


def test_totals_can_be_iterated_while_other_threads_record_new_kinds() -> None:
    tel = Telemetry(fold_every=1)
    tel.record("ingest", 1, 1, 0.0, 1.0)
    items = iter(tel.totals.items())
    next(items)
    tel.record("deliver", 1, 1, 0.0, 1.0)  # another thread's first call of a new kind, folded meanwhile
    list(items)  # was: RuntimeError: dictionary changed size during iteration


def test_totals_read_concurrently_are_consistent_and_complete() -> None:
    tel = Telemetry(fold_every=4)
    per_thread, errors = 2000, []
    done = threading.Event()

    def work(k: int) -> None:
        for i in range(per_thread):
            tel.record(f"k{i % 7}", 1, 2, 0.0, 0.5)

    def read() -> None:
        while not done.is_set():
            try:
                for t in tel.totals.values():
                    assert t.nbytes == 2 * t.calls and t.items == t.calls and t.seconds == pytest.approx(0.5 * t.calls)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                return

    reader = threading.Thread(target=read)
    reader.start()
    workers = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    done.set()
    reader.join()
    assert not errors, errors[0]
    assert sum(t.calls for t in tel.totals.values()) == 3 * per_thread
    assert len(tel.records) == 3 * per_thread


@pytest.mark.timeout(60)
def test_run_loop_refuses_an_empty_rollout_instead_of_spinning_forever() -> None:
    from conduit.demo import run_loop

    out: list[BaseException] = []

    def go() -> None:
        try:
            run_loop(obs_dim=4, rollout=0, batch=8, capacity=64, iterations=1, warmup=0)
        except BaseException as e:  # noqa: BLE001
            out.append(e)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "run_loop(rollout=0) never returned (prefill ingests empty rollouts forever)"
    assert out and isinstance(out[0], ConfigurationError)


@pytest.mark.parametrize("argv", [
    ["demo", "--synthetic", "--no-baseline", "--trace", "", "--g-ing", "0", *TINY],
    ["demo", "--synthetic", "--no-baseline", "--trace", "", *TINY, "--rollout", "0"],
    ["schedule", "calibrate", "--g-ing-max", "0", "--warmup", "1", *TINY],
    ["schedule", "ranges", "--on-policy", "-M", "0"],
    ["schedule", "ranges", "-M", "0"],  # off-policy M bounds nothing, but a bad M is still refused
    ["plan", "--topology", "no-such-topology", "--obs-dim", "4", "--capacity", "8", "--batch", "2"],
])
@pytest.mark.timeout(60)
def test_cli_bad_arguments_give_an_error_and_a_nonzero_exit(argv: list[str],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
