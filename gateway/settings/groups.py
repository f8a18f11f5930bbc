"""The settings, in groups: small frozen value objects, each a ``--help`` section and a table.

Each field is one setting; its public name (flag, environment variable, TOML key) is the
group's prefix plus the field's name (see :mod:`.fields`). Each engine owns its options
(:class:`TransformersOptions`, :class:`VLLMOptions`); their field names are the engine's own
keyword arguments, so the composition passes them through without listing them again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar

from msgspec import Meta

from prismgate.settings.fields import Group, setting

Port = Annotated[int, Meta(ge=0, le=65535)]
Positive = Annotated[float, Meta(gt=0)]
PositiveInt = Annotated[int, Meta(gt=0)]
AtLeastOne = Annotated[int, Meta(ge=1)]
NonNegative = Annotated[int, Meta(ge=0)]
EXECUTOR_BACKENDS = ("mp", "ray", "uni", "external_launcher")  # vLLM's distributed executor backends


@dataclass(frozen=True)
class Server(Group):
    title: ClassVar[str] = "server"

    host: str = setting("127.0.0.1", "Address to bind (the container images set 0.0.0.0).")
    http_port: Port = setting(
        8000, "HTTP port: GraphPipe, Evergreen WebSocket, OpenAI API, playground, health, metrics."
    )
    grpc_port: Port = setting(50051, "gRPC port: salience.v1, evergreen.v2, health and reflection.")
    workers: Annotated[int, Meta(ge=1, le=256)] = setting(
        1,
        "Front-end processes sharing the HTTP and gRPC ports. 1: one process, as always. N > 1: N front-ends over "
        "one engine host process that runs the engines, the admission queue and the in-memory sessions "
        "(docs/architecture.md: Several front-end processes).",
    )
    shutdown_grace_s: float = setting(30.0, "On SIGTERM, how long in-flight streams may run before they are cancelled.")
    port_file: str | None = setting(
        None,
        "Once both ports are bound, write them to this file as JSON (http_port, grpc_port, pid): "
        "useful with port 0. Removed again on a clean stop.",
    )
    playground: bool = setting(True, "Serve the browser playground at /playground (it talks Evergreen).")


@dataclass(frozen=True)
class HTTP(Group):
    title: ClassVar[str] = "HTTP connections (what one client may hold open, and for how long)"
    prefix: ClassVar[str] = "http_"

    keep_alive_s: float = setting(
        75.0,
        "How long an idle HTTP keep-alive connection stays open; keep it above a load balancer's idle timeout, "
        "or the balancer may reuse a connection the gateway is closing.",
    )
    header_timeout_s: Positive = setting(
        60.0,
        "Time a client has to send a request's headers, from connecting (or a keep-alive request's first byte); "
        "past it: 408 and the connection closes (nginx's client_header_timeout).",
    )
    body_timeout_s: Positive = setting(
        60.0,
        "Longest wait for the next piece of a request body; past it: 408 and the connection closes "
        "(nginx's client_body_timeout).",
    )
    send_timeout_s: Positive = setting(
        60.0,
        "Longest an HTTP client may leave the answer untaken (the connection's writes stay blocked); past it the "
        "connection is closed (nginx's send_timeout). Streams stop their generation earlier: slow_client_timeout_s.",
    )
    max_header_bytes: PositiveInt = setting(
        32 * 1024, "Largest request line plus headers; past it: 431 (nginx's large_client_header_buffers)."
    )
    max_connections_per_client: NonNegative = setting(
        128,
        "Open HTTP connections and WebSockets from one client address (0: no cap); past it: 503 or close 4429.",
        prefixed=False,
    )


@dataclass(frozen=True)
class Security(Group):
    title: ClassVar[str] = "security (who may call, and from which pages)"

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
    allowed_origins: str | None = setting(
        None,
        "Comma-separated origins (scheme://host[:port]) whose web pages may call the HTTP API and /evergreen "
        "(CORS on /v1); '*' allows any; unset: the server's own origin and localhost pages only. Requests "
        "without an Origin header (non-browser clients) are not affected.",
    )
    allow_special_tokens_in_text: bool = setting(
        False,
        "Read a control token's string in a client's text (<|im_end|>, <|im_start|>) as that control token, on "
        "every protocol. Off: it is text, as the hosted APIs do, so a user cannot forge a system turn; only the "
        "chat template places control tokens (a client that needs them sends token ids).",
    )


@dataclass(frozen=True)
class Sessions(Group):
    title: ClassVar[str] = "sessions"
    prefix: ClassVar[str] = "session_"

    ttl_s: float = setting(1800.0, "Idle seconds before a session is evicted.")
    store: str = setting(
        "memory",
        "Where sessions live: 'memory' (this process) or a redis:// URL (shared by every replica, kept across "
        "restarts; see docs/scaling.md).",
    )
    lock_s: Positive = setting(
        10.0, "Redis session store: how long a dead replica's generation keeps its session busy (renewed while alive)."
    )
    max_sessions: int = setting(4096, "Open sessions allowed at once.", prefixed=False)
    max_session_tokens: int = setting(
        64 * 1024 * 1024,
        "Tokens held by all sessions together; a generation is refused unless its append and max_tokens fit.",
        prefixed=False,
    )


@dataclass(frozen=True)
class Admission(Group):
    title: ClassVar[str] = "admission (limits on the generations running and waiting)"

    max_active: AtLeastOne = setting(
        64, "Generations running at once across all protocols; the rest queue by priority."
    )
    max_queued: NonNegative = setting(1024, "Generations allowed to wait; beyond this requests fail UNAVAILABLE.")
    reserved_slots: NonNegative = setting(
        0,
        "Of max_active, slots kept for keys with no generation running, so that a key starts at once while "
        "another fills the pool (docs/keys.md); they stay idle while one key has the pool to itself.",
    )
    preemption: bool = setting(
        True,
        "When every slot is taken and a key with nothing running (or far below its share) asks, pause the running "
        "generation of the key "
        "holding the most slots per weight (its KV cache kept, its memory still reserved) and give its slot to "
        "the newcomer; the paused one goes on, with the same tokens, when a slot is back (docs/keys.md). When the "
        "newcomer's memory is short too, the paused one's KV cache is dropped, its bytes lent to the newcomer, and "
        "recomputed when it goes on. false: a newcomer waits for a slot to end.",
    )
    memory_budget_bytes: NonNegative = setting(
        0,
        "Memory all running generations together may hold: the keys and values of their prompt and max_tokens "
        "(transformers engine) and what they report (logprob entries, readouts, buffered output until the answer "
        "is written); each request's worst case estimated from its spec before it runs. Requests over it wait; one "
        "that alone exceeds it is refused RESOURCE_EXHAUSTED. 0: 1% of the machine's memory, between 64 MiB and "
        "256 MiB, and at least one request at the largest served model's whole context.",
    )


@dataclass(frozen=True)
class Budget(Group):
    """The core's request budget (:class:`prismgate.core.budget.RequestBudget`), field for field."""

    title: ClassVar[str] = "request budget (limits, each checked before the work it would cause)"

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


@dataclass(frozen=True)
class Engine(Group):
    title: ClassVar[str] = "model and engine"

    engine: str = setting("transformers", "Engine that runs the model.", choices=("transformers", "vllm"))
    model: str | None = setting(None, "Local Hugging Face model folder; default: the embedded SmolLM2-135M-Instruct.")
    model_name: str | None = setting(None, "Name clients use for the model (default: the folder's name).")
    dtype: str = setting(
        "auto",
        "Weights dtype. `auto`: the weights' own, except that bfloat16 weights are served in float32 on a "
        "CPU without `amx_bf16` or `avx512_bf16` (faster there: docs/benchmarks.md); /readyz and "
        "/v1/models say which and why.",
        choices=("auto", "bfloat16", "float16", "float32"),
    )
    max_model_len: int | None = setting(None, "Context length limit (default: the model's own).")
    huge_pages: bool = setting(
        True,
        "On CPU, once the model has loaded, move its weights (the engine process's anonymous memory that is "
        "almost all resident: with vLLM, its workers' weights and KV cache) into 2 MiB transparent huge pages "
        "where they are (madvise MADV_COLLAPSE, Linux 6.1+): the same bytes at the same addresses, decode steps "
        "faster (docs/benchmarks.md, 'Weights in huge pages'); /readyz says how much and why (not). false: never.",
    )
    deterministic: bool = setting(
        False,
        "Every request's default for `deterministic`: the same token ids, logprobs and readouts whatever else "
        "runs beside it (batch-invariant kernels; docs/determinism.md). A request's own field overrides it; "
        "sampled requests then need a seed.",
    )


@dataclass(frozen=True)
class TransformersOptions(Group):
    """The transformers engine's options: the keyword arguments of ``TransformersEngine`` (replicas aside)."""

    title: ClassVar[str] = "transformers engine (--engine transformers, the default)"
    per_model: ClassVar[bool] = True

    device: str = setting("auto", "transformers engine: cpu, cuda, cuda:N or auto.")
    threads: int | None = setting(None, "CPU threads for the transformers engine (default: torch's choice).")
    prefill_chunk: int = setting(512, "transformers engine: prompt tokens run per step, so long prompts interleave.")
    step_target_ms: NonNegative = setting(
        200,
        "transformers engine: while other requests wait, each round's prefill is sized from the measured seconds "
        "per prompt token to last about this long (at least one 32-token chunk): chunks shrink and prompts "
        "prefilling take turns; alone, a prompt's steps last up to 2.5 times this (at most prefill_chunk tokens), "
        "since a newcomer waits for the step under way. 0: no bound, prefill_chunk tokens a step.",
    )
    max_cached_tokens: int = setting(1 << 18, "transformers engine: KV-cache tokens kept across session turns (LRU).")
    max_cached_bytes: int = setting(
        0,
        "transformers engine: bytes of KV cache kept across session turns (LRU, beside max_cached_tokens); "
        "0: a twentieth of the machine's memory, 128 MiB to 2 GiB.",
    )
    replicas: AtLeastOne = setting(
        1,
        "transformers engine: copies of the model in this process; a session's turns stay on the copy that "
        "holds its KV cache (docs/scaling.md). vLLM: use its own data parallelism (data_parallel_size) instead.",
        engine_kwarg=False,
    )
    max_batch: int = setting(
        16,
        "transformers engine: decode steps run in forward passes of up to this many requests each; more requests "
        "decoding form further batches (1: no batching).",
    )
    packed_weights: bool = setting(
        True,
        "transformers engine: on CPU, pack bfloat16 linear layers' weights once at start for oneDNN instead of on "
        "every product (faster: docs/benchmarks.md, 'The transformers engine's CPU kernels'), where the start-up "
        "check finds the same bits as unpacked; /readyz says whether and why. The packed copy replaces each weight "
        "no other module shares (a tied LM head keeps the embedding's); sibling layers that read one input (query, key "
        "and value; gate and up) are packed as one product. false: never.",
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


@dataclass(frozen=True)
class VLLMOptions(Group):
    """The vLLM engine's options: keyword arguments of ``VLLMEngine`` of the same names."""

    title: ClassVar[str] = "vLLM engine (--engine vllm only)"
    prefix: ClassVar[str] = "vllm_"
    per_model: ClassVar[bool] = True

    gpu_memory_utilization: Annotated[float, Meta(gt=0, le=1)] = setting(
        0.9,
        "vLLM engine: fraction of memory vLLM may use: of the GPU's, or on CPU of the memory free at start-up "
        "(the KV cache then gets that share less the weights, at most 4 GiB).",
        prefixed=False,
    )
    kv_cache_gb: Annotated[float, Meta(gt=0)] | None = setting(
        None, "vLLM engine: KV-cache size in GiB, on GPU or CPU (unset: from gpu_memory_utilization)."
    )
    enforce_eager: bool = setting(
        False, "vLLM engine: run eagerly, without torch.compile or CUDA graphs (slower; for debugging)."
    )
    tensor_parallel_size: AtLeastOne = setting(
        1, "vLLM engine: GPUs to shard each layer of the model over.", prefixed=False
    )
    pipeline_parallel_size: AtLeastOne = setting(
        1,
        "vLLM engine: pipeline stages to split the model's layers over (each stage reports its own readouts).",
        prefixed=False,
    )
    data_parallel_size: AtLeastOne = setting(
        1,
        "vLLM engine: copies of the model under one vLLM engine, each on its own tensor_parallel_size x "
        "pipeline_parallel_size devices; a session's turns stay on the copy that holds its KV cache "
        "(docs/scaling.md).",
        prefixed=False,
    )
    distributed_executor_backend: str | None = setting(
        None,
        "vLLM engine: vLLM's distributed executor backend, passed through: 'mp' (processes on this node), "
        "'ray' (several nodes; docs/scaling.md), 'uni' (one process); unset: vLLM's choice.",
        choices=EXECUTOR_BACKENDS,
        prefixed=False,
    )
    readout_address: str | None = setting(
        None,
        "vLLM engine: where the workers send readouts and prompt logprobs. Unset: a private ipc:// socket on this "
        "host. tcp://HOST:PORT (HOST an address of this machine): workers on other nodes (Ray) reach it too; "
        "bind it only where the cluster's private network reaches (docs/scaling.md).",
    )
    block_size: int | None = setting(
        None, "vLLM engine: KV block size, the grain of prefix reuse (CPU: multiples of 32)."
    )
    cache_scope: str = setting(
        "session",
        "vLLM engine: prefix-cache reuse within each session only, or across sessions too.",
        choices=("session", "global"),
    )
    steering_rounds: NonNegative = setting(  # the vLLM engine checks its own maximum
        8,
        "vLLM engine: steering vectors one request may add at one layer (0-8); 0 turns steering off and "
        "leaves it out of the compiled graph. Under CUDA graphs every round is replayed at every step, "
        "steered or not (docs/vllm.md).",
    )


@dataclass(frozen=True)
class Instruments(Group):
    """What the served model is read and steered with: concept packs and sparse autoencoders."""

    title: ClassVar[str] = "instruments (concept packs and sparse autoencoders)"

    concept_pack: str | None = setting(
        None,
        "Concept pack (.safetensors) for readouts; 'auto' builds one for the served model on first start and "
        "caches it (see concept_pack_cache); 'none' disables. Default: the embedded pack for the default model, "
        "else 'auto'.",
    )
    concept_pack_cache: str | None = setting(
        None,
        "Folder of concept packs built by --concept-pack auto, one file per model digest "
        "(default: $XDG_CACHE_HOME/prismgate/packs, else ~/.cache/prismgate/packs).",
    )
    concept_pack_pairs: int = setting(
        8, "--concept-pack auto: prompt pairs per concept the build uses (more: steadier directions, longer build)."
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


@dataclass(frozen=True)
class Observability(Group):
    title: ClassVar[str] = "observability"

    log_level: str = setting("info", "Log level.", choices=("debug", "info", "warning", "error"))
    log_json: bool = setting(False, "Log one JSON object per line.")
    log_prompts: bool = setting(False, "Include prompt and output text in logs (off: ids and counts only).")


@dataclass(frozen=True)
class Streams(Group):
    """Every protocol's streaming output to a client that reads slowly (owned by the codecs)."""

    title: ClassVar[str] = "slow clients (every protocol's streams)"
    prefix: ClassVar[str] = "slow_client_"

    timeout_s: float = setting(
        30.0,
        "Longest a streaming client may leave the server's writes untaken (an SSE stream, an Evergreen "
        "WebSocket, a gRPC stream); past it the stream is dropped and its generation stopped (nginx's send_timeout).",
    )
    buffer_bytes: int = setting(
        1024 * 1024,
        "Output one stream may hold for a client that reads slowly: a generation that ends within it frees its "
        "engine slot at once; past it the generation waits for the client (up to slow_client_timeout_s).",
    )


@dataclass(frozen=True)
class OpenAI(Group):
    """Owned by codecs/openai: the OpenAI-compatible /v1 API."""

    title: ClassVar[str] = "OpenAI API"
    prefix: ClassVar[str] = "openai_"

    default_max_tokens: int | None = setting(
        None, "OpenAI API: max_tokens for requests that set none (unset: the rest of the context, as OpenAI does)."
    )
    max_body_bytes: int = setting(
        64 * 1024 * 1024,
        "OpenAI API: largest request body (images included); a larger one is refused with 413, unread when its "
        "Content-Length says so.",
    )


@dataclass(frozen=True)
class GraphPipe(Group):
    """Owned by codecs/graphpipe: GraphPipe flatbuffers over HTTP."""

    title: ClassVar[str] = "GraphPipe"
    prefix: ClassVar[str] = "graphpipe_"

    path: str = setting(
        "/graphpipe",
        "GraphPipe endpoint: POST a flatbuffer Request, GET the metadata as JSON; <path>/control/is_ready "
        "and <path>/control/is_alive answer ok.",
    )
    root: bool = setting(
        True, "Also serve GraphPipe on POST / (and GET / and /control/*, where no other route claims them)."
    )
    error_status: str = setting(
        "auto",
        "GraphPipe errors: '200' = HTTP 200 with an InferResponse whose errors carry code and message (the spec; "
        "the Python client raises the message); 'http' = a 4xx/5xx status with the message as a text body "
        "(the reference Go server and client); 'auto' = 'http' for Go clients (User-Agent Go-http-client), "
        "else '200'.",
        choices=("auto", "200", "http"),
    )
    max_body_bytes: int = setting(
        64 * 1024 * 1024, "Largest GraphPipe request body; a larger one is refused without being read."
    )
    max_batch: int = setting(256, "Most rows (prompts or token rows) in one GraphPipe request.")


@dataclass(frozen=True)
class Evergreen(Group):
    """Owned by codecs/evergreen and gateway/playground."""

    title: ClassVar[str] = "Evergreen"
    prefix: ClassVar[str] = "evergreen_"

    max_nodes: int = setting(10_000, "Evergreen: nodes one session may hold (abort past it).")
    max_bytes: int = setting(64 * 1024 * 1024, "Evergreen: bytes of node data one session may hold.")
    max_depth: int = setting(32, "Evergreen: deepest nesting of nodes allowed in one session.")
    max_tokens: int = setting(
        256, "Evergreen: max_tokens for a GENERATE whose config sets none (capped by what is left of the context)."
    )
    file_root: str | None = setting(
        None, "Evergreen: folder that file:// chunk refs may read from (unset: file:// refs are refused)."
    )
    http_refs: bool = setting(False, "Evergreen: fetch http(s):// chunk refs (off: refused).")
    ref_max_bytes: int = setting(16 * 1024 * 1024, "Evergreen: largest payload a file/http(s) ref may hold.")
    ref_timeout_s: float = setting(10.0, "Evergreen: time limit for fetching one http(s) ref.")


@dataclass(frozen=True)
class GRPC(Group):
    title: ClassVar[str] = "gRPC"
    prefix: ClassVar[str] = "grpc_"

    max_message_bytes: PositiveInt = setting(64 * 1024 * 1024, "Largest gRPC message accepted or sent.")
