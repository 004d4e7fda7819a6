"""What run-batch may touch, checked before anything is written: the input is a regular file
(or stdin), the output is a regular file that is not the input (by inode, symlinks followed) or
a new file in a writable directory, and one run at a time writes an output (`<output>.lock`).

Every refusal is a `BatchRefused`: one line naming the file and why (the command exits 2).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
from pathlib import Path

STDIO = "-"
LOCK_SUFFIX = ".lock"
_LOCK_TEXT = re.compile(rb"run-batch pid (\d+)\n")
_LOCK_TRIES = 20


class BatchRefused(Exception):
    """A file, flag or environment refused before any work: one line saying which and why."""


def _kind(mode: int) -> str:
    """What a file that is not a regular file is, in words."""
    for test, words in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a pipe"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return words
    return "not a regular file"


def checked_input(name: str) -> os.stat_result | None:
    """The input's identity (None for stdin that is not a regular file); BatchRefused when it
    cannot be read twice as a file (the custom_id check, then the scoring)."""
    if name == STDIO:
        try:
            status = os.fstat(0)
        except OSError:
            return None
        return status if stat.S_ISREG(status.st_mode) else None
    try:
        status = os.stat(name)
    except FileNotFoundError:
        raise BatchRefused(f"-i {name}: no such file") from None
    except OSError as exc:
        raise BatchRefused(f"-i {name}: {exc.strerror}") from None
    if stat.S_ISDIR(status.st_mode):
        raise BatchRefused(f"-i {name} is a directory, not a batch file")
    if not stat.S_ISREG(status.st_mode):
        raise BatchRefused(
            f"-i {name} is {_kind(status.st_mode)}, not a regular file: the input is read twice, "
            "so pipe it in with -i - (it is spooled to a temporary file)"
        )
    if not os.access(name, os.R_OK):
        raise BatchRefused(f"-i {name} is not readable")
    return status


def checked_output(name: str, input_name: str, source: os.stat_result | None) -> Path:
    """The output's real path (symlinks followed), once it is known to be a regular file that is
    not the input, or a new file in a directory that exists and takes new files."""
    real = Path(os.path.realpath(name))
    try:
        status: os.stat_result | None = os.stat(real)
    except FileNotFoundError:
        status = None
    except OSError as exc:
        raise BatchRefused(f"-o {name}: {exc.strerror}") from None
    if status is not None:
        if stat.S_ISDIR(status.st_mode):
            raise BatchRefused(f"-o {name} is a directory: name a file for the results")
        if not stat.S_ISREG(status.st_mode):
            raise BatchRefused(
                f"-o {name} is {_kind(status.st_mode)}, not a regular file: run-batch writes (and "
                "resumes) a file of its own; -o - writes to stdout"
            )
        if source is not None and (status.st_dev, status.st_ino) == (source.st_dev, source.st_ino):
            shown = "stdin" if input_name == STDIO else f"the input {input_name}"
            raise BatchRefused(f"-o {name} is {shown} (the same file): refusing to write over the input")
        if not os.access(real, os.R_OK | os.W_OK):
            raise BatchRefused(f"-o {name} is not readable and writable (a run continues from what it holds)")
    directory = real.parent
    if not directory.is_dir():
        raise BatchRefused(f"-o {name}: the directory {directory} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise BatchRefused(f"-o {name}: the directory {directory} is not writable")
    return real


class OutputLock:
    """`<output>.lock`, held (flock) while a run checks and writes the output: a second run on the
    same output is refused, naming the first's pid. The file is removed when the run ends; one
    left by a killed run is taken over (no process holds its lock)."""

    def __init__(self, output: Path, shown: str) -> None:
        self.path = output.with_name(output.name + LOCK_SUFFIX)
        self.shown = shown
        self.fd: int | None = None

    def __enter__(self) -> OutputLock:
        for _ in range(_LOCK_TRIES):
            fd = self._open()
            try:
                if self._locked(fd):
                    self.fd = fd
                    return self
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # its holder removed it meanwhile: lock the new one
        raise BatchRefused(f"-o {self.shown}: the lock file {self.path} keeps changing; try again")

    def _open(self) -> int:
        try:
            # O_NOFOLLOW: a symlink planted at the lock's name is never followed (and written).
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise BatchRefused(f"-o {self.shown}: its lock file {self.path} is a symlink") from None
            raise BatchRefused(
                f"-o {self.shown}: the directory {self.path.parent} does not take new files "
                f"({exc.strerror}: {self.path})"
            ) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise BatchRefused(f"-o {self.shown}: its lock file {self.path} is not a regular file")
        return fd

    def _locked(self, fd: int) -> bool:
        """Whether `fd` is locked and still the file at the lock's path (then it names this run)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _LOCK_TEXT.fullmatch(os.pread(fd, 64, 0))
            who = f"pid {int(holder.group(1))}" if holder else "a process"
            raise BatchRefused(
                f"-o {self.shown} is being written by another run-batch ({who}, lock {self.path}); "
                "one run at a time writes an output"
            ) from None
        try:
            current = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if (current.st_dev, current.st_ino) != (os.fstat(fd).st_dev, os.fstat(fd).st_ino):
            return False
        held = os.pread(fd, 64, 0)
        if held and not _LOCK_TEXT.fullmatch(held):
            raise BatchRefused(f"-o {self.shown}: {self.path} exists and is not a run-batch lock file")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"run-batch pid {os.getpid()}\n".encode(), 0)
        return True

    def __exit__(self, *exc: object) -> None:
        if self.fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # removed while held: a waiting run then locks a new file
        os.close(self.fd)
        self.fd = None
