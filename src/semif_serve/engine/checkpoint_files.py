"""The model directory's files: is it complete (`check-model`), and is it the pinned content (`manifest`).

A directory is complete when `config.json` parses, a tokenizer is there, and every safetensors
file the index names (or the single `model.safetensors`) has a header that parses and tensor data
that exactly fills the file. It holds the pinned content when every file's SHA-256 equals the
manifest's line for it, in `sha256sum`'s format, so `sha256sum -c` can check the same file.
Nothing here imports torch: it runs before the weights load.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from semif_serve.domain.types import ConfigurationError
from semif_serve.engine.loader import CheckpointError

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_CONFIG = "tokenizer_config.json"
# A fast tokenizer, or the BPE vocabulary and merges it can be built from.
TOKENIZER_VOCABULARIES = (("tokenizer.json",), ("vocab.json", "merges.txt"))
# safetensors refuses headers past 100 MB; a larger length means a corrupt or foreign file.
MAX_HEADER_BYTES = 100_000_000
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
MANIFEST_LINE = re.compile(r"^(?P<digest>[0-9a-fA-F]{64}) [ *](?P<name>.+)$")
HASH_CHUNK_BYTES = 8 * 1024 * 1024


class CheckpointFilesError(CheckpointError):
    """The model directory is incomplete, unreadable or differs from its manifest; names each file."""


@dataclass(frozen=True)
class Shard:
    """One safetensors file whose header parsed and whose data fills the file exactly."""

    name: str
    tensors: int
    bytes: int


@dataclass(frozen=True)
class CheckpointReport:
    """What `check_checkpoint` found in a complete directory."""

    directory: Path
    model_type: str
    tokenizer: tuple[str, ...]
    shards: tuple[Shard, ...]

    @property
    def tensors(self) -> int:
        """Tensors over every shard."""
        return sum(shard.tensors for shard in self.shards)

    @property
    def bytes(self) -> int:
        """Bytes of every shard."""
        return sum(shard.bytes for shard in self.shards)


@dataclass(frozen=True)
class Verification:
    """The outcome of checking the model directory against SEMIF_MODEL_MANIFEST at startup."""

    verified: bool
    manifest: Path | None
    files: int
    seconds: float

    def health(self) -> dict:
        """The `weights` block of /health."""
        return {
            "verified": self.verified,
            "manifest": str(self.manifest) if self.manifest is not None else None,
            "files": self.files,
            "seconds": round(self.seconds, 3),
        }


def read_safetensors_header(path: Path) -> tuple[dict[str, dict], int]:
    """The tensor entries of a safetensors file's JSON header (metadata dropped) and the header's length."""
    try:
        with path.open("rb") as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise CheckpointFilesError(f"{path.name}: shorter than a safetensors header")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES:
                raise CheckpointFilesError(f"{path.name}: header length {length} is not a safetensors file's")
            raw = fh.read(length)
    except OSError as exc:
        raise CheckpointFilesError(
            f"{path.name}: cannot read ({exc.strerror or type(exc).__name__})"
        ) from None
    if len(raw) < length:
        raise CheckpointFilesError(f"{path.name}: truncated inside its header")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointFilesError(f"{path.name}: the header is not JSON") from None
    if not isinstance(header, dict):
        raise CheckpointFilesError(f"{path.name}: the header is not a JSON object")
    header.pop("__metadata__", None)
    return header, length


def check_shard(path: Path, required: Sequence[str] = ()) -> Shard:
    """Check that a safetensors file's tensors exactly fill the bytes after the header and hold `required`."""
    header, length = read_safetensors_header(path)
    data_start = 8 + length
    spans = []
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            expected = math.prod(shape) * DTYPE_BYTES[dtype]
        except (KeyError, TypeError, ValueError):
            raise CheckpointFilesError(f"{path.name}: tensor {name!r} has a malformed header entry") from None
        if end - begin != expected:
            raise CheckpointFilesError(
                f"{path.name}: tensor {name!r} spans {end - begin} bytes, not {expected}"
            )
        spans.append((begin, end))
    covered = 0
    for begin, end in sorted(spans):
        if begin != covered:
            raise CheckpointFilesError(f"{path.name}: tensor data has a gap or overlap at byte {begin}")
        covered = end
    size = path.stat().st_size
    if data_start + covered != size:
        raise CheckpointFilesError(
            f"{path.name}: holds {size} bytes but its header describes {data_start + covered} "
            "(a partial download?)"
        )
    absent = set(required) - set(header)
    if absent:
        raise CheckpointFilesError(
            f"{path.name}: lacks {len(absent)} tensors the index places there (e.g. {min(absent)!r})"
        )
    return Shard(path.name, len(header), size)


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointFilesError(f"{path.name}: missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointFilesError(f"{path.name}: not readable JSON ({type(exc).__name__})") from None


def _shard_names(directory: Path) -> tuple[list[str], dict[str, list[str]]]:
    """The shards to check and, from the index, the tensors each must hold."""
    if (directory / INDEX_FILE).exists():
        index = _read_json(directory / INDEX_FILE)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointFilesError(f"{INDEX_FILE}: has no weight_map")
        expected: dict[str, list[str]] = {}
        for tensor, shard in weight_map.items():
            expected.setdefault(str(shard), []).append(tensor)
        return sorted(expected), expected
    if (directory / SINGLE_FILE).exists():
        return [SINGLE_FILE], {}
    raise CheckpointFilesError(f"neither {INDEX_FILE} nor {SINGLE_FILE} is there")


def check_checkpoint(directory: Path) -> CheckpointReport:
    """Check that a model directory is complete and readable; raises one error listing every problem."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointFilesError(f"{directory} is not a directory")
    problems: list[str] = []
    model_type = ""
    try:
        config = _read_json(directory / CONFIG_FILE)
        model_type = str(config.get("model_type", "")) if isinstance(config, dict) else ""
        if not model_type:
            problems.append(f"{CONFIG_FILE}: has no model_type")
    except CheckpointFilesError as exc:
        problems.append(str(exc))

    tokenizer: tuple[str, ...] = ()
    if not (directory / TOKENIZER_CONFIG).is_file():
        problems.append(f"{TOKENIZER_CONFIG}: missing")
    vocabulary = next(
        (names for names in TOKENIZER_VOCABULARIES if all((directory / n).is_file() for n in names)), None
    )
    if vocabulary is None:
        problems.append("tokenizer.json (or vocab.json and merges.txt): missing")
    else:
        tokenizer = (*vocabulary, TOKENIZER_CONFIG)

    shards: list[Shard] = []
    try:
        names, expected = _shard_names(directory)
    except CheckpointFilesError as exc:
        problems.append(str(exc))
        names, expected = [], {}
    for name in names:
        path = directory / name
        if not path.is_file():
            problems.append(f"{name}: missing")
            continue
        try:
            shards.append(check_shard(path, expected.get(name, ())))
        except CheckpointFilesError as exc:
            problems.append(str(exc))
    if problems:
        raise CheckpointFilesError(
            f"{directory} is incomplete ({len(problems)} problems): " + "; ".join(problems)
        )
    return CheckpointReport(directory, model_type, tokenizer, tuple(shards))


def checkpoint_files(directory: Path, exclude: Path | None = None) -> list[str]:
    """Every regular file under the directory (links followed, hidden paths skipped), sorted posix paths."""
    directory = Path(directory)
    skip = exclude.resolve() if exclude is not None else None
    found = []
    for path in directory.rglob("*"):
        relative = path.relative_to(directory)
        if any(part.startswith(".") for part in relative.parts) or not path.is_file():
            continue
        if skip is not None and path.resolve() == skip:
            continue
        found.append(relative.as_posix())
    return sorted(found)


def file_sha256(path: Path) -> str:
    """The hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        while chunk := fh.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def render_manifest(directory: Path, exclude: Path | None = None) -> str:
    """The manifest of a directory: one `<sha256>  <path>` line per file (`sha256sum` format)."""
    directory = Path(directory)
    lines = [f"{file_sha256(directory / name)}  {name}" for name in checkpoint_files(directory, exclude)]
    if not lines:
        raise CheckpointFilesError(f"{directory} holds no files")
    return "\n".join(lines) + "\n"


def read_manifest(path: Path) -> dict[str, str]:
    """The manifest's {relative path: digest}; raises ConfigurationError naming the line."""
    where = f"SEMIF_MODEL_MANIFEST: {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"{where}: cannot read ({type(exc).__name__})") from None
    entries: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        match = MANIFEST_LINE.match(line)
        if match is None:
            raise ConfigurationError(f"{where}: line {number} is not `<sha256>  <path>`")
        name = match["name"]
        parts = PurePosixPath(name).parts
        if name.startswith("/") or ".." in parts or not parts:
            raise ConfigurationError(f"{where}: line {number}: {name!r} is not a path inside the directory")
        if name in entries:
            raise ConfigurationError(f"{where}: line {number}: {name!r} is listed twice")
        entries[name] = match["digest"].lower()
    if not entries:
        raise ConfigurationError(f"{where}: lists no files")
    return entries


def verify_checkpoint(directory: Path, manifest_path: Path | None) -> Verification:
    """Check every file of the directory against the manifest; raises CheckpointFilesError on any difference.

    Without a manifest nothing is checked and the result says `verified: False`. A file that is
    missing, altered, or present but not listed fails, each named in the message.
    """
    if manifest_path is None:
        return Verification(verified=False, manifest=None, files=0, seconds=0.0)
    started = time.perf_counter()
    expected = read_manifest(manifest_path)
    directory = Path(directory)
    present = set(checkpoint_files(directory, exclude=Path(manifest_path)))
    problems = [f"{name}: missing" for name in sorted(set(expected) - present)]
    problems += [f"{name}: not in the manifest" for name in sorted(present - set(expected))]
    for name in sorted(present & set(expected)):
        try:
            found = file_sha256(directory / name)
        except OSError as exc:
            problems.append(f"{name}: cannot read ({exc.strerror or type(exc).__name__})")
            continue
        if found != expected[name]:
            problems.append(
                f"{name}: SHA-256 {found[:12]}… differs from the manifest's {expected[name][:12]}…"
            )
    if problems:
        raise CheckpointFilesError(
            f"the model directory {directory} differs from the manifest {manifest_path}: "
            + "; ".join(problems)
        )
    return Verification(
        verified=True,
        manifest=Path(manifest_path),
        files=len(expected),
        seconds=time.perf_counter() - started,
    )
