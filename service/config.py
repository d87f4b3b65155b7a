"""One settings object, read from ``RNNSERVE_*`` environment variables and ``rnnserve`` flags."""

from __future__ import annotations

import difflib
import importlib.metadata
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from rnnserve.options import GemmRoutes, RolloutBackend

ENV_PREFIX = "RNNSERVE_"


def package_version() -> str:
    """The installed rnnserve's version (``rnnserve --version``, the OpenAPI description)."""
    try:
        return importlib.metadata.version("rnnserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree never installed
        return "0+unknown"


# the token the deployment files ship with (deploy/k8s/base/kustomization.yaml): a server given
# it was deployed without its own token, which anyone who has read this repository knows
PLACEHOLDER_TOKEN_PREFIX = "REPLACE-ME"


def _check_token(token: str, what: str) -> None:
    if not token:
        raise ValueError(f"{what} is empty")
    if token.startswith(PLACEHOLDER_TOKEN_PREFIX):
        raise ValueError(
            f"{what} holds the deployment files' placeholder ({PLACEHOLDER_TOKEN_PREFIX}...); "
            "replace it with a token of your own (docs/DEPLOY.md)"
        )


MAX_REQUEST_BYTES = 64 * 1024 * 1024
# a session's frame: a chunk of a stream is steps, rarely over a few hundred KiB; each open
# session may hold one such frame outside max_inflight_bytes (docs/SESSIONS.md#memory)
MAX_CHUNK_BYTES = 4 * 1024 * 1024


class Settings(BaseSettings):
    """Serve recurrent sequence models over HTTP. Every option is also an environment variable
    RNNSERVE_<OPTION> (upper case, underscores); flags win over the environment."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        cli_prog_name="rnnserve",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        # --help: "--model-dir Path", not "{Path,null}"; unset options say what unset means
        cli_hide_none_type=True,
        extra="forbid",
        frozen=True,
        # no setting means anything by infinity (0 says "none" where none is allowed), and
        # an infinite one failed late (drain_timeout_s=inf: after the models had loaded)
        allow_inf_nan=False,
    )

    host: str = Field("127.0.0.1", description="Address to bind; 0.0.0.0 to accept remote clients.")
    port: int = Field(
        8000, ge=0, le=65535, description="TCP port to listen on (0 picks a free one)."
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="Log level of rnnserve and uvicorn."
    )
    log_format: Literal["text", "json"] = Field(
        "text",
        description="text: one line a record for people; json: one JSON object a line (time, "
        "level, logger, message, request_id, traceback) for log collectors.",
    )
    access_log: bool = Field(False, description="Log one line per HTTP request.")
    log_third_party: bool = Field(
        False,
        description="Keep third-party libraries' debug logs (numba, torch...) at --log-level "
        "debug; by default they are held at warning.",
    )
    model_dir: Path | None = Field(
        None, description="Folder of <name>.safetensors models to serve; unset: the bundled ones."
    )
    reload_poll_s: float = Field(
        0.0,
        ge=0,
        description="Look at the model dir every this many seconds and reload it when a file "
        "changed (0: never; SIGHUP and POST /admin/reload reload it too).",
    )
    models_ack_timeout_s: float = Field(
        10.0,
        gt=0,
        description="With --workers N, longest a reload waits for each HTTP worker to "
        "acknowledge the new model list before it lists a new model (a worker that has not "
        "by then is left behind, with a warning).",
    )
    trust_torchscript: bool = Field(
        False,
        description="Serve <name>.torchscript.pt files in the model dir. TorchScript files are "
        "code that runs in the server when loaded: set it only for files you trust; unset, "
        "such a file stops the server at start-up.",
    )
    default_smoother: str | None = Field(
        None,
        description="Model POST /smooth uses when a request names none; unset: the only "
        "smoother served, else the one named smoother.",
    )
    default_traveller: str | None = Field(
        None,
        description="Model POST /rollout uses when a request names none; unset: the only "
        "traveller served, else the one named traveller.",
    )
    device: str = Field("auto", description="torch device: auto (CUDA if present), cpu, cuda:0...")
    torch_threads: int = Field(
        1, ge=1, description="Intra-op threads torch uses in the model worker thread."
    )
    rollout_backend: RolloutBackend = Field(
        "auto",
        description="How the Traveller's rollout loop runs; auto: the fastest for the device.",
    )
    rollout_gemm_routes: GemmRoutes = Field(
        "measured",
        description="How the numba rollout picks each layer's matrix product at each number of "
        "active sequences: measured (the fastest of its routes on this CPU, timed at load; "
        "servers whose timings differ answer with different last bits) or fixed (the same "
        "routes, and bits, in every server of one build on one kind of CPU).",
    )
    rollout_scheduling: Literal["continuous", "batch"] = Field(
        "continuous",
        description="continuous: rollouts join and leave the running batch between chunks of "
        "steps; batch: whole batches run to the end of their longest sequence.",
    )
    rollout_chunk_steps: int = Field(
        64, ge=1, description="Steps a continuous rollout batch runs between joins and leaves."
    )
    max_batch_size: int = Field(64, ge=1, description="Most sequences packed into one batch.")
    max_batch_timesteps: int = Field(
        262_144, ge=1, description="Most timesteps (sum of lengths) in one batch."
    )
    max_delay_ms: float = Field(
        0.0,
        ge=0,
        description="Longest a request waits for others to join its batch; at 0 a batch starts "
        "as soon as the model is free, with the requests that queued while it ran.",
    )
    max_queue_size: int = Field(
        1024, ge=1, description="Requests waiting per model beyond which new ones get 503."
    )
    max_request_bytes: int = Field(
        MAX_REQUEST_BYTES, ge=1, description="Largest request body accepted (413 above)."
    )
    max_request_head_bytes: int = Field(
        64 * 1024,
        ge=1024,
        description="Largest request line and headers accepted, in bytes (431 above, and the "
        "connection closes).",
    )
    max_sequences_per_request: int = Field(
        256, ge=1, description="Most sequences in one request (413 above)."
    )
    max_sequence_length: int = Field(
        100_000, ge=1, description="Most timesteps in one sequence (413 above)."
    )
    max_request_timesteps: int = Field(
        1_000_000, ge=1, description="Most timesteps in one request, all sequences (413 above)."
    )
    batch_split_depth: int = Field(
        8,
        ge=0,
        description="Times a failing batch is halved to retry each half apart, so only the "
        "requests that fail alone fail (0: a failing batch fails all its requests).",
    )
    request_timeout_s: float = Field(
        60.0,
        ge=0,
        description="Deadline of a request from its arrival (504 after; 0: none); a request's "
        "X-Request-Timeout header (seconds) can only shorten it.",
    )
    body_timeout_s: float = Field(
        30.0, gt=0, description="Longest time to receive a whole request body (408 after)."
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Longest time to receive a request's line and headers, from its first byte "
        "(from the connection's opening for the first request); then 408 and the connection "
        "closes (slow or stalled clients).",
    )
    write_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Longest time a client may read nothing of its answer once the connection's "
        "send buffer is full; then the connection is closed (the unsent bytes count in "
        "max_inflight_bytes meanwhile).",
    )
    limit_concurrency: int | None = Field(
        None,
        ge=1,
        description="Most connections or requests open at once per HTTP process; beyond it new "
        "requests get 503 concurrency_limit. Unset: no limit.",
    )
    max_inflight_bytes: int = Field(
        512 * 1024 * 1024,
        ge=1,
        description="Request body bytes being read, parsed, queued and run at once, per HTTP "
        "process (with --workers N, in each worker), beyond which new requests get 503 "
        "overloaded.",
    )
    codec_threads: int = Field(
        2,
        ge=0,
        le=64,
        description="Threads per HTTP process that read JSON bodies of at least "
        "codec_offload_bytes and write JSON answers as large, off the event loop (the parser "
        "and writer release the GIL), so that one large body does not hold up every other "
        "request and parsing spreads over cores; 0: all on the event loop.",
    )
    codec_offload_bytes: int = Field(
        256 * 1024,
        ge=0,
        description="Smallest JSON body (or answer) read or written on a codec thread; smaller "
        "ones stay on the event loop, where handing them to a thread costs more than it saves.",
    )
    json_reader: Literal["fast", "precise"] = Field(
        "fast",
        description="How JSON bodies are read: 'fast', the compiled reader, which hands anything "
        "unusual to the precise one; 'precise', pydantic's parser for every body (slower; the "
        "same answers and errors).",
    )
    api_token: SecretStr | None = Field(
        None,
        description="Bearer token required by /smooth, /rollout, /models, /models/{name}/..., "
        "/v2/models/..., /metrics and /admin/reload; unset: none required.",
    )
    api_token_file: Path | None = Field(
        None, description="File holding the bearer token (instead of RNNSERVE_API_TOKEN)."
    )
    workers: int = Field(
        1,
        ge=1,
        le=512,
        description="HTTP worker processes; from 2, they parse and serialise requests and feed "
        "one engine process that owns the models, so batches still form across all of them.",
    )
    drain_timeout_s: float = Field(
        30.0, ge=0, description="On shutdown, how long queued requests may take to finish."
    )
    max_sessions: int = Field(
        100,
        ge=0,
        description="Most streaming sessions (WebSocket /models/{name}/stream) open at once per "
        "HTTP process; one more is closed with 1013 (try again later). 0: no sessions.",
    )
    session_idle_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Longest a streaming session may send nothing; then it is closed (4408).",
    )
    max_chunk_bytes: int = Field(
        MAX_CHUNK_BYTES,
        ge=1,
        description="Largest frame of a streaming session (a chunk of steps), in bytes; a larger "
        "one closes the session with 1009. At most max_request_bytes; unset: "
        f"{MAX_CHUNK_BYTES} or max_request_bytes if that is smaller.",
    )

    @model_validator(mode="before")
    @classmethod
    def _chunk_limit_within_a_body(cls, data: Any) -> Any:
        """An unset ``max_chunk_bytes`` is the smaller of its default and ``max_request_bytes``
        (a frame is read as a request body), so lowering the body limit lowers the frame's."""
        if not isinstance(data, dict) or data.get("max_chunk_bytes") is not None:
            return data
        try:
            body_limit = int(data.get("max_request_bytes", MAX_REQUEST_BYTES))
        except (TypeError, ValueError):  # the field's own validation says what is wrong
            return data
        if body_limit < MAX_CHUNK_BYTES:
            return {**data, "max_chunk_bytes": body_limit}
        return data

    @model_validator(mode="after")
    def _chunk_not_over_a_body(self) -> Settings:
        if self.max_chunk_bytes > self.max_request_bytes:
            raise ValueError(
                f"max_chunk_bytes ({self.max_chunk_bytes}) is over max_request_bytes "
                f"({self.max_request_bytes}): a session's frame is read as a request body"
            )
        return self

    @field_validator("api_token_file")
    @classmethod
    def _readable_token(cls, value: Path | None) -> Path | None:
        if value is not None:
            try:
                token = value.read_text().strip()
            except OSError as exc:
                raise ValueError(f"cannot read the token file: {exc.strerror}") from None
            _check_token(token, f"{value}")
        return value

    @field_validator("api_token")
    @classmethod
    def _non_empty_token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            _check_token(value.get_secret_value().strip(), "the token")
        return value

    def bearer_token(self) -> str | None:
        """The token clients must send (``Authorization: Bearer <token>``), if any."""
        if self.api_token is not None:
            return self.api_token.get_secret_value().strip()
        if self.api_token_file is not None:
            return self.api_token_file.read_text().strip()
        return None

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        kind, _, index = value.partition(":")
        if value in ("auto", "cpu", "cuda") or (kind == "cuda" and index.isdigit()):
            return value
        raise ValueError(f"unknown device {value!r}; use auto, cpu, cuda or cuda:N")

    def public(self) -> dict[str, Any]:
        """The effective settings as JSON values, secrets hidden (``GET /models``, the log)."""
        out: dict[str, Any] = {}
        for name, value in self.model_dump().items():
            if isinstance(value, SecretStr):
                out[name] = "**********"  # set; never its value
            elif isinstance(value, Path):
                out[name] = str(value)
            else:
                out[name] = value
        return out


def unknown_environment(environ: Mapping[str, str]) -> list[str]:
    """One warning per ``RNNSERVE_*`` variable that is no setting, naming the closest one."""
    known = [ENV_PREFIX + name.upper() for name in Settings.model_fields]
    warnings = []
    for key in sorted(environ):
        if not key.upper().startswith(ENV_PREFIX) or key.upper() in known:
            continue
        names = [k.removeprefix(ENV_PREFIX) for k in known]
        close = difflib.get_close_matches(key.upper().removeprefix(ENV_PREFIX), names, n=1)
        hint = f"; did you mean {ENV_PREFIX}{close[0]}?" if close else ""
        warnings.append(f"{key} is not an rnnserve setting and is ignored{hint}")
    return warnings
