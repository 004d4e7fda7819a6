"""The model directory checks: check-model finds what is missing; the manifest pins every file's bytes."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from semif_serve.domain.types import ConfigurationError
from semif_serve.engine.checkpoint_files import (
    CheckpointFilesError,
    check_checkpoint,
    render_manifest,
    verify_checkpoint,
)
from semif_serve.tools.cli import main
from tests.support import TOKEN


@pytest.fixture
def copy(checkpoint, tmp_path) -> Path:
    """A private copy of the session's demo checkpoint, free to break."""
    return Path(shutil.copytree(checkpoint, tmp_path / "model"))


def sharded(directory: Path) -> Path:
    """Split the single model.safetensors into two shards plus an index, as the real checkpoint is."""
    tensors = load_file(str(directory / "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, members in halves.items():
        save_file({n: tensors[n] for n in members}, str(directory / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(members, shard))
    (directory / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_complete_checkpoint_reports_the_tensor_count_safetensors_itself_reads(copy):
    report = check_checkpoint(copy)
    with safe_open(str(copy / "model.safetensors"), "pt") as fh:
        expected = len(list(fh.keys()))
    assert report.tensors == expected > 0
    assert report.bytes == (copy / "model.safetensors").stat().st_size
    assert report.model_type == json.loads((copy / "config.json").read_text())["model_type"]
    assert "tokenizer.json" in report.tokenizer


def test_a_sharded_checkpoint_checks_every_shard_its_index_names(copy):
    report = check_checkpoint(sharded(copy))
    assert [s.name for s in report.shards] == sorted(p.name for p in copy.glob("model-*.safetensors"))
    assert report.tensors == len(
        json.loads((copy / "model.safetensors.index.json").read_text())["weight_map"]
    )


def test_a_missing_shard_config_and_tokenizer_are_all_named_in_one_refusal(copy):
    sharded(copy)
    (copy / "model-00002-of-00002.safetensors").unlink()
    (copy / "config.json").unlink()
    (copy / "tokenizer.json").unlink()
    with pytest.raises(CheckpointFilesError) as refusal:
        check_checkpoint(copy)
    message = str(refusal.value)
    for name in ("model-00002-of-00002.safetensors: missing", "config.json: missing", "tokenizer.json"):
        assert name in message
    assert "3 problems" in message


def test_a_truncated_shard_is_refused_as_a_partial_download(copy):
    path = copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointFilesError, match=r"model\.safetensors: holds .* partial download"):
        check_checkpoint(copy)


def test_a_shard_without_a_tensor_its_index_places_there_is_refused(copy):
    sharded(copy)
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.extra.weight"] = "model-00001-of-00002.safetensors"
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointFilesError, match="lacks 1 tensors.*model.extra.weight"):
        check_checkpoint(copy)


def test_a_garbage_shard_header_is_refused_naming_the_file(copy):
    (copy / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CheckpointFilesError, match=r"model\.safetensors: the header is not JSON"):
        check_checkpoint(copy)


def test_the_manifest_is_what_sha256_computes_for_every_file(copy, tmp_path):
    manifest = render_manifest(copy)
    lines = dict(reversed(line.split("  ", 1)) for line in manifest.splitlines())
    assert sorted(lines) == sorted(p.name for p in copy.iterdir())
    for name, digest in lines.items():
        assert digest == hashlib.sha256((copy / name).read_bytes()).hexdigest(), name
    if shutil.which("sha256sum"):
        (tmp_path / "weights.sha256").write_text(manifest)
        check = subprocess.run(["sha256sum", "--strict", "-c", str(tmp_path / "weights.sha256")], cwd=copy)
        assert check.returncode == 0


def test_a_manifest_of_the_checkpoint_verifies(copy, tmp_path):
    path = tmp_path / "weights.sha256"
    path.write_text(render_manifest(copy))
    verification = verify_checkpoint(copy, path)
    assert verification.verified and verification.files == len(list(copy.iterdir()))
    assert verification.health() == {
        "verified": True,
        "manifest": str(path),
        "files": verification.files,
        "seconds": round(verification.seconds, 3),
    }


def test_no_manifest_means_not_verified():
    verification = verify_checkpoint(Path("/nonexistent"), None)
    assert (verification.verified, verification.manifest, verification.files) == (False, None, 0)


def test_one_altered_byte_of_a_weight_file_fails_naming_it(copy, tmp_path):
    path = tmp_path / "weights.sha256"
    path.write_text(render_manifest(copy))
    flip_last_byte(copy / "model.safetensors")
    with pytest.raises(CheckpointFilesError) as refusal:
        verify_checkpoint(copy, path)
    assert "model.safetensors: SHA-256" in str(refusal.value)
    assert "config.json" not in str(refusal.value)


def test_a_missing_file_and_an_unlisted_file_both_fail(copy, tmp_path):
    path = tmp_path / "weights.sha256"
    path.write_text(render_manifest(copy))
    (copy / "tokenizer.json").unlink()
    (copy / "extra.safetensors").write_bytes(b"x")
    with pytest.raises(CheckpointFilesError) as refusal:
        verify_checkpoint(copy, path)
    assert "tokenizer.json: missing" in str(refusal.value)
    assert "extra.safetensors: not in the manifest" in str(refusal.value)


def test_hidden_download_bookkeeping_and_the_manifest_itself_are_not_listed(copy):
    (copy / ".cache" / "huggingface").mkdir(parents=True)
    (copy / ".cache" / "huggingface" / "model.safetensors.metadata").write_text("etag")
    inside = copy / "weights.sha256"
    inside.write_text(render_manifest(copy, exclude=inside))
    assert ".cache" not in inside.read_text() and "weights.sha256" not in inside.read_text()
    assert verify_checkpoint(copy, inside).verified


@pytest.mark.parametrize(
    "text,rule",
    [
        ("not a manifest\n", "line 1 is not"),
        (f"{'0' * 64}  ../etc/passwd\n", "not a path inside"),
        (f"{'0' * 64}  a\n{'1' * 64}  a\n", "listed twice"),
        ("\n", "lists no files"),
    ],
)
def test_a_malformed_manifest_is_a_configuration_error_naming_the_variable(copy, tmp_path, text, rule):
    path = tmp_path / "weights.sha256"
    path.write_text(text)
    with pytest.raises(ConfigurationError, match=f"SEMIF_MODEL_MANIFEST.*{rule}"):
        verify_checkpoint(copy, path)


def test_the_manifest_command_writes_a_file_check_model_accepts(copy, tmp_path, capsys):
    target = tmp_path / "weights.sha256"
    assert main(["manifest", str(copy), "--write", str(target)]) == 0
    assert target.read_text() == render_manifest(copy)
    assert main(["check-model", str(copy), "--manifest", str(target)]) == 0
    assert "files match" in capsys.readouterr().out
    flip_last_byte(copy / "model.safetensors")
    assert main(["check-model", str(copy), "--manifest", str(target)]) == 1
    assert "model.safetensors: SHA-256" in capsys.readouterr().err


def test_check_model_exits_1_on_an_incomplete_directory(copy, capsys):
    (copy / "model.safetensors").unlink()
    assert main(["check-model", str(copy)]) == 1
    assert "model.safetensors is there" in capsys.readouterr().err


def test_startup_with_altered_weights_exits_3_naming_the_file_before_the_engine_loads(copy, tmp_path):
    manifest = tmp_path / "weights.sha256"
    manifest.write_text(render_manifest(copy))
    flip_last_byte(copy / "model.safetensors")
    env = {
        "SEMIF_MODEL_PATH": str(copy),
        "SEMIF_MODEL_REVISION": "demo-random-weights-v1",
        "SEMIF_MODEL_MANIFEST": str(manifest),
        "SEMIF_DEVICE": "cpu",
        "SEMIF_API_TOKEN": TOKEN,
        "PATH": "/usr/bin:/bin",
    }
    result = subprocess.run(
        [sys.executable, "-m", "semif_serve.tools.cli"], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 3, result.stderr
    assert "model.safetensors: SHA-256" in result.stderr
    assert "warm" not in result.stderr.lower()
    assert TOKEN not in result.stderr
