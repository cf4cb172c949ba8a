"""planner.hardware.load: the busy threshold, the checks around a measurement, the notice on a
cached one; and the cpu-local figures that use them. The load is faked: nothing here depends
on how busy the machine running the tests is, and nothing heavy is timed."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from planner.errors import LayerwiseError
from planner.hardware import load as machine
from planner.hardware.load import (
    DEFAULT_MAX_LOAD,
    Load,
    LoadWatch,
    MachineBusyError,
    max_load,
    note_cached,
    wait_until_quiet,
)
from planner.hardware.presets import (
    CPU_LOCAL_DEFAULTS,
    cpu_local_figures,
    get_preset,
    measure_cpu_local,
)

NOW = datetime(2026, 11, 26, 6, 0, tzinfo=UTC)
LOGGER = "planner.hardware.load"


class FakeMachine:
    """A 2-core machine whose load average and clock the test sets."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, load: float = 0.0) -> None:
        self.load = load
        self.clock = 0.0
        monkeypatch.setattr(os, "getloadavg", lambda: (self.load, self.load, self.load))
        monkeypatch.setattr(machine, "cores", lambda: 2)
        self.time = SimpleNamespace(monotonic=lambda: self.clock, sleep=self.sleep)
        monkeypatch.setattr(machine, "time", self.time)  # the module's clock only
        monkeypatch.delenv(machine.MAX_LOAD_ENV, raising=False)

    def sleep(self, seconds: float) -> None:
        self.clock += seconds


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeMachine:
    monkeypatch.setenv("LAYERWISE_CACHE_DIR", str(tmp_path / "cache"))
    return FakeMachine(monkeypatch)


# -- the threshold ------------------------------------------------------------------------------


def test_max_load_default_environment_and_option(fake: FakeMachine, monkeypatch: Any) -> None:
    assert max_load() == DEFAULT_MAX_LOAD
    monkeypatch.setenv("LAYERWISE_MAX_LOAD", "0.8")
    assert max_load() == 0.8
    assert max_load(1.5) == 1.5  # a caller's limit (the CLI's --max-load) wins
    assert max_load(math.inf) == math.inf
    monkeypatch.setenv("LAYERWISE_MAX_LOAD", "lots")
    with pytest.raises(LayerwiseError, match="LAYERWISE_MAX_LOAD must be a load average.*'lots'"):
        max_load()
    with pytest.raises(LayerwiseError, match="load limit must be"):
        max_load(-1.0)


# -- around a measurement -------------------------------------------------------------------------


def test_a_busy_machine_is_refused_before_measuring(fake: FakeMachine) -> None:
    fake.load = 1.0  # one other busy process on 2 cores
    with pytest.raises(MachineBusyError) as err:
        LoadWatch("measuring things", workers=1)
    message = str(err.value)
    assert "busy: load average 1.00 on 2 cores (0.50 per core, busy above 0.3)" in message
    assert "measuring things" in message and "--max-load" in message
    assert "\n" not in message
    LoadWatch("measuring things", workers=1, limit=math.inf)  # on purpose: allowed
    fake.load = 0.6  # 0.3 per core: not over the limit
    LoadWatch("measuring things", workers=1)


def test_the_check_after_leaves_out_the_measurements_own_load(fake: FakeMachine) -> None:
    fake.load = 0.2
    watch = LoadWatch("profiling", workers=1)
    fake.clock = 60.0  # one minute of one busy process adds 1 - 1/e to the average
    own = 1 - math.exp(-1)
    fake.load = 0.2 + own
    load = watch.check()
    assert load == Load(0.2, 0.2, 2) and load.per_core == pytest.approx(0.1)
    fake.load = 1.4 + own  # meanwhile, another process started
    with pytest.raises(MachineBusyError, match=r"became busy while profiling.*1\.40 on 2 cores"):
        watch.check()
    assert watch.load() == Load(0.2, 1.4, 2)  # recorded, not judged


def test_wait_until_quiet(fake: FakeMachine) -> None:
    loads = iter([2.0, 1.0, 0.4])
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        fake.clock += seconds
        fake.load = next(loads)

    fake.time.sleep = sleep
    fake.load = 3.0
    assert wait_until_quiet(60.0, poll=5.0)
    assert slept == [5.0, 5.0, 5.0]
    fake.load = 3.0
    assert not wait_until_quiet(0.0)


def test_load_json_round_trip_and_unknown_forms() -> None:
    load = Load(0.5, 1.25, 2)
    assert load.to_json()["per_core"] == 0.625
    assert Load.from_json(load.to_json()) == load
    assert Load.from_json(Load(None, 0.1, 4).to_json()) == Load(None, 0.1, 4)
    for bad in (None, [1.0, 2.0], {"before": 1.0}, {"before": "x", "after": 1, "cores": 2}):
        assert Load.from_json(bad) is None
    assert Load(None, None, 2).per_core is None


# -- the notice on a cached measurement ------------------------------------------------------------


def _records(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]


def test_a_cached_measurement_is_noted_with_its_age_and_load(
    fake: FakeMachine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    quiet = Load(0.1, 0.2, 2)
    taken = [("2026-11-26T04:00:00+00:00", quiet)]
    line = note_cached("figures", Path("/c/f.json"), taken, "m", now=NOW)
    assert line == (
        "figures from /c/f.json: measured 2026-11-26 04:00 UTC (2.0 h ago) at load 0.10 per "
        "core (busy above 0.3)"
    )
    assert _records(caplog) == [(logging.INFO, line)]
    line = note_cached(
        "costs",
        Path("/c/m.json"),
        [("2026-11-26T04:00:00", quiet), ("2026-11-26T05:30:00", Load(0.0, 0.1, 2))],
        "m",
        "task shapes",
        now=NOW,
    )
    assert line == (
        "costs from /c/m.json: 2 task shapes, measured 2026-11-26 04:00 to 2026-11-26 05:30 UTC "
        "(30 min to 2.0 h ago) at load 0.05-0.10 per core (busy above 0.3)"
    )


def test_an_untrusted_measurement_is_a_warning_that_says_how_to_measure_again(
    fake: FakeMachine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    taken = [
        ("2026-11-26T05:00:00", Load(0.1, 0.1, 2)),
        ("2026-11-26T05:00:00", Load(0.2, 1.8, 2)),  # measured on purpose under load
        (None, None),  # an older cache: no load, no time
    ]
    line = note_cached("costs", Path("/c/m.json"), taken, "profile it", "task shapes", now=NOW)
    assert "at load 0.05-0.90 per core" in line
    assert (
        "untrusted: 1 of 3 without a recorded load (an older cache) and 1 of 3 measured on a "
        "busy machine, so they may count other processes' work" in line
    )
    assert line.endswith("measure again on a quiet machine with `profile it`")
    assert _records(caplog) == [(logging.WARNING, line)]
    old = note_cached("figures", Path("/c/f.json"), [(None, None)], "measure it", now=NOW)
    assert old == (
        "figures from /c/f.json: measured at an unknown time; untrusted: 1 without a recorded "
        "load (an older cache), so they may count other processes' work: measure again on a "
        "quiet machine with `measure it`"
    )


# -- cpu-local figures --------------------------------------------------------------------------------


def _write_figures(fake: FakeMachine, **fields: Any) -> Path:
    path = Path(os.environ["LAYERWISE_CACHE_DIR"]) / "cpu-local.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    figures = dict(CPU_LOCAL_DEFAULTS) | {"latency": 2e-3}
    path.write_text(json.dumps(figures | fields))
    return path


def test_cpu_local_figures_in_use_are_noted(
    fake: FakeMachine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    assert not cpu_local_figures().measured and not _records(caplog)  # defaults: nothing cached
    path = _write_figures(
        fake, measured_at="2026-11-26T05:00:00+00:00", load=Load(0.1, 0.3, 2).to_json()
    )
    g = get_preset("cpu-local-2")
    assert g.latency[0, 1] == pytest.approx(2e-3)
    ((level, line),) = _records(caplog)
    assert level == logging.INFO
    figures = "latency 2000 us, bandwidth 3.00 GB/s, message overhead 500 us"
    assert line.startswith(f"cpu-local figures ({figures}) from {path}: measured 2026-11-26 05:00")
    assert "at load 0.15 per core (busy above 0.3)" in line
    assert cpu_local_figures().trusted


def test_old_cpu_local_figures_are_untrusted(
    fake: FakeMachine, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's cache: a 2 ms latency measured under load by an older layerwise, which
    recorded no load. Still used (so plans do not change under the user), never silently."""
    caplog.set_level(logging.INFO, LOGGER)
    _write_figures(fake, measured_at="2026-11-20T10:00:00+00:00")
    figures = cpu_local_figures()
    assert figures.measured and not figures.trusted and figures.figures["latency"] == 2e-3
    ((level, line),) = _records(caplog)
    assert level == logging.WARNING and "untrusted: 1 without a recorded load" in line
    assert "python -m planner devices cpu-local-2 --measure" in line
    _write_figures(fake, load=Load(1.6, 1.5, 2).to_json())  # measured busy, on purpose
    assert not cpu_local_figures().trusted
    assert "measured on a busy machine" in _records(caplog)[-1][1]


def _fake_spawn(fake: FakeMachine, load_after: float) -> Callable[..., None]:
    def spawn(fn: Any, args: tuple[Any, ...], nprocs: int, join: bool) -> None:
        n, tmp = args
        result = dict(CPU_LOCAL_DEFAULTS) | {"busy_exchange": 1e-3}
        (Path(tmp) / "result.json").write_text(json.dumps(result))
        fake.clock += 10.0
        fake.load = load_after

    return spawn


def test_measure_cpu_local_records_its_load_and_time(
    fake: FakeMachine, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.multiprocessing

    own = 2 * (1 - math.exp(-10 / 60))  # two busy workers for 10 s
    monkeypatch.setattr(torch.multiprocessing, "spawn", _fake_spawn(fake, 0.1 + own))
    fake.load = 0.1
    figures = measure_cpu_local(2)
    assert figures["load"] == {"before": 0.1, "after": 0.1, "cores": 2, "per_core": 0.05}
    assert datetime.fromisoformat(figures["measured_at"]).tzinfo is not None
    cached = json.loads((Path(os.environ["LAYERWISE_CACHE_DIR"]) / "cpu-local.json").read_text())
    assert cached == figures and cpu_local_figures().trusted


def test_measure_cpu_local_on_a_busy_machine_caches_nothing(
    fake: FakeMachine, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.multiprocessing

    path = Path(os.environ["LAYERWISE_CACHE_DIR"]) / "cpu-local.json"
    spawned: list[int] = []
    monkeypatch.setattr(torch.multiprocessing, "spawn", lambda *a, **k: spawned.append(1))
    fake.load = 2.0
    with pytest.raises(MachineBusyError, match="busy: load average 2.00 on 2 cores"):
        measure_cpu_local(2)
    assert not spawned and not path.exists()  # refused before any worker started
    monkeypatch.setattr(torch.multiprocessing, "spawn", _fake_spawn(fake, 3.0))
    fake.load = 0.1
    with pytest.raises(MachineBusyError, match="became busy while measuring the cpu-local"):
        measure_cpu_local(2)
    assert not path.exists()
    fake.load = 2.0
    monkeypatch.setattr(torch.multiprocessing, "spawn", _fake_spawn(fake, 2.0))
    figures = measure_cpu_local(2, max_load=math.inf)  # on purpose: recorded as busy
    assert figures["load"]["per_core"] == 1.0 and not cpu_local_figures().trusted


# -- command lines -------------------------------------------------------------------------------


def test_devices_measure_on_a_busy_machine_is_one_error_line(
    fake: FakeMachine, capsys: pytest.CaptureFixture[str]
) -> None:
    from planner.cli import main

    fake.load = 1.5
    assert main(["devices", "cpu-local-2", "--measure"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the machine is busy: load average 1.50 on 2 cores")
    assert err.count("\n") == 1 and "--max-load" in err
    assert main(["devices", "p100-1x4", "--max-load", "1"]) == 2
    assert "--max-load applies to --measure only" in capsys.readouterr().err
    for bad in ("-1", "x", "nan"):
        assert main(["devices", "cpu-local-2", "--measure", "--max-load", bad]) == 2
        assert "load average per core >= 0" in capsys.readouterr().err


def test_devices_says_where_cpu_local_figures_come_from(
    fake: FakeMachine, capsys: pytest.CaptureFixture[str]
) -> None:
    from planner.cli import main

    path = _write_figures(fake, measured_at="2026-11-26T05:00:00+00:00")
    assert main(["devices", "cpu-local-2"]) == 0
    err = capsys.readouterr().err
    assert "planner.hardware.load: cpu-local figures (latency 2000 us, bandwidth 3.00 GB/s" in err
    assert f"from {path}: measured 2026-11-26 05:00 UTC" in err
    assert "untrusted" in err and err.count("\n") == 1
