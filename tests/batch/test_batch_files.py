"""run-batch touches no file it did not make: `semif-serve run-batch` in a child process, pointed
at the input, a link to it, a device, a directory, a user's notes, a corrupt or foreign output, a
locked output, a missing or unwritable directory, is refused with exit 2 and one line naming the
file, before anything is written; the file is left byte for byte. The child's model directory is
empty, so a run that went on to load the model would exit 3 instead (the checks come first)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from semif_serve.batch.files import OutputLock
from tests.support import TOKEN
from tests.support.batch import child_env, run_batch

LINES = [
    {"custom_id": "a", "method": "POST", "url": "/decide", "body": {"id": "q"}},
    {"custom_id": "b", "method": "POST", "url": "/decide", "body": {"id": "q"}},
]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """Settings whose model directory is empty: loading it fails (exit 3), checks come first."""
    empty = tmp_path_factory.mktemp("no-model")
    return child_env(SEMIF_MODEL_PATH=str(empty), SEMIF_MODEL_REVISION="r", SEMIF_API_TOKEN=TOKEN)


@pytest.fixture
def source(tmp_path) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    return path


def output_line(custom_id: str) -> bytes:
    """An output line as run-batch writes it for `custom_id`, its id computed here from sha-256."""
    digest = hashlib.sha256(f"id:{custom_id}".encode()).hexdigest()[:24]
    result = {
        "id": f"batch_req_{digest}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": f"batch-{digest}", "body": {}},
        "error": None,
    }
    return json.dumps(result, separators=(",", ":")).encode() + b"\n"


def assert_refused(result: subprocess.CompletedProcess, *words: str) -> str:
    """Exit 2, one line on stderr holding every one of `words`, and no traceback; the line."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def test_an_output_that_is_the_input_is_refused_and_the_input_kept(env, source):
    before = source.read_bytes()
    line = assert_refused(
        run_batch(env, "-i", str(source), "-o", str(source)), f"-o {source}", "the same file"
    )
    assert (
        line
        == f"run-batch: -o {source} is the input {source} (the same file): refusing to write over the input"
    )
    assert source.read_bytes() == before
    assert not Path(f"{source}.lock").exists()


def test_an_output_that_is_a_symlink_to_the_input_is_refused(env, source, tmp_path):
    link = tmp_path / "results.jsonl"
    link.symlink_to(source)
    before = source.read_bytes()
    assert_refused(run_batch(env, "-i", str(source), "-o", str(link)), f"-o {link}", "the same file")
    assert source.read_bytes() == before


def test_an_output_that_is_a_hard_link_to_the_input_is_refused_by_its_inode(env, source, tmp_path):
    twin = tmp_path / "results.jsonl"
    os.link(source, twin)
    before = source.read_bytes()
    assert_refused(run_batch(env, "-i", str(source), "-o", str(twin)), f"-o {twin}", "the same file")
    assert source.read_bytes() == before


def test_stdin_read_from_the_output_file_is_refused(env, source):
    with source.open("rb") as stdin:
        result = run_batch(env, "-i", "-", "-o", str(source), stdin=stdin)
    assert_refused(result, f"-o {source} is stdin (the same file)")


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null"])
def test_a_device_is_refused_as_an_output(env, source, device):
    line = assert_refused(
        run_batch(env, "-i", str(source), "-o", device), f"-o {device} is a character device"
    )
    assert "-o - writes to stdout" in line


def test_a_directory_is_refused_as_an_output(env, source, tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    assert_refused(run_batch(env, "-i", str(source), "-o", str(folder)), f"-o {folder} is a directory")
    assert list(folder.iterdir()) == []


def test_a_users_notes_are_refused_and_kept_byte_for_byte(env, source, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_bytes(b"keep me\nand me too")
    line = assert_refused(run_batch(env, "-i", str(source), "-o", str(notes)))
    assert line == (
        f"run-batch: -o {notes} is not a run-batch output of {source}: its line 1 is not JSON; "
        "it was left as it is"
    )
    assert notes.read_bytes() == b"keep me\nand me too"


CORRUPT = {
    "a middle line not JSON": (
        [output_line("a"), b"this is not JSON\n", output_line("b")],
        "line 2 is not JSON",
    ),
    "an array": ([output_line("a"), b"[1, 2]\n"], "line 2 is an array in JSON, not an object"),
    "an object without id": (
        [b'{"custom_id": "a"}\n'],
        'line 1 has no run-batch "id" (batch_req_ and 24 hex digits)',
    ),
    "an id of another form": (
        [b'{"id": "req_1", "custom_id": "a"}\n'],
        'line 1 has no run-batch "id" (batch_req_ and 24 hex digits)',
    ),
    "bad UTF-8": ([output_line("a"), b'{"id": "\xff\xfe"}\n'], "line 2 is not UTF-8 (byte 9)"),
    "a blank middle line": ([output_line("a"), b"\n", output_line("b")], "line 2 is blank"),
    "another input's output": (
        [output_line("a"), output_line("zz")],
        "line 2 holds an id that no line of the input has",
    ),
    "two runs' lines": (
        [output_line("a"), output_line("b"), output_line("a")],
        "line 3 repeats the id of its line 1",
    ),
    "an unfinished last line not begun as run-batch's": (
        [output_line("a"), b"keep me"],
        "line 2 has no newline and does not begin as a run-batch line does",
    ),
}


@pytest.mark.parametrize("case", list(CORRUPT))
def test_an_output_that_is_not_this_inputs_is_refused_before_it_is_appended_to(env, source, tmp_path, case):
    pieces, why = CORRUPT[case]
    out = tmp_path / "out.jsonl"
    out.write_bytes(b"".join(pieces))
    line = assert_refused(run_batch(env, "-i", str(source), "-o", str(out)))
    assert (
        line == f"run-batch: -o {out} is not a run-batch output of {source}: its {why}; it was left as it is"
    )
    assert out.read_bytes() == b"".join(pieces)


def test_check_reads_a_valid_output_and_writes_nothing(env, source, tmp_path):
    out = tmp_path / "out.jsonl"
    half_written = output_line("a") + output_line("b")[:30]
    out.write_bytes(half_written)
    result = run_batch(env, "-i", str(source), "-o", str(out), "--check")
    assert result.returncode == 0, result.stderr
    assert f"run-batch: {source}: 2 lines, 1 already in {out}; the files are fine" in result.stderr
    assert out.read_bytes() == half_written  # the half-written line is cut only by a run that writes
    assert not Path(f"{out}.lock").exists()


def test_a_missing_output_directory_is_refused_before_the_model_loads(env, source, tmp_path):
    out = tmp_path / "no-such-folder" / "out.jsonl"
    assert_refused(
        run_batch(env, "-i", str(source), "-o", str(out)),
        f"-o {out}: the directory {out.parent} does not exist",
    )


def test_an_unwritable_output_directory_is_refused_before_the_model_loads(env, source, tmp_path):
    if os.geteuid() == 0:  # root writes through a mode; /proc takes no new file from anyone
        out, why = Path("/proc/semif-batch-results.jsonl"), "the directory /proc does not take new files"
    else:
        folder = tmp_path / "read-only"
        folder.mkdir(mode=0o555)
        out, why = folder / "out.jsonl", f"the directory {folder} is not writable"
    assert_refused(run_batch(env, "-i", str(source), "-o", str(out)), f"-o {out}: {why}")
    assert not out.exists()


@pytest.mark.parametrize(
    ("name", "why"),
    [("missing.jsonl", "no such file"), ("folder", "is a directory"), ("/dev/zero", "is a character device")],
)
def test_an_input_that_cannot_be_read_twice_as_a_file_is_refused(env, tmp_path, name, why):
    (tmp_path / "folder").mkdir()
    given = name if name.startswith("/") else str(tmp_path / name)
    out = tmp_path / "out.jsonl"
    assert_refused(run_batch(env, "-i", given, "-o", str(out)), f"-i {given}", why)
    assert not out.exists()


def test_a_second_run_on_a_locked_output_is_refused_naming_the_first(env, source, tmp_path):
    out = tmp_path / "out.jsonl"
    with OutputLock(out, str(out)):
        assert (tmp_path / "out.jsonl.lock").read_text() == f"run-batch pid {os.getpid()}\n"
        assert_refused(
            run_batch(env, "-i", str(source), "-o", str(out), "--check"),
            f"-o {out} is being written by another run-batch (pid {os.getpid()}, lock {out}.lock)",
        )
    assert not (tmp_path / "out.jsonl.lock").exists()
    assert run_batch(env, "-i", str(source), "-o", str(out), "--check").returncode == 0


def test_a_lock_left_by_a_killed_run_is_taken_over(env, source, tmp_path):
    out = tmp_path / "out.jsonl"
    Path(f"{out}.lock").write_text("run-batch pid 999999\n")  # no process holds its flock
    result = run_batch(env, "-i", str(source), "-o", str(out), "--check")
    assert result.returncode == 0, result.stderr
    assert not Path(f"{out}.lock").exists()


def test_a_symlink_planted_at_the_lock_is_refused_and_its_target_untouched(env, source, tmp_path):
    out, victim = tmp_path / "out.jsonl", tmp_path / "precious.txt"
    victim.write_text("precious\n")
    Path(f"{out}.lock").symlink_to(victim)
    assert_refused(
        run_batch(env, "-i", str(source), "-o", str(out)), f"its lock file {out}.lock is a symlink"
    )
    assert victim.read_text() == "precious\n"


def test_a_users_file_at_the_lock_path_is_refused_and_kept(env, source, tmp_path):
    out = tmp_path / "out.jsonl"
    Path(f"{out}.lock").write_text("my own notes\n")
    assert_refused(
        run_batch(env, "-i", str(source), "-o", str(out)), f"{out}.lock exists and is not a run-batch lock"
    )
    assert Path(f"{out}.lock").read_text() == "my own notes\n"


def test_ray_missing_is_one_line_saying_how_to_install_it(env, source, tmp_path):
    out = tmp_path / "out.jsonl"
    script = (
        "import sys; sys.modules['ray'] = None\n"  # `import ray` fails as where it is not installed
        "from semif_serve.tools.cli import main\n"
        f"raise SystemExit(main(['run-batch', '-i', {str(source)!r}, '-o', {str(out)!r}, '--ray']))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    line = assert_refused(result, "pip install 'semif-serve[ray]'")
    assert line == "run-batch: --ray needs Ray, which is not installed here: pip install 'semif-serve[ray]'"
    assert not out.exists()


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        ((), "the following arguments are required: -o/--output"),
        (("-o", "out.jsonl", "--ray-gpus", "-1"), "argument --ray-gpus: -1 is not a number of at least 0"),
        (("-o", "out.jsonl", "--window", "0"), "argument --window: 0 is not at least 1"),
    ],
)
def test_a_refused_flag_is_one_line(env, source, flags, why):
    line = assert_refused(run_batch(env, "-i", str(source), *flags, cwd=source.parent))
    assert line == f"semif-serve run-batch: {why} (--help lists the flags)"
    assert not (source.parent / "out.jsonl").exists()


def test_a_ray_address_ray_cannot_read_is_one_line(env, source, tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "out.jsonl"
    result = run_batch(env, "-i", str(source), "-o", str(out), "--ray", "--ray-address", "not-an-address")
    line = assert_refused(result)
    joined = "run-batch: --ray: cannot join the Ray at not-an-address"
    assert line == f"{joined}: ValueError: Invalid address format: not-an-address"
    assert not out.exists() and not Path(f"{out}.lock").exists()
