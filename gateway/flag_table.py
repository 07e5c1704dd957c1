"""The flags of `switchyard serve`, by concern: one row per Settings field, from which the
parser, its help text and the environment variable names are all derived (flag_parser.py).

A row's default is the one that applies when neither the flag nor its variable is given: for
engine knobs, `EngineConfig`'s (backends/native/config.py; tests/gateway/test_flag_table.py
holds the two together), else the Settings field's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Note:
    """A default that is no single value (it depends on something, or means "none")."""

    text: str


@dataclass(frozen=True)
class Flag:
    setting: str  # the Settings field; its variable is SWITCHYARD_<SETTING>
    help: str
    default: str | Note  # a str is the value itself, as the flag would take it
    metavar: str = ""  # "": the choices, true|false, or N, from the field's type
    aliases: tuple[str, ...] = ()  # older spellings, still accepted
    switch: str = ""  # a flag taking no value that sets the field to `sets`
    sets: bool = False
    # argparse refuses a value outside the field's choices (these flags always did); others
    # are checked by Settings, as their variables are
    parser_checks: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        primary = self.switch or "--" + self.setting.replace("_", "-")
        return (primary, *self.aliases)


@dataclass(frozen=True)
class Group:
    title: str
    flags: tuple[Flag, ...]


_TRUE = "true"

MODEL = Group("model and weights", (
    Flag("model_id", "a Hugging Face model folder, a .gguf file, or 'default' (no Hub "
         "downloads)", "default", metavar="PATH"),
    Flag("served_model_name", "the name clients use", Note("the model id"), metavar="NAME"),
    Flag("backend", "what runs the model: native | transformers | remote | tgi", "native",
         metavar="NAME"),
    Flag("task", "what the --model-id model serves: generate (chat, completions, TGI's "
         "routes) or embed (/v1/embeddings only); a models file sets each model's `task:`",
         "generate"),
    Flag("config_file", "YAML file declaring models, aliases, deployments, routing and keys "
         "(without it: the one model --model-id names)", Note("none"), metavar="PATH"),
    Flag("sampling_defaults", "every model's sampling defaults, a JSON object (temperature, "
         "top_p, top_k, min_p, repetition_penalty); a model's `defaults:` in the models file "
         "win", Note("the checkpoint's generation_config"), metavar="JSON"),
    Flag("device", "cpu | cuda | cuda:N", "cpu", metavar="DEVICE"),
    Flag("dtype", "auto: on CPU bfloat16 where bf16 matmul is native, else float32; "
         "float16 on CUDA", "auto"),
    Flag("quantize", "gptq | awq | gguf as the checkpoint is; eetq | bitsandbytes | "
         "bitsandbytes-nf4 | bitsandbytes-fp4 quantize at load; none: dense (dequantizes a "
         ".gguf)", Note("as the checkpoint is"), metavar="FORMAT"),
    Flag("cache_dir", "startup cache (GGUF metadata, tokenizer, packed weights, compiled "
         "kernels); 'none' turns it off", "~/.cache/switchyard", metavar="PATH"),
))

ENGINE = Group("engine and kernels", (
    Flag("num_threads", "CPU threads for the model", Note("torch's default")),
    Flag("cpu_kernels", "which of our C++ CPU kernels to build: auto picks by CPU; required "
         "is auto, but a build failure stops the load instead of falling back to torch's "
         "kernels; off keeps torch's kernels", "auto"),
    Flag("quantized_kernels", "GPTQ / AWQ kernels: auto (gptqmodel's CUDA kernels when "
         "installed and one fits, else native), native (ours), gptqmodel (forced)", "auto",
         parser_checks=True),
    Flag("compile", "torch.compile the decode attention", _TRUE),
    Flag("compile_decode_step", "with --compile: decode-only steps through compiled regions "
         "(faster decode, a few seconds more at start)", _TRUE),
    Flag("compile_prefill_step", "with --compile: prefill and mixed steps, each layer's norms, "
         "projections, rotary and MLP compiled around its attention",
         Note("true for dense weights, false for quantized ones")),
    Flag("prepack_weights", "CPU: dense weights prepacked for oneDNN at load", _TRUE),
    Flag("bf16_linear_kernel", "CPU, bf16: prepacked linears through our kernel where the CPU "
         "has AVX-512-BF16 (false: oneDNN)", _TRUE),
    Flag("f32_linear_kernel", "CPU, float32: prepacked linears through our AVX2 FMA kernel "
         "where our kernels run AVX2 code, i.e. AVX2-only CPUs (false: oneDNN)", _TRUE),
    Flag("greedy_head", "CPU, bf16 lm_head on our kernel: greedy steps pick each token from an "
         "int8 bound and a few exact logits, the token the full logits give", _TRUE),
    Flag("attention_kernels", "CPU, with --compile: decode and prompt attention through our "
         "C++ kernels where they are built (false: inductor's code and torch's SDPA)", _TRUE),
))

BATCHING = Group("batching and KV cache", (
    Flag("max_batch_size", "most sequences in one step", "64"),
    Flag("max_batch_prefill_tokens", "most tokens in one step, decode rows included when "
         "chunked", Note("512 on CPU with chunked prefill, else 4096")),
    Flag("max_batch_total_tokens", "KV cache capacity in tokens",
         Note("what --kv-cache-memory holds")),
    Flag("kv_cache_memory", "KV cache budget: bytes (8GiB, 512M) or a fraction of free memory "
         "(0.9)", "2GiB", metavar="SIZE"),
    Flag("block_size", "tokens per KV cache block", "16"),
    Flag("chunked_prefill", "prefill each prompt whole, in one step", _TRUE,
         switch="--no-chunked-prefill", sets=False),
    Flag("prefix_caching", "reuse the KV blocks of shared prompt prefixes", _TRUE),
    Flag("waiting_served_ratio", "without chunked prefill: waiting/running ratio that lets new "
         "requests join", "1.2", metavar="RATIO"),
    Flag("max_waiting_tokens", "without chunked prefill: decode steps after which waiting "
         "requests join anyway", "20"),
))

QUEUES = Group("queues and timeouts", (
    Flag("max_concurrent_requests", "requests in flight before new ones get 429", "128"),
    Flag("max_queued_requests", "requests waiting beyond the running batch before new ones "
         "get 429", Note("unbounded")),
    Flag("max_queued_tokens", "prompt tokens waiting to be scheduled before new requests get "
         "429", Note("unbounded")),
    Flag("queue_timeout", "seconds a request may wait to be scheduled, then 503", Note("none"),
         metavar="SECONDS"),
    Flag("request_timeout", "seconds a request may take in all, then it is stopped",
         Note("none"), metavar="SECONDS"),
    Flag("shutdown_timeout", "seconds in-flight requests may finish after SIGTERM", "30",
         metavar="SECONDS"),
))

LIMITS = Group("request limits", (
    Flag("max_input_tokens", "longest prompt in tokens", Note("--max-total-tokens - 1"),
         aliases=("--max-input-length",)),
    Flag("max_total_tokens", "prompt + generated tokens per request",
         Note("the model's context, at most 4096")),
    Flag("max_output_tokens", "most tokens a request may generate: a larger max_tokens / "
         "max_new_tokens is refused, an omitted one is capped",
         Note("only --max-total-tokens bounds it")),
    Flag("max_request_body_bytes", "largest request body (bytes, or 8MiB, 512K); larger ones "
         "get 413", "8MiB", metavar="SIZE", aliases=("--payload-limit",)),
    Flag("max_messages", "most chat messages in one request", "2048"),
    Flag("max_stop_sequences", "most stop strings in one request (as OpenAI and TGI)", "4"),
    Flag("max_stop_length", "longest stop string in characters", "512"),
    Flag("max_embedding_inputs", "most inputs in one /v1/embeddings request (OpenAI's "
         "limit)", "2048"),
))

SERVER = Group("server and auth", (
    Flag("hostname", "address to listen on", "127.0.0.1", metavar="HOST"),
    Flag("port", "port to listen on", "8080"),
    Flag("playground", "do not serve the chat page at /playground", _TRUE,
         switch="--no-playground", sets=False),
    Flag("admin_key", "admin key for /admin/keys; turns API keys on (prefer the variable: "
         "flags show in ps)", Note("none"), metavar="KEY"),
    Flag("redis_url", "Redis for keys, limits and usage shared by replicas "
         "(redis://host:6379/0)", Note("none"), metavar="URL"),
    Flag("auth_fail_open", "while Redis is unreachable, serve keys validated in the last "
         "--auth-fail-open-ttl seconds, without limits (else 503)",
         "false", switch="--auth-fail-open", sets=True),
    Flag("auth_lease_ttl", "seconds a parallel-request slot outlives a crashed replica", "600",
         metavar="SECONDS"),
    Flag("auth_fail_open_ttl", "how recently --auth-fail-open needs a key validated", "300",
         metavar="SECONDS"),
    Flag("responses_ttl", "seconds a stored /v1/responses answer is kept (in Redis with "
         "--redis-url, else under --cache-dir)", "2592000", metavar="SECONDS"),
    Flag("cors_allow_origins", "comma-separated web origins (https://app.example) allowed to "
         "call from a browser: CORS for them; without keys, other pages' requests are refused",
         Note("none: the gateway's own origin alone"), metavar="ORIGINS"),
))

LOGGING = Group("logging and metrics", (
    Flag("log_level", "how much to log", "info"),
    Flag("log_format", "text, or json: one JSON object per line, with an access line per "
         "request", "text"),
    Flag("metrics_auth", "who may read /metrics: anyone, any API key, or the admin key only",
         "open", parser_checks=True),
))

GROUPS: tuple[Group, ...] = (MODEL, ENGINE, BATCHING, QUEUES, LIMITS, SERVER, LOGGING)
# Settings fields with no flag of their own: another field's older name.
ALIASES: frozenset[str] = frozenset({"max_input_length"})


def all_flags() -> tuple[Flag, ...]:
    return tuple(flag for group in GROUPS for flag in group.flags)
