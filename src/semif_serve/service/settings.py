"""Service configuration: every `SEMIF_*` environment variable, validated before the weights load."""

from __future__ import annotations

from datetime import date
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from semif_serve.domain.orderings import orderings_policy, parse_type_map
from semif_serve.domain.types import ConfigurationError, DirectPath
from semif_serve.engine.batching import FORWARD_TOKENS, GATHER_SECONDS
from semif_serve.engine.lanes import MOST_LANES
from semif_serve.engine.lone import KEEP_STATE_TOKENS

ENV_PREFIX = "SEMIF_"
# Averaging every type over a few orders (see contract.md, System One, for the measured cost).
DEFAULT_SYSTEMONE_ORDERINGS = "noul=rotations,choice=shifts,score=reversal"


def validate_token_text(token: str) -> str:
    """A bearer token must be non-empty visible ASCII (0x21..0x7E)."""
    if not token:
        raise ValueError("the API token is empty")
    if any(not (0x21 <= ord(ch) <= 0x7E) for ch in token):
        raise ValueError("the API token must be visible ASCII (no spaces, controls or non-ASCII)")
    return token


class Settings(BaseSettings):
    """Configuration of one semif-serve process (environment variables `SEMIF_<FIELD>`)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", hide_input_in_errors=True)

    model_path: Path | None = Field(None, description="Local model directory (read-only mount).")
    model_revision: str = Field("", description="Revision string of the checkpoint (required).")
    model_manifest: Path | None = Field(
        None,
        description="SHA-256 manifest of the model directory (semif-serve manifest); startup verifies it.",
    )
    model_source: str = Field("Qwen/Qwen3.5-4B", description="Model id reported in results.")
    models: Path | None = Field(
        None,
        description="TOML file of the models served over the base (lev releases, PEFT adapters) and aliases.",
    )
    methods: Annotated[list[str], NoDecode] = Field(
        "",  # parsed once, by the validator below
        validate_default=True,
        description="Decision methods to serve besides SemIf's and lev's: module:Class, comma-separated "
        "(docs/architecture.md, where to add a method); SEMIF_MODELS' `method` names them.",
    )
    allow_any_architecture: bool = Field(
        False, description="Serve a checkpoint whose model_type is not a Qwen3.5 text model."
    )
    device: Literal["cuda", "cpu"] = Field("cuda", description="cuda (one visible GPU) or cpu.")
    cpu_kernels: bool = Field(
        True,
        description="On the CPU, run linear attention on the engine's own kernels (false: transformers').",
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="On the CPU, pin the intra-op threads of every forward (unset: chosen per forward from "
        "its size and the free cores, unless OMP_NUM_THREADS or MKL_NUM_THREADS pins them).",
    )
    forward_lanes: int = Field(
        MOST_LANES,
        ge=1,
        description="On the CPU, run a packed forward's independent sequences (or a lone long sequence's "
        "head and tail) as up to this many forwards at once, each on one of the forward's threads, where "
        "that pays (1: never; docs/packing.md).",
    )
    dtype: Literal["bfloat16", "float32"] | None = Field(
        None, description="Weights dtype; default bfloat16 on cuda, float32 on cpu."
    )
    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(8032, ge=1, le=65535, description="Port to bind.")
    api_token: SecretStr | None = Field(None, description="Bearer token for POSTs.")
    api_token_file: Path | None = Field(None, description="File holding the bearer token.")
    max_rows: int = Field(64, ge=1, description="Rows (decisions x orderings) per request.")
    max_input_tokens: int = Field(4096, ge=1, description="Prompt tokens per row.")
    max_queue: int = Field(32, ge=1, description="POST requests in progress before 429 busy.")
    max_body_bytes: int = Field(1_048_576, ge=1, description="Request body limit in bytes.")
    max_reply_bytes: int = Field(
        12_582_912,
        ge=1,
        description="Reply size limit in bytes, counted before any engine work (both doors).",
    )
    calibrate_max_logits: int = Field(
        10_000, ge=2, description="POST /calibrate: logits (rows x options) per request (bounds the fit)."
    )
    vram_cap_gib: float = Field(12.0, gt=0, description="Hard GPU memory cap in GiB (cuda).")
    release_margin_mib: int = Field(
        512, ge=0, description="Release cached memory when reserved exceeds baseline by this."
    )
    split_batches: bool = Field(
        True, description="Split shared batches that the memory estimate says would not fit the cap."
    )
    state_cache_mib: int = Field(
        1024,
        ge=0,
        description="Prefilled states kept for reuse, in MiB (0: off); part of the cap and the baseline.",
    )
    prefill_chunk_tokens: int = Field(
        2048,
        ge=1,
        description="Tokens per prefill forward and suffix columns per suffix forward (bounds activations).",
    )
    direct_path: DirectPath = Field(
        "reuse",
        description="A question asked once: reuse (from a cached state; a state of at least "
        "keep_state_tokens kept by the question's own pass, a shorter one read by the plain forward) "
        "or plain (always SemIf's plain forward, for parity runs).",
    )
    keep_state_tokens: int = Field(
        KEEP_STATE_TOKENS,
        ge=1,
        description="The shortest state a question asked once keeps for its follow-ups (its pass ends "
        "at the state, stores it and goes on to the question); shorter ones run the plain forward.",
    )
    max_batch_rows: int = Field(64, ge=1, description="Rows of merged requests per forward.")
    max_batch_tokens: int = Field(
        16_384,
        ge=1,
        description="Padded tokens (rows x widest suffix) of merged requests per forward; the prefilled "
        "state is not charged.",
    )
    max_forward_tokens: int = Field(
        FORWARD_TOKENS,
        ge=1,
        description="Tokens one packed forward computes across requests (new states' and rows'); "
        "the first request of a turn always runs (vLLM's max_num_batched_tokens).",
    )
    max_gather_seconds: float = Field(
        GATHER_SECONDS,
        ge=0,
        le=1,
        description="The longest the engine waits, after a forward while other work waits, for the "
        "next requests of the clients it just answered (never over a quarter of that forward; 0: never).",
    )
    calibration: Path | None = Field(None, description="calibration.json: workload temperatures.")
    metrics_public: bool = Field(True, description="Serve /metrics without the token.")
    body_timeout_seconds: float = Field(
        10.0, gt=0, description="How long a POST body may take to arrive before 408 frees its slot."
    )
    header_timeout_seconds: float = Field(
        10.0,
        gt=0,
        description="How long request headers may take to arrive before 408 closes the connection.",
    )
    shutdown_grace_seconds: float = Field(
        30.0, gt=0, description="How long SIGTERM waits for in-flight requests."
    )
    demo: bool = Field(False, description="Mark results as coming from random demo weights.")
    model_release_date: date | None = Field(
        None,
        description="Release date /v1/models reports (YYYY-MM-DD); default: the day config.json was written.",
    )
    systemone_max_input_tokens: int = Field(
        32768, ge=1, description="System One: prompt tokens per row (state + the longest question)."
    )
    systemone_max_request_tokens: int = Field(
        65536,
        ge=1,
        description="System One: tokens per request (the state once, plus every row's tokens after it).",
    )
    systemone_max_rows: int = Field(
        256, ge=1, description="System One: rows (questions x orderings) per request."
    )
    systemone_orderings: Annotated[dict[str, str], NoDecode] = Field(
        DEFAULT_SYSTEMONE_ORDERINGS,  # parsed once, by the validator below
        validate_default=True,
        description="System One: orderings per answer type (`none`, or e.g. noul=rotations,choice=shifts).",
    )
    systemone_workloads: Annotated[dict[str, str], NoDecode] = Field(
        "",  # parsed once, by the validator below
        validate_default=True,
        description="System One: calibration workload per answer type (e.g. choice=authored144).",
    )
    systemone_max_images: int = Field(8, ge=1, description="System One: images (assets) per request.")
    systemone_max_image_pixels: int = Field(
        16_777_216, ge=1, description="System One: pixels (width x height, from the header) per image."
    )
    systemone_max_image_bytes: int = Field(
        20_971_520,
        ge=1,
        description="System One: image bytes per request (a multipart body may pass the body limit by this).",
    )
    systemone_allow_aliases: bool = Field(
        True, description="System One: serve the model names Jev clients send (jev-latest, jev-preview)."
    )

    @field_validator("systemone_orderings", mode="before")
    @classmethod
    def _orderings_policy(cls, value: Any) -> Any:
        return orderings_policy(value) if isinstance(value, str) else value

    @field_validator("systemone_workloads", mode="before")
    @classmethod
    def _workload_map(cls, value: Any) -> Any:
        return parse_type_map(value) if isinstance(value, str) else value

    @field_validator("methods", mode="before")
    @classmethod
    def _method_paths(cls, value: Any) -> Any:
        return (
            [part.strip() for part in value.split(",") if part.strip()] if isinstance(value, str) else value
        )

    @field_validator("model_revision")
    @classmethod
    def _revision_is_stripped(cls, value: str) -> str:
        return value.strip()

    @model_validator(mode="after")
    def _coherent(self) -> Settings:
        if self.dtype is None:
            self.dtype = "bfloat16" if self.device == "cuda" else "float32"
        if self.api_token is not None and self.api_token_file is not None:
            raise ValueError("set SEMIF_API_TOKEN or SEMIF_API_TOKEN_FILE, not both")
        return self

    def token(self) -> str:
        """The bearer token, from the variable or the file; raises ConfigurationError."""
        if self.api_token is not None:
            raw = self.api_token.get_secret_value()
            where = "SEMIF_API_TOKEN"
        elif self.api_token_file is not None:
            try:
                raw = self.api_token_file.read_text(encoding="utf-8").rstrip("\r\n")
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigurationError(
                    f"SEMIF_API_TOKEN_FILE: cannot read {self.api_token_file}: {type(exc).__name__}"
                ) from None
            where = "SEMIF_API_TOKEN_FILE"
        else:
            raise ConfigurationError("SEMIF_API_TOKEN or SEMIF_API_TOKEN_FILE must be set")
        try:
            return validate_token_text(raw)
        except ValueError as exc:
            raise ConfigurationError(f"{where}: {exc}") from None

    def require_model(self) -> Path:
        """The model directory, which must exist, with a revision string."""
        if self.model_path is None:
            raise ConfigurationError("SEMIF_MODEL_PATH must be set to a local model directory")
        if not self.model_path.is_dir():
            raise ConfigurationError(f"SEMIF_MODEL_PATH: {self.model_path} is not a directory")
        if not self.model_revision:
            raise ConfigurationError("SEMIF_MODEL_REVISION must name the checkpoint's revision")
        return self.model_path


def env_name(field: str) -> str:
    """The environment variable that sets a settings field."""
    return ENV_PREFIX + field.upper()


def load_settings(**overrides: Any) -> Settings:
    """Read the environment (plus overrides), raising ConfigurationError naming the variable."""
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        problems = []
        for err in exc.errors(include_input=False, include_url=False):
            loc = ".".join(str(part) for part in err["loc"])
            name = env_name(loc) if loc else "configuration"
            problems.append(f"{name}: {err['msg']}")
        raise ConfigurationError("; ".join(problems)) from None
