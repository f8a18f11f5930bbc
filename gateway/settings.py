"""All configuration in one dataclass: each field is a CLI flag, an env var and a TOML key.

Precedence, lowest first: the defaults below, the TOML file given by ``--config`` (or
``PRISMGATE_CONFIG``), environment variables ``PRISMGATE_<FIELD>``, command-line flags.
A new setting is one field here; the CLI, the environment and the README table follow.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prismgate.core.errors import invalid

ENV_PREFIX = "PRISMGATE_"
EXECUTOR_BACKENDS = ("mp", "ray", "uni", "external_launcher")  # vLLM's distributed executor backends


def setting(default: Any, help: str, *, choices: Sequence[str] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


# The settings a [[models]] entry may set for its own engine.
ENGINE_OPTIONS = (
    "device", "dtype", "threads", "max_model_len", "prefill_chunk", "max_cached_tokens", "max_cached_bytes",
    "max_batch", "replicas", "grammar_cache_bytes", "grammar_compile_timeout_s", "gpu_memory_utilization",
    "vllm_kv_cache_gb", "vllm_enforce_eager", "tensor_parallel_size",
    "pipeline_parallel_size", "data_parallel_size", "distributed_executor_backend", "vllm_readout_address",
    "vllm_block_size", "vllm_cache_scope", "vllm_steering_rounds",
)  # fmt: skip


@dataclass(frozen=True)
class ModelConfig:
    """One ``[[models]]`` table: a served model, its engine and that engine's own options.

    Keys: ``name`` (what clients ask for), ``model`` (a local folder; absent: the embedded
    default model), ``engine``, ``concept_pack``, ``sae``, ``sae_labels`` and any of :data:`ENGINE_OPTIONS`; what an
    entry leaves out comes from the top-level settings.
    """

    name: str
    model: str | None = None
    engine: str | None = None
    concept_pack: str | None = None
    sae: str | None = None
    sae_labels: str | None = None
    options: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def parse(cls, table: object, where: str) -> ModelConfig:
        if not isinstance(table, dict):
            raise invalid(f"{where} must be a table")
        entry = {key.replace("-", "_"): value for key, value in table.items()}
        name = entry.pop("name", None)
        if not isinstance(name, str) or not name.strip() or "/" in name:
            raise invalid(f"{where}: 'name' must be a non-empty string without '/', got {name!r}")
        plain = {key: entry.pop(key, None) for key in ("model", "engine", "concept_pack", "sae", "sae_labels")}
        for key, value in plain.items():
            if value is not None and not isinstance(value, str):
                raise invalid(f"{where} ({name}): {key!r} must be a string")
        unknown = sorted(set(entry) - set(ENGINE_OPTIONS))
        if unknown:
            raise invalid(
                f"{where} ({name}): unknown key(s) {', '.join(unknown)}; a model takes name, model, engine, "
                f"concept_pack, sae, sae_labels and the engine options {', '.join(ENGINE_OPTIONS)}"
            )
        return cls(
            name,
            plain["model"],
            plain["engine"],
            plain["concept_pack"],
            plain["sae"],
            plain["sae_labels"],
            tuple(sorted(entry.items())),
        )

    def apply(self, base: Settings) -> Settings:
        """``base`` with this model's choices in place of the top-level engine settings."""
        settings = dataclasses.replace(
            base,
            model=self.model,
            model_name=self.name,
            engine=self.engine or base.engine,
            concept_pack=self.concept_pack,
            sae=self.sae,
            sae_labels=self.sae_labels,
            models=(),
            **dict(self.options),
        )
        settings.validate()
        return settings


@dataclass(frozen=True)
class Settings:
    # -- server ---------------------------------------------------------------------
    host: str = setting("127.0.0.1", "Address to bind (the container images set 0.0.0.0).")
    http_port: int = setting(
        8000, "HTTP port: GraphPipe, Evergreen WebSocket, OpenAI API, playground, health, metrics."
    )
    grpc_port: int = setting(50051, "gRPC port: salience.v1, evergreen.v2, health and reflection.")
    shutdown_grace_s: float = setting(30.0, "On SIGTERM, how long in-flight streams may run before they are cancelled.")
    workers: int = setting(
        1,
        "Front-end processes sharing the HTTP and gRPC ports. 1: one process, as always. N > 1: N front-ends over "
        "one engine host process that runs the engines, the admission queue and the in-memory sessions "
        "(docs/architecture.md: Several front-end processes).",
    )
    http_keep_alive_s: float = setting(
        75.0,
        "How long an idle HTTP keep-alive connection stays open; keep it above a load balancer's idle timeout, "
        "or the balancer may reuse a connection the gateway is closing.",
    )
    http_header_timeout_s: float = setting(
        60.0,
        "Time a client has to send a request's headers, from connecting (or a keep-alive request's first byte); "
        "past it: 408 and the connection closes (nginx's client_header_timeout).",
    )
    http_body_timeout_s: float = setting(
        60.0,
        "Longest wait for the next piece of a request body; past it: 408 and the connection closes "
        "(nginx's client_body_timeout).",
    )
    http_send_timeout_s: float = setting(
        60.0,
        "Longest an HTTP client may leave the answer untaken (the connection's writes stay blocked); past it the "
        "connection is closed (nginx's send_timeout). Streams stop their generation earlier: slow_client_timeout_s.",
    )
    http_max_header_bytes: int = setting(
        32 * 1024, "Largest request line plus headers; past it: 431 (nginx's large_client_header_buffers)."
    )
    max_connections_per_client: int = setting(
        128, "Open HTTP connections and WebSockets from one client address (0: no cap); past it: 503 or close 4429."
    )
    allowed_origins: str | None = setting(
        None,
        "Comma-separated origins (scheme://host[:port]) whose web pages may call the HTTP API and /evergreen "
        "(CORS on /v1); '*' allows any; unset: the server's own origin and localhost pages only. Requests "
        "without an Origin header (non-browser clients) are not affected.",
    )

    # -- engine ---------------------------------------------------------------------
    engine: str = setting("transformers", "Engine that runs the model.", choices=("transformers", "vllm"))
    model: str | None = setting(None, "Local Hugging Face model folder; default: the embedded SmolLM2-135M-Instruct.")
    model_name: str | None = setting(None, "Name clients use for the model (default: the folder's name).")
    concept_pack: str | None = setting(
        None,
        "Concept pack (.safetensors) for readouts; 'auto' builds one for the served model on first start and "
        "caches it (see concept_pack_cache); 'none' disables. Default: the embedded pack for the default model, "
        "else 'auto'.",
    )
    sae: str | None = setting(
        None,
        "Sparse autoencoders to load (docs/sae.md): SAELens folders (cfg.json + sae_weights.safetensors), "
        "comma-separated, one or several layers; 'auto': the one 'prismgate sae train' made for the served model "
        "(shipped for the embedded model); unset: none.",
    )
    sae_labels: str | None = setting(
        None,
        "Labels for the SAEs in sae: JSON files of feature id -> label, comma-separated in the same order (an "
        "empty item: none). Default: each SAE folder's labels.json, when there is one.",
    )
    sae_cache: str | None = setting(
        None,
        "Folder of SAEs trained by 'prismgate sae train', one per model digest (default: "
        "$XDG_CACHE_HOME/prismgate/saes, else ~/.cache/prismgate/saes).",
    )
    device: str = setting("auto", "transformers engine: cpu, cuda, cuda:N or auto.")
    dtype: str = setting("auto", "Weights dtype.", choices=("auto", "bfloat16", "float16", "float32"))
    threads: int | None = setting(None, "CPU threads for the transformers engine (default: torch's choice).")
    deterministic: bool = setting(
        False,
        "Every request's default for `deterministic`: the same token ids, logprobs and readouts whatever else "
        "runs beside it (batch-invariant kernels; docs/determinism.md). A request's own field overrides it; "
        "sampled requests then need a seed.",
    )
    max_model_len: int | None = setting(None, "Context length limit (default: the model's own).")
    prefill_chunk: int = setting(512, "transformers engine: prompt tokens run per step, so long prompts interleave.")
    max_cached_tokens: int = setting(1 << 18, "transformers engine: KV-cache tokens kept across session turns (LRU).")
    max_cached_bytes: int = setting(
        0,
        "transformers engine: bytes of KV cache kept across session turns (LRU, beside max_cached_tokens); "
        "0: a twentieth of the machine's memory, 128 MiB to 2 GiB.",
    )
    replicas: int = setting(
        1,
        "transformers engine: copies of the model in this process; a session's turns stay on the copy that "
        "holds its KV cache (docs/scaling.md). vLLM: use its own data parallelism (data_parallel_size) instead.",
    )
    grammar_cache_bytes: int = setting(
        64 << 20,
        "transformers engine: bytes of compiled structured-output grammars (llguidance's text) kept for reuse, "
        "least recently used out first; 0: no cache, each request compiles its own.",
    )
    grammar_compile_timeout_s: float = setting(
        10.0,
        "transformers engine: longest wait for a structured-output grammar to compile; past it the request is "
        "a 400 (the compile finishes in the background, one at a time, and is cached).",
    )
    max_batch: int = setting(
        16, "transformers engine: decode steps of up to this many requests run as one forward pass (1: no batching)."
    )
    gpu_memory_utilization: float = setting(
        0.9,
        "vLLM engine: fraction of memory vLLM may use: of the GPU's, or on CPU of the memory free at start-up "
        "(the KV cache then gets that share less the weights, at most 4 GiB).",
    )
    vllm_kv_cache_gb: float | None = setting(
        None, "vLLM engine: KV-cache size in GiB, on GPU or CPU (unset: from gpu_memory_utilization)."
    )
    vllm_enforce_eager: bool = setting(
        False, "vLLM engine: run eagerly, without torch.compile or CUDA graphs (slower; for debugging)."
    )
    tensor_parallel_size: int = setting(1, "vLLM engine: GPUs to shard each layer of the model over.")
    pipeline_parallel_size: int = setting(
        1, "vLLM engine: pipeline stages to split the model's layers over (each stage reports its own readouts)."
    )
    data_parallel_size: int = setting(
        1,
        "vLLM engine: copies of the model under one vLLM engine, each on its own tensor_parallel_size x "
        "pipeline_parallel_size devices; a session's turns stay on the copy that holds its KV cache "
        "(docs/scaling.md).",
    )
    distributed_executor_backend: str | None = setting(
        None,
        "vLLM engine: vLLM's distributed executor backend, passed through: 'mp' (processes on this node), "
        "'ray' (several nodes; docs/scaling.md), 'uni' (one process); unset: vLLM's choice.",
    )
    vllm_readout_address: str | None = setting(
        None,
        "vLLM engine: where the workers send readouts and prompt logprobs. Unset: a private ipc:// socket on this "
        "host. tcp://HOST:PORT (HOST an address of this machine): workers on other nodes (Ray) reach it too; "
        "bind it only where the cluster's private network reaches (docs/scaling.md).",
    )
    vllm_block_size: int | None = setting(
        None, "vLLM engine: KV block size, the grain of prefix reuse (CPU: multiples of 32)."
    )
    vllm_cache_scope: str = setting(
        "session",
        "vLLM engine: prefix-cache reuse within each session only, or across sessions too.",
        choices=("session", "global"),
    )
    vllm_steering_rounds: int = setting(
        8,
        "vLLM engine: steering vectors one request may add at one layer (0-8); 0 turns steering off and "
        "leaves it out of the compiled graph. Under CUDA graphs every round is replayed at every step, "
        "steered or not (docs/vllm.md).",
    )

    # -- sessions and admission ---------------------------------------------------------
    session_ttl_s: float = setting(1800.0, "Idle seconds before a session is evicted.")
    session_store: str = setting(
        "memory",
        "Where sessions live: 'memory' (this process) or a redis:// URL (shared by every replica, kept across "
        "restarts; see docs/scaling.md).",
    )
    session_lock_s: float = setting(
        10.0, "Redis session store: how long a dead replica's generation keeps its session busy (renewed while alive)."
    )
    max_sessions: int = setting(4096, "Open sessions allowed at once.")
    max_session_tokens: int = setting(
        64 * 1024 * 1024,
        "Tokens held by all sessions together; a generation is refused unless its append and max_tokens fit.",
    )
    max_active: int = setting(64, "Generations running at once across all protocols; the rest queue by priority.")
    max_queued: int = setting(1024, "Generations allowed to wait; beyond this requests fail UNAVAILABLE.")
    reserved_slots: int = setting(
        0,
        "Of max_active, slots kept for keys with no generation running, so that a key starts at once while "
        "another fills the pool (docs/keys.md); they stay idle while one key has the pool to itself.",
    )
    memory_budget_bytes: int = setting(
        0,
        "Memory all running generations together may hold: the keys and values of their prompt and max_tokens "
        "(transformers engine) and what they report (logprob entries, readouts, buffered output until the answer "
        "is written); each request's worst case estimated from its spec before it runs. Requests over it wait; one "
        "that alone exceeds it is refused RESOURCE_EXHAUSTED. 0: 1% of the machine's memory, between 64 MiB and "
        "256 MiB, and at least one request at the largest served model's whole context.",
    )

    # -- security and limits ------------------------------------------------------------
    auth_token: str | None = setting(
        None,
        "Shared bearer token required on every protocol (unset: no auth); the one-key shortcut for keys_file: "
        "the key named 'default', with the admin scope.",
    )
    keys_file: str | None = setting(
        None,
        "TOML file of named API keys, stored as SHA-256 hashes, each with its models, permissions, limits and "
        "fair-share weight (docs/keys.md; 'prismgate keys add' writes it); read again on SIGHUP and when it "
        "changes, no restart.",
    )
    grpc_max_message_bytes: int = setting(64 * 1024 * 1024, "Largest gRPC message accepted or sent.")
    allow_special_tokens_in_text: bool = setting(
        False,
        "Read a control token's string in a client's text (<|im_end|>, <|im_start|>) as that control token, on "
        "every protocol. Off: it is text, as the hosted APIs do, so a user cannot forge a system turn; only the "
        "chat template places control tokens (a client that needs them sends token ids).",
    )

    # -- logging --------------------------------------------------------------------
    log_level: str = setting("info", "Log level.", choices=("debug", "info", "warning", "error"))
    log_json: bool = setting(False, "Log one JSON object per line.")
    log_prompts: bool = setting(False, "Include prompt and output text in logs (off: ids and counts only).")

    # -- operations (owned by ops: server lifecycle, deployment) -------------------------
    port_file: str | None = setting(
        None,
        "Once both ports are bound, write them to this file as JSON (http_port, grpc_port, pid): "
        "useful with port 0. Removed again on a clean stop.",
    )

    # -- per-protocol settings (each block owned by its codec) --------------------------

    # -- evergreen (owned by codecs/evergreen and gateway/playground) -------------------------
    evergreen_max_nodes: int = setting(10_000, "Evergreen: nodes one session may hold (abort past it).")
    evergreen_max_bytes: int = setting(64 * 1024 * 1024, "Evergreen: bytes of node data one session may hold.")
    evergreen_max_depth: int = setting(32, "Evergreen: deepest nesting of nodes allowed in one session.")
    evergreen_max_tokens: int = setting(
        256, "Evergreen: max_tokens for a GENERATE whose config sets none (capped by what is left of the context)."
    )
    evergreen_file_root: str | None = setting(
        None, "Evergreen: folder that file:// chunk refs may read from (unset: file:// refs are refused)."
    )
    evergreen_http_refs: bool = setting(False, "Evergreen: fetch http(s):// chunk refs (off: refused).")
    evergreen_ref_max_bytes: int = setting(16 * 1024 * 1024, "Evergreen: largest payload a file/http(s) ref may hold.")
    evergreen_ref_timeout_s: float = setting(10.0, "Evergreen: time limit for fetching one http(s) ref.")
    playground: bool = setting(True, "Serve the browser playground at /playground (it talks Evergreen).")

    # -- openai (owned by codecs/openai: the OpenAI-compatible /v1 API) --------------------
    openai_default_max_tokens: int | None = setting(
        None, "OpenAI API: max_tokens for requests that set none (unset: the rest of the context, as OpenAI does)."
    )

    # -- graphpipe (owned by codecs/graphpipe: GraphPipe flatbuffers over HTTP) ------------
    graphpipe_path: str = setting(
        "/graphpipe",
        "GraphPipe endpoint: POST a flatbuffer Request, GET the metadata as JSON; <path>/control/is_ready "
        "and <path>/control/is_alive answer ok.",
    )
    graphpipe_root: bool = setting(
        True, "Also serve GraphPipe on POST / (and GET / and /control/*, where no other route claims them)."
    )
    graphpipe_error_status: str = setting(
        "auto",
        "GraphPipe errors: '200' = HTTP 200 with an InferResponse whose errors carry code and message (the spec; "
        "the Python client raises the message); 'http' = a 4xx/5xx status with the message as a text body "
        "(the reference Go server and client); 'auto' = 'http' for Go clients (User-Agent Go-http-client), "
        "else '200'.",
        choices=("auto", "200", "http"),
    )
    graphpipe_max_body_bytes: int = setting(
        64 * 1024 * 1024, "Largest GraphPipe request body; a larger one is refused without being read."
    )
    graphpipe_max_batch: int = setting(256, "Most rows (prompts or token rows) in one GraphPipe request.")
    concept_pack_cache: str | None = setting(
        None,
        "Folder of concept packs built by --concept-pack auto, one file per model digest "
        "(default: $XDG_CACHE_HOME/prismgate/packs, else ~/.cache/prismgate/packs).",
    )
    concept_pack_pairs: int = setting(
        8, "--concept-pack auto: prompt pairs per concept the build uses (more: steadier directions, longer build)."
    )

    # -- slow readers (owned by codecs: every protocol's streaming output) -----------------
    slow_client_timeout_s: float = setting(
        30.0,
        "Longest a streaming client may leave the server's writes untaken (an SSE stream, an Evergreen "
        "WebSocket, a gRPC stream); past it the stream is dropped and its generation stopped (nginx's send_timeout).",
    )
    slow_client_buffer_bytes: int = setting(
        1024 * 1024,
        "Output one stream may hold for a client that reads slowly: a generation that ends within it frees its "
        "engine slot at once; past it the generation waits for the client (up to slow_client_timeout_s).",
    )
    openai_max_body_bytes: int = setting(
        64 * 1024 * 1024,
        "OpenAI API: largest request body (images included); a larger one is refused with 413, unread when its "
        "Content-Length says so.",
    )

    # -- the request budget (gateway/core/budget.py): every protocol, checked before the work --
    max_json_depth: int = setting(64, "Deepest nesting of arrays and objects in any JSON a client sends.")
    max_stop_strings: int = setting(64, "Most stop strings in one request.")
    max_stop_string_chars: int = setting(1024, "Longest stop string, in characters.")
    max_stop_token_ids: int = setting(1024, "Most stop token ids in one request.")
    max_position_ranges: int = setting(256, "Most logprob ranges, and most readout ranges, in one request.")
    prompt_bytes_per_context_token: int = setting(
        64,
        "A prompt's text is refused before tokenizing when it has more UTF-8 bytes than this many per token of "
        "the model's context.",
    )
    max_expanded_leaves: int = setting(
        100_000, "Evergreen: most leaves an input node tree may expand to (a shared node counted each time)."
    )
    max_actions_in_flight: int = setting(1024, "Evergreen: most actions not yet ended on one session.")
    max_steering_entries: int = setting(8, "Most steering entries in one request.")
    max_grammar_bytes: int = setting(
        32768, "Largest structured-output constraint (JSON schema, regex, grammar or choices), in UTF-8 bytes."
    )
    max_grammar_depth: int = setting(16, "Deepest nesting of arrays and objects in a structured-output JSON schema.")

    # -- several models (TOML only: a list of tables) ---------------------------------
    models: tuple[ModelConfig, ...] = field(
        default=(),
        metadata={
            "help": "The models this gateway serves, from the TOML file's [[models]] tables (the first is the "
            "default); empty: the one model of the engine settings above.",
            "toml_only": True,
        },
    )

    @classmethod
    def fields(cls) -> list[dataclasses.Field[Any]]:
        """The settings that are also flags and environment variables (``models`` is TOML only)."""
        return [f for f in dataclasses.fields(cls) if not f.metadata.get("toml_only")]

    def served(self) -> list[Settings]:
        """One engine's settings per served model: each ``[[models]]`` entry, or these settings alone."""
        return [m.apply(self) for m in self.models] or [self]

    @classmethod
    def load(
        cls,
        overrides: Mapping[str, Any] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        config_file: str | None = None,
    ) -> Settings:
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        config_file = config_file or env.get(ENV_PREFIX + "CONFIG")
        if config_file:
            values.update(_read_toml(config_file))
        for f in cls.fields():
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is not None:
                values[f.name] = _parse(f, raw, f"{ENV_PREFIX}{f.name.upper()}")
        values.update({k: v for k, v in (overrides or {}).items() if v is not None})
        settings = cls(**values)
        settings.validate()
        return settings

    def validate(self) -> None:
        for f in self.fields():
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value not in choices:
                raise invalid(f"{f.name} must be one of {', '.join(choices)}; got {value!r}")
        for name in ("http_header_timeout_s", "http_body_timeout_s", "http_send_timeout_s", "http_max_header_bytes"):
            if getattr(self, name) <= 0:
                raise invalid(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_connections_per_client < 0:
            raise invalid(f"max_connections_per_client must be >= 0, got {self.max_connections_per_client}")
        if self.session_store != "memory" and not self.session_store.startswith(("redis://", "rediss://", "unix://")):
            raise invalid(f"session_store must be 'memory' or a redis:// URL, got {self.session_store!r}")
        if not 0 <= self.reserved_slots < self.max_active:
            raise invalid(f"reserved_slots must be >= 0 and below max_active, got {self.reserved_slots}")
        if self.session_lock_s <= 0:
            raise invalid(f"session_lock_s must be > 0, got {self.session_lock_s}")
        if self.replicas < 1 or (self.engine == "vllm" and self.replicas != 1):
            raise invalid(f"replicas must be >= 1 (and 1 with the vLLM engine, which has its own), got {self.replicas}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            size = getattr(self, name)
            if size < 1 or (self.engine != "vllm" and size != 1):
                raise invalid(f"{name} must be >= 1 (and 1 unless the engine is vllm), got {size}")
        if self.distributed_executor_backend not in (None, *EXECUTOR_BACKENDS):
            raise invalid(
                f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                f"got {self.distributed_executor_backend!r}"
            )
        if self.sae_labels and not self.sae:
            raise invalid("sae_labels names labels for the SAEs in sae: give sae too")
        if self.vllm_steering_rounds < 0:  # the vLLM engine checks its own maximum
            raise invalid(f"vllm_steering_rounds must be >= 0, got {self.vllm_steering_rounds}")
        address = self.vllm_readout_address
        if address is not None and not re.fullmatch(r"tcp://[^\s:/]+:\d{1,5}", address):
            raise invalid(f"vllm_readout_address must be tcp://HOST:PORT, got {address!r}")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise invalid(f"[[models]] names must be unique, got {', '.join(names)}")
        if self.models and (self.model is not None or self.model_name is not None):
            raise invalid("give the models either as [[models]] in the config file or as --model, not both")
        for model in self.models:
            model.apply(self)  # each model's own engine settings must be valid too
        if not 1 <= self.workers <= 256:
            raise invalid(f"workers must be between 1 and 256, got {self.workers}")
        for name in ("http_port", "grpc_port"):
            port = getattr(self, name)
            if not 0 <= port < 65536:
                raise invalid(f"{name} must be a TCP port, got {port}")


def _base_type(f: dataclasses.Field[Any]) -> type:
    hints = typing.get_type_hints(Settings)
    hint = hints[f.name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0]
    return typing.cast(type, hint)


def _parse(f: dataclasses.Field[Any], raw: str, where: str) -> Any:
    kind = _base_type(f)
    try:
        if kind is bool:
            low = raw.strip().lower()
            if low in {"1", "true", "yes", "on"}:
                return True
            if low in {"0", "false", "no", "off"}:
                return False
            raise ValueError(raw)
        return kind(raw)
    except ValueError:
        raise invalid(f"{where}: {raw!r} is not a valid {kind.__name__}") from None


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise invalid(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise invalid(f"config file {path}: {exc}") from None
    table = dict(data.get("prismgate", data))
    known = {f.name: f for f in Settings.fields()}
    out: dict[str, Any] = {}
    models = table.pop("models", None)
    if models is not None:
        if not isinstance(models, list) or not models:
            raise invalid(f"config file {path}: 'models' must be a non-empty list of [[models]] tables")
        out["models"] = tuple(
            ModelConfig.parse(m, f"config file {path}: [[models]] #{i + 1}") for i, m in enumerate(models)
        )
    for key, value in table.items():
        name = key.replace("-", "_")
        if name not in known:
            raise invalid(f"config file {path}: unknown setting {key!r}")
        out[name] = value
    return out


# --help's sections: every setting in exactly one (tests/test_settings.py checks it), "limits" last
HELP_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "server",
        (
            "host", "http_port", "grpc_port", "workers", "shutdown_grace_s", "port_file", "playground",
            "session_store", "session_ttl_s", "session_lock_s", "openai_default_max_tokens", "evergreen_max_tokens",
            "evergreen_file_root", "evergreen_http_refs", "graphpipe_path", "graphpipe_root", "graphpipe_error_status",
        ),
    ),
    (
        "model and engine",
        (
            "engine", "model", "model_name", "concept_pack", "concept_pack_cache", "concept_pack_pairs", "sae",
            "sae_labels", "sae_cache", "device",
            "dtype", "threads", "max_model_len", "prefill_chunk", "max_cached_tokens", "max_cached_bytes", "replicas",
            "max_batch", "grammar_cache_bytes", "grammar_compile_timeout_s", "deterministic",
        ),
    ),
    (
        "vLLM engine (--engine vllm only)",
        (
            "gpu_memory_utilization", "vllm_kv_cache_gb", "vllm_enforce_eager", "tensor_parallel_size",
            "pipeline_parallel_size", "data_parallel_size", "distributed_executor_backend", "vllm_readout_address",
            "vllm_block_size", "vllm_cache_scope", "vllm_steering_rounds",
        ),
    ),
    (
        "security (who may call, and what a client may hold open)",
        (
            "auth_token", "keys_file", "allow_special_tokens_in_text", "allowed_origins", "max_connections_per_client",
            "http_keep_alive_s",
            "http_header_timeout_s", "http_body_timeout_s", "http_send_timeout_s", "http_max_header_bytes",
            "slow_client_timeout_s", "slow_client_buffer_bytes",
        ),
    ),
    ("observability", ("log_level", "log_json", "log_prompts")),
    (
        "limits (each checked before the work it would cause)",
        (
            "max_active", "max_queued", "reserved_slots", "memory_budget_bytes", "max_sessions", "max_session_tokens",
            "grpc_max_message_bytes",
            "openai_max_body_bytes", "graphpipe_max_body_bytes", "graphpipe_max_batch", "max_json_depth",
            "max_stop_strings", "max_stop_string_chars", "max_stop_token_ids", "max_position_ranges",
            "prompt_bytes_per_context_token", "max_steering_entries", "max_grammar_bytes", "max_grammar_depth",
            "evergreen_max_nodes", "evergreen_max_bytes",
            "evergreen_max_depth", "max_expanded_leaves", "max_actions_in_flight",
            "evergreen_ref_max_bytes", "evergreen_ref_timeout_s",
        ),
    ),
)  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per setting, its help naming the env var and the default, in :data:`HELP_GROUPS`' sections."""
    parser.add_argument("--config", help=f"TOML file of settings ({ENV_PREFIX}CONFIG).")
    fields = {f.name: f for f in Settings.fields()}
    for title, names in HELP_GROUPS:
        group = parser.add_argument_group(title)
        for name in names:
            _add_flag(group, fields[name])


def _add_flag(group: argparse._ArgumentGroup, f: dataclasses.Field[Any]) -> None:
    flag = "--" + f.name.replace("_", "-")
    text = f"{f.metadata['help']} [env {ENV_PREFIX + f.name.upper()}; default {f.default!r}]".replace("%", "%%")
    if _base_type(f) is bool:
        group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=text)
    else:
        group.add_argument(
            flag, dest=f.name, type=_base_type(f), default=None, choices=f.metadata.get("choices"), help=text
        )


def from_arguments(args: argparse.Namespace) -> Settings:
    overrides = {f.name: getattr(args, f.name, None) for f in Settings.fields()}
    return Settings.load(overrides, config_file=getattr(args, "config", None))


def markdown_table() -> str:
    """The README's configuration table, generated so it cannot drift."""
    rows = ["| flag | environment variable | TOML key | default | meaning |", "|---|---|---|---|---|"]
    for f in Settings.fields():
        rows.append(
            f"| `--{f.name.replace('_', '-')}` | `{ENV_PREFIX}{f.name.upper()}` | `{f.name}` | "
            f"`{f.default!r}` | {f.metadata['help']} |"
        )
    return "\n".join(rows)
