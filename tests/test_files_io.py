"""Issue 42, items 2, 5 and 10: what a file path may be (planner/files.py's rules).

Outputs: a regular file is replaced atomically, a symlink is followed (the link stays a
link), and a FIFO, socket, device (/dev/null included) or symlink loop is refused, left as it
was. Inputs: a FIFO, socket, device or directory is refused at once (a FIFO used to block the
reader for ever). Malformed device files name the field. Every bad input ends in one
`error:` line and exit status 2.

A CLI run that reads a FIFO runs in a subprocess, watched: if it opens the FIFO for reading
(it would wait there for a writer), the test opens and closes the write end so the run ends
at once, and fails; a run that still has not ended after 20 s is killed and fails.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from planner.cli import main
from planner.errors import DeviceGraphError, LayerwiseError
from planner.files import (
    check_input_file,
    check_output_path,
    read_bytes_checked,
    read_json_checked,
    write_text_atomic,
)
from planner.hardware.devices import DeviceGraph
from planner.hardware.presets import get_preset
from planner.problems.costtable import load_problem, problem_to_json, random_problem, save_problem
from tests.graphs import chain_cnn

ROOT = Path(__file__).resolve().parents[1]
HANG_SECONDS = 20
PLAN = ["--devices", "p100-1x4", "--backend", "elimination"]

# -- special files -------------------------------------------------------------------------


def make_fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def make_socket(path: Path) -> Path:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()  # the socket file stays
    return path


def make_char_device(path: Path) -> Path:
    """/dev/null's twin (char 1, 3); the test is skipped where mknod is not permitted."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("mknod of a character device needs root (CAP_MKNOD)")
    return path


def make_loop(path: Path) -> Path:
    other = path.with_name(path.name + ".other")
    os.symlink(other, path)
    os.symlink(path, other)
    return path


SPECIAL: dict[str, tuple[Callable[[Path], Path], Callable[[int], bool], str]] = {
    "fifo": (make_fifo, stat.S_ISFIFO, "a FIFO"),
    "socket": (make_socket, stat.S_ISSOCK, "a socket"),
    "char-device": (make_char_device, stat.S_ISCHR, "a character device"),
}


def kind_of(path: Path) -> int:
    return os.lstat(path).st_mode


@pytest.fixture
def short_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with a short path (a unix socket's path is at most 107 bytes)."""
    return tmp_path_factory.mktemp("io")


# -- outputs: function level ---------------------------------------------------------------


@pytest.mark.parametrize("kind", list(SPECIAL))
def test_an_output_that_is_a_fifo_socket_or_device_is_refused_and_left_alone(
    short_tmp: Path, kind: str
) -> None:
    make, is_kind, name = SPECIAL[kind]
    node = make(short_tmp / "out.json")
    with pytest.raises(LayerwiseError, match=rf"^cannot write plan .*out\.json: it is {name}"):
        check_output_path(node, "plan")
    with pytest.raises(LayerwiseError, match=rf"it is {name}"):
        write_text_atomic(node, "{}")
    assert is_kind(kind_of(node)), "the node was replaced"
    assert sorted(p.name for p in short_tmp.iterdir()) == ["out.json"]  # no temporary left


def test_dev_null_is_refused_as_an_output() -> None:
    if not Path("/dev/null").exists():
        pytest.skip("no /dev/null")
    with pytest.raises(LayerwiseError, match=r"/dev/null: it is a character device"):
        check_output_path("/dev/null", "plan")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_a_symlink_loop_is_refused_as_an_output(tmp_path: Path) -> None:
    loop = make_loop(tmp_path / "loop.json")
    for call in (lambda: check_output_path(loop, "plan"), lambda: write_text_atomic(loop, "{}")):
        with pytest.raises(LayerwiseError, match="symlink loop"):
            call()
    assert loop.is_symlink()


def test_a_symlink_is_followed_and_stays_a_link(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "plan.json"
    target.write_text("old")
    link = tmp_path / "plan.json"
    link.symlink_to(Path("real") / "plan.json")  # relative, into another directory
    assert check_output_path(link, "plan") == link
    write_text_atomic(link, "new")
    assert link.is_symlink() and os.readlink(link) == str(Path("real") / "plan.json")
    assert target.read_text() == "new" and stat.S_ISREG(kind_of(target))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "real"]
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["plan.json"]


def test_a_dangling_symlink_creates_its_target(tmp_path: Path) -> None:
    link = tmp_path / "plan.json"
    link.symlink_to(tmp_path / "made.json")
    check_output_path(link, "plan")
    write_text_atomic(link, "x")
    assert link.is_symlink() and (tmp_path / "made.json").read_text() == "x"


def test_a_symlink_to_a_fifo_is_refused(short_tmp: Path) -> None:
    fifo = make_fifo(short_tmp / "f")
    link = short_tmp / "out.json"
    link.symlink_to(fifo)
    with pytest.raises(LayerwiseError, match="it is a FIFO"):
        write_text_atomic(link, "{}")
    assert link.is_symlink() and stat.S_ISFIFO(kind_of(fifo))


def test_the_other_writers_follow_the_same_rules(short_tmp: Path) -> None:
    """save_problem (streamed) and DeviceGraph.save (once open(path, "w") and write_text):
    a FIFO is refused, not written into (which blocked) or replaced; a symlink is followed."""
    problem, devices = random_problem(5, 3, seed=2), get_preset("p100-1x2")
    fifo = make_fifo(short_tmp / "f")
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a writer that opens it does not block
    try:
        for save in (lambda p: save_problem(problem, p), devices.save):
            with pytest.raises(LayerwiseError, match="it is a FIFO"):
                save(fifo)
            assert stat.S_ISFIFO(kind_of(fifo))
    finally:
        os.close(reader)
    link = short_tmp / "link.json"
    link.symlink_to(short_tmp / "real.json")
    save_problem(problem, link)
    assert link.is_symlink() and load_problem(short_tmp / "real.json").sizes == problem.sizes
    devices.save(link)
    assert link.is_symlink() and DeviceGraph.load(short_tmp / "real.json") == devices
    assert sorted(p.name for p in short_tmp.iterdir()) == ["f", "link.json", "real.json"]


def test_a_log_file_may_be_appended_to_a_device_or_a_read_fifo(short_tmp: Path) -> None:
    """append=True (a log file, opened in place): /dev/null and a FIFO with a reader are
    fine; a FIFO no process reads is refused (opening it would wait), a socket too."""
    if Path("/dev/null").exists():
        assert check_output_path("/dev/null", "log file", append=True) == Path("/dev/null")
    fifo = make_fifo(short_tmp / "log")
    with pytest.raises(LayerwiseError, match="it is a FIFO no process reads"):
        check_output_path(fifo, "log file", append=True)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert check_output_path(fifo, "log file", append=True) == fifo
    finally:
        os.close(reader)
    with pytest.raises(LayerwiseError, match="it is a socket"):
        check_output_path(make_socket(short_tmp / "s"), "log file", append=True)
    assert check_output_path(short_tmp / "new.log", "log file", append=True)


# -- outputs: through the CLI --------------------------------------------------------------


@pytest.fixture(scope="module")
def graph_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("graph") / "chain.json"
    path.write_text(json.dumps(chain_cnn().to_json()))
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error(code: int, err: str) -> str:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("kind", list(SPECIAL))
def test_plan_o_and_graph_json_refuse_a_special_file(
    short_tmp: Path, graph_file: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    make, is_kind, name = SPECIAL[kind]
    node = make(short_tmp / "n")
    for argv in (
        ["plan", "--graph", str(graph_file), *PLAN, "-o", str(node)],
        ["graph", "lenet5", "--batch", "8", "--json", str(node)],  # refused before capture
    ):
        line = one_error(*run(capsys, *argv)[::2])
        assert f"{node}: it is {name}" in line, line
        assert is_kind(kind_of(node)), f"{argv[0]} replaced the {name}"


def test_plan_o_writes_through_a_symlink(
    tmp_path: Path, graph_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "kept.json"
    target.write_text("old")
    link = tmp_path / "plan.json"
    link.symlink_to(target)
    code, out, err = run(capsys, "plan", "--graph", str(graph_file), *PLAN, "-o", str(link))
    assert code == 0, err
    assert link.is_symlink() and json.loads(target.read_text())["format"]


# -- inputs: function level ----------------------------------------------------------------


@pytest.mark.parametrize("kind", [*SPECIAL, "directory"])
def test_an_input_that_is_no_regular_file_is_refused_unopened(short_tmp: Path, kind: str) -> None:
    if kind == "directory":
        path, name = short_tmp / "d", "a directory"
        path.mkdir()
    else:
        make, _, name = SPECIAL[kind]
        path = make(short_tmp / "in.json")
    for call in (
        lambda: read_bytes_checked(path, "graph", DeviceGraphError),
        lambda: read_json_checked(path, "graph", DeviceGraphError),
        lambda: check_input_file(path, "graph", DeviceGraphError),
    ):
        with pytest.raises(DeviceGraphError, match=rf"^graph path .* is {name}, not a file: "):
            call()


def test_input_paths_missing_looping_and_linked(tmp_path: Path) -> None:
    with pytest.raises(LayerwiseError, match=r"problem file .*nope\.json does not exist$"):
        read_bytes_checked(tmp_path / "nope.json", "problem")
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "gone.json")
    with pytest.raises(LayerwiseError, match=r"does not exist \(a symlink to a missing file\)"):
        read_bytes_checked(dangling, "problem")
    with pytest.raises(LayerwiseError, match="symlink loop"):
        read_bytes_checked(make_loop(tmp_path / "loop.json"), "problem")
    with pytest.raises(LayerwiseError, match="symlink loop"):
        check_input_file(tmp_path / "loop.json", "problem")
    check_input_file(tmp_path / "nope.json")  # missing: for the reader to say
    real = tmp_path / "real.json"
    real.write_text('{"a": 1}')
    (tmp_path / "link.json").symlink_to(real)
    assert read_json_checked(tmp_path / "link.json") == {"a": 1}


# -- inputs: FIFOs through the CLI, in a watched subprocess ---------------------------------


def run_watched(argv: list[str], fifo: Path) -> tuple[int, str, str, bool]:
    """`python -m planner argv` in a subprocess: (status, stdout, stderr, whether it opened
    `fifo` for reading, i.e. would have hung)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "planner", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    waited = False
    deadline = time.monotonic() + HANG_SECONDS
    while proc.poll() is None:
        try:  # succeeds only while a reader has the FIFO open: the run is waiting on it
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            pass
        else:
            waited = True
            os.close(fd)  # end of file: the reader stops waiting
        if time.monotonic() > deadline:
            proc.kill()
            proc.communicate()
            pytest.fail(f"{argv} hung on a FIFO for {HANG_SECONDS} s")
        time.sleep(0.02)
    out, err = proc.communicate()
    return proc.returncode, out, err, waited


FIFO_RUNS = [
    pytest.param(["plan", "--problem", "{fifo}"], id="plan-problem"),
    pytest.param(["plan", "{fifo}", "--devices", "p100-1x4"], id="plan-model-file"),
    pytest.param(["plan", "--graph", "{graph}", "--devices", "{fifo}"], id="plan-devices"),
    pytest.param(["devices", "{fifo}"], id="devices"),
    pytest.param(["evaluate", "{fifo}"], id="evaluate"),
    pytest.param(["plan", "--graph", "{fifo}", *PLAN], id="plan-graph"),
]


@pytest.mark.parametrize("argv", FIFO_RUNS)
def test_a_fifo_given_as_an_input_is_refused_at_once(
    short_tmp: Path, graph_file: Path, argv: list[str]
) -> None:
    fifo = make_fifo(short_tmp / "in.json")
    argv = [a.format(fifo=fifo, graph=graph_file) for a in argv]
    code, out, err, waited = run_watched(argv, fifo)
    assert not waited, f"{argv} opened the FIFO and waited for a writer"
    line = one_error(code, err)
    assert f"{fifo} is a FIFO, not a file" in line, line


# -- device files (item 10) ----------------------------------------------------------------


def _device_doc() -> dict[str, Any]:
    return get_preset("p100-1x2").to_json()


def _edited(edit: Callable[[dict[str, Any]], Any]) -> Any:
    doc = _device_doc()
    out = edit(doc)
    return doc if out is None else out


DEVICE_FILES: list[tuple[str, Callable[[dict[str, Any]], Any], str]] = [
    (
        "missing-memory",
        lambda d: d["devices"][1].pop("memory") and None,
        r'devices\[1\] \(gpu1\) has no "memory": give its memory in bytes',
    ),
    (
        "memory-a-string",
        lambda d: d["devices"][0].update(memory="16G"),
        r'devices\[0\] \(gpu0\): "memory" must be a number .* not \'16G\' \(a string\)',
    ),
    (
        "kind-a-number",
        lambda d: d["devices"][0].update(kind=3),
        r'devices\[0\] \(gpu0\): "kind" must be a string',
    ),
    (
        "negative-bandwidth",
        lambda d: d["links"][0].update(bandwidth=-1),
        r"links\[0\]: link gpu0-\S+: bandwidth must be finite and > 0, got -1",
    ),
    (
        "missing-latency",
        lambda d: d["links"][1].pop("latency") and None,
        r'links\[1\] \(\S+\) has no "latency": give seconds',
    ),
    ("no-devices", lambda d: d.update(devices=[]), r'"devices" is empty: give at least one'),
    ("devices-missing", lambda d: d.pop("devices") and None, r'it has no "devices"'),
    ("device-a-list", lambda d: d["devices"].__setitem__(0, [1]), r"devices\[0\] must be an"),
    ("a-list", lambda d: [d], r"expected a JSON object .* not \[.*\(a list\)"),
    ("nan-flops", lambda d: d["devices"][0].update(flops=float("nan")), r"flops must be > 0"),
    (
        "huge-latency",
        lambda d: d["links"][0].update(latency=1e308),  # was an OverflowError (route weights)
        r"links\[0\]: link \S+: a 1 MiB message would take 1e\+308 s .* check the units",
    ),
]


@pytest.mark.parametrize(
    ("edit", "message"), [pytest.param(e, m, id=i) for i, e, m in DEVICE_FILES]
)
def test_a_malformed_device_file_names_the_field_and_what_to_give(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    edit: Callable[[dict[str, Any]], Any],
    message: str,
) -> None:
    f = tmp_path / "machines.json"
    f.write_text(json.dumps(_edited(edit)))
    with pytest.raises(DeviceGraphError, match=rf"^device file {f}: .*{message}"):
        DeviceGraph.load(f)
    line = one_error(*run(capsys, "devices", str(f))[::2])
    assert "KeyError" not in line and "TypeError" not in line, line


def test_a_device_file_still_round_trips(tmp_path: Path) -> None:
    g = get_preset("p100-2x2")
    g.save(tmp_path / "g.json")
    assert DeviceGraph.load(tmp_path / "g.json") == g


# -- ~30 bad inputs through the CLI ----------------------------------------------------------


def _problem_text() -> str:
    return json.dumps(problem_to_json(random_problem(4, 3, seed=1, forbid_prob=0.0)))


def _with_limit(value: str) -> bytes:
    """The problem with its usage_limit written as `value` (not JSON's numbers)."""
    return _problem_text().replace('"usage_limit": ', f'"usage_limit": {value}, "was": ').encode()


HUGE_INT = '{"problem": {"nodes": {"costs": [[1%s]]}, "edges": {"nodes": [], "costs": []}}}'

CONTENTS: dict[str, Callable[[], bytes]] = {
    "empty": lambda: b"",
    "not-json": lambda: b"hello, planner",
    "a-list": lambda: b"[1, 2, 3]",
    "truncated": lambda: _problem_text()[:40].encode(),
    "binary": lambda: bytes(range(256)) * 4,
    "nan": lambda: _with_limit("NaN"),
    "huge-float": lambda: _with_limit("1e999"),
    "huge-int": lambda: (HUGE_INT % ("0" * 400)).encode(),
}

KINDS = ["directory", "missing", "loop", "fifo"]

# the command reading a file (its path is {f}); each is run with every content and kind
READERS = {
    "problem": ["plan", "--problem", "{f}"],
    "devices": ["devices", "{f}"],
    "model": ["plan", "{f}", "--devices", "p100-1x4"],
    "graph": ["plan", "--graph", "{f}", *PLAN],
    "plan": ["evaluate", "{f}"],
}


def _bad_inputs() -> Iterator[Any]:
    for reader in READERS:
        for content in CONTENTS:
            if reader == "problem" or content in ("empty", "not-json", "binary", "truncated"):
                yield pytest.param(reader, content, id=f"{reader}-{content}")
        for kind in KINDS:
            yield pytest.param(reader, kind, id=f"{reader}-{kind}")


@pytest.mark.parametrize(("reader", "bad"), list(_bad_inputs()))
def test_bad_inputs(
    short_tmp: Path, capsys: pytest.CaptureFixture[str], reader: str, bad: str
) -> None:
    f = short_tmp / "in.json"
    if bad == "directory":
        f.mkdir()
    elif bad == "loop":
        make_loop(f)
    elif bad == "fifo":
        make_fifo(f)
    elif bad != "missing":
        f.write_bytes(CONTENTS[bad]())
    argv = [a.format(f=f) for a in READERS[reader]]
    if bad == "fifo":  # a hang must fail the test, not hang it
        code, out, err, waited = run_watched(argv, f)
        assert not waited, f"{argv} opened the FIFO and waited for a writer"
    else:
        code, out, err = run(capsys, *argv)
    line = one_error(code, err)
    assert str(f) in line, line  # the file is named
    assert "written" not in out


def test_there_are_about_thirty_bad_inputs() -> None:
    assert len(list(_bad_inputs())) >= 30


def test_a_replaced_file_keeps_its_permissions(tmp_path: Path) -> None:
    from planner.files import write_text_atomic

    private = tmp_path / "plan.json"
    private.write_text("old")
    private.chmod(0o600)
    write_text_atomic(private, "new")
    assert private.read_text() == "new" and stat.S_IMODE(private.stat().st_mode) == 0o600
