"""`kvcache serve`: an OpenAI-compatible HTTP server on the engine (continuous batching over one
paged KV pool, prefix sharing across requests).

    kvcache serve                                  # the bundled model on http://127.0.0.1:8000/v1
    kvcache serve --model DIR --port 8080 --api-key "$KEY" --kv-budget 2GiB --max-running 32

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, POST /tokenize,
/detokenize and /apply-template, GET /health, GET /metrics (Prometheus). Binds 127.0.0.1 unless
--host says otherwise. SIGTERM or Ctrl-C: stop accepting, let running requests finish for
--drain-seconds, cancel the rest, exit 0; a second one cancels them at once (each answer still
ends in order) and exits 130.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvcache.cli._args import (
    WEIGHTS_HELD_TWICE,
    activations_of,
    add_activations,
    add_kv_cache_dtype,
    folder_argument,
    kv_dtype_of,
    kv_window_of,
    nonnegative_int,
    positive_int,
    size_argument,
)
from kvcache.cli._pin_file import (
    MAX_PINNED_PROMPTS,
    PIN_FILE_BYTES,
    pin_prompts,
    read_pin_file,
    refuse_with_tenants,
)
from kvcache.cli._status import BAR_AFTER_S, compiling_said, say_weights
from kvcache.defaults import BACKEND_NAMES, DEFAULT_MODEL_DIR, resolve_model_dir
from kvcache.memory import format_bytes, parse_size
from kvcache.replicas.prefix_index import IMBALANCE, SHARED_IMBALANCE

LOOPBACK = ("127.0.0.1", "localhost", "::1")
SOCKET_BACKLOG = 2048  # (uvicorn's own)


def _checked(text: str, convert, fits, expected: str):
    """convert(text) when it is a value that fits; else an ArgumentTypeError saying `expected`."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not fits(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
    return value


def _port(text: str) -> int:
    return _checked(text, int, lambda value: 0 <= value <= 65535, "a port in [0, 65535] (0: any free port)")


def _slowdown(text: str) -> float:
    return _checked(text, float, lambda value: value == 0 or 1 < value < float("inf"),
                    "a number > 1, or 0 for none")


def _share(text: str) -> float:
    return _checked(text, float, lambda value: 0 <= value <= 1, "a share from 0 to 1")


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.epilog = WEIGHTS_HELD_TWICE
    parser.add_argument(
        "-m", "--model", help="local checkpoint folder or GGUF file; default: the bundled default model"
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    parser.add_argument(
        "--port", type=_port, default=8000, help="default 8000; 0 picks a free port (printed)"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("KVCACHE_API_KEY") or None,
        help="require 'Authorization: Bearer KEY' on every route but /health "
        "(default: $KVCACHE_API_KEY, else no key; an empty key means none)",
    )
    parser.add_argument(
        "--api-keys", metavar="FILE",
        help="one key a line, 'KEY', 'KEY TENANT' or 'KEY TENANT admin': each tenant's requests get a "
        "cache salt of their own (a tenant's prefix never answers another's cached_tokens; a request's "
        "cache_salt is combined with it), and /metrics answers admin keys only (--api-key is one)",
    )
    parser.add_argument(
        "--require-cache-salt", action="store_true",
        help="refuse (400) a request that sends no cache_salt, unless its key is a tenant's (--api-keys)",
    )
    parser.add_argument(
        "--restore-reasoning", action="store_true",
        help="put the reasoning of the server's own replies back into a chat history sent without it "
        "(as many clients send it), so the next turn matches the prefix cache up to where the chat "
        "template itself renders history otherwise; a history sent back whole is never changed "
        "(default off)",
    )
    parser.add_argument(
        "--canonical-history", action="store_true",
        help="render a chat message that differs from one rendered before (after the same history) only "
        "in whitespace or letter case, and tools sent in another order, in the form first rendered, so a "
        "client's cosmetic changes still match the prefix cache; a history sent as first rendered is "
        "never changed (default off)",
    )
    parser.add_argument(
        "--prerender-next-turn", action="store_true",
        help="when a chat reply ends, render the next turn's prefix (the history and the reply as a client "
        "sends it back) and run it as a one-token request in the background, so its blocks are in the "
        "prefix cache when the next turn comes (default off)",
    )
    parser.add_argument(
        "--served-model-name", help="the model id clients ask for (default: the folder's name)"
    )
    parser.add_argument(
        "--chat-template", metavar="FILE",
        help="a jinja chat template to render chat requests with instead of the model's own (e.g. one "
        "that renders tools: llama-server's --chat-template-file, vLLM's --chat-template)",
    )
    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--kv-budget",
        type=size_argument,
        default=parse_size("256MiB"),
        help="bytes for keys and values, e.g. 2GiB (default 256MiB)",
    )
    add_kv_cache_dtype(engine)
    engine.add_argument(
        "--kv-drift-sample", type=_share, default=0.0, metavar="SHARE",
        help="with a --kv-cache-dtype (int8, fp8, …): the share of requests (0 to 1, e.g. 0.01) that also "
        "run on a full-precision shadow pool, measuring how far the stored KV moved each next-token "
        "distribution (KL, top-1 agreement): per request as kv_drift beside usage, in /metrics as "
        "kvcache_kv_drift_* (default 0: off)",
    )
    engine.add_argument(
        "--speculate", choices=["ngram"], default=None,
        help="speculative decoding for every request that does not send \"speculate\": \"off\": ngram drafts "
        "by prompt lookup over the request's own tokens, verified in the batched decode steps (the same "
        "tokens; needs a GGUF with q8 activations, the 'blocks' backend); drafted and accepted tokens in "
        "/metrics as kvcache_spec_* (default: off; a request may still send \"speculate\": \"ngram\")",
    )
    engine.add_argument(
        "--block-size", type=positive_int, default=16, help="tokens per KV block (default 16)"
    )
    engine.add_argument(
        "--max-running", type=positive_int, default=16, help="sequences decoding at once (default 16)"
    )
    engine.add_argument(
        "--token-budget",
        type=positive_int,
        default=256,
        help="tokens one engine step runs, decode rows and prefill chunks (default 256)",
    )
    engine.add_argument(
        "--prefill-slowdown",
        type=_slowdown,
        default=2.0,
        help="while rows decode, a step with a prompt's tokens costs at most about this many "
        "steps of those rows alone (measured as it runs; default 2; 0: only --token-budget bounds it)",
    )
    engine.add_argument(
        "--backend", choices=BACKEND_NAMES, default="auto", help="the decode step (default auto)"
    )
    engine.add_argument(
        "--kv-store",
        metavar="URL",
        help="share prefix KV blocks with other replicas through Redis at URL "
        "(redis://HOST:PORT/DB; default: none). The server keeps serving if the store fails",
    )
    engine.add_argument(
        "--kv-disk",
        metavar="DIR",
        type=folder_argument,
        help="keep prefix KV blocks in files under DIR, so they survive a restart (read before "
        "--kv-store's Redis; one process per folder; default: none)",
    )
    engine.add_argument(
        "--kv-disk-size", type=size_argument, default=parse_size("8GiB"),
        help="the most --kv-disk's blocks take, least recently used evicted first (default 8GiB)",
    )
    engine.add_argument(
        "--kv-pin",
        metavar="FILE",
        help="prompts whose cached blocks are evicted last, in the pool and on --kv-disk: one JSON "
        "value a line, a text or a list of chat messages (e.g. a shared system prompt); each is "
        f"prefilled at start. A regular file of at most {MAX_PINNED_PROMPTS} prompts and "
        f"{PIN_FILE_BYTES >> 20} MiB",
    )
    engine.add_argument(
        "--kv-events",
        metavar="ENDPOINT",
        help="publish the pool's block events in vLLM's format on a ZeroMQ PUB socket bound at "
        "ENDPOINT (tcp://127.0.0.1:5557), for KV-aware routers (llm-d, Dynamo); default: none",
    )
    engine.add_argument(
        "--kv-events-topic", default="", metavar="TOPIC",
        help="the topic frame of every event message (default empty, as vLLM's)",
    )
    engine.add_argument(
        "--kv-events-replay", metavar="ENDPOINT",
        help="with --kv-events: bind a ZeroMQ ROUTER socket at ENDPOINT (tcp://127.0.0.1:5558) that "
        "replays the last 10,000 event batches from a sequence number a subscriber sends (8 bytes, "
        "big-endian), as vLLM's replay endpoint; default: none",
    )
    engine.add_argument(
        "--kv-events-connect", action="store_true",
        help="connect --kv-events' socket to ENDPOINT, where a router's indexer binds (llm-d's), "
        "instead of binding it",
    )
    engine.add_argument(
        "--kv-store-ttl",
        type=positive_int,
        default=3600,
        help="seconds a block written to the store lives (default 3600)",
    )
    engine.add_argument(
        "--replicas", type=positive_int, default=1, metavar="N",
        help="run N engine replicas on Ray Serve behind this server, each request routed to the "
        "replica holding its longest prefix (needs kvcache[ray]; default 1: this process alone)",
    )
    engine.add_argument(
        "--routing", choices=("prefix", "round-robin"), default="prefix",
        help="how --replicas are chosen: the one holding the prompt's longest prefix (default), or "
        "in turn (what prefix routing is measured against)",
    )
    engine.add_argument(
        "--routing-imbalance", type=nonnegative_int, default=IMBALANCE, metavar="N",
        help="with --routing prefix: requests a replica holding a conversation's earlier turns may "
        f"have over the least loaded one's before load decides (default {IMBALANCE}; a prefix "
        f"conversations share, such as a system prompt, holds only up to min(N, {SHARED_IMBALANCE}); "
        "lower spreads the load, higher keeps conversations on their replica, for more cache hits)",
    )
    engine.add_argument(
        "--ray-address", metavar="ADDR",
        help="the Ray cluster for --replicas (default: start a local one)",
    )
    engine.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default: as stored")
    add_activations(engine)
    engine.add_argument("--threads", type=positive_int, help="torch CPU threads")
    limits = parser.add_argument_group("limits")
    limits.add_argument(
        "--max-waiting",
        type=positive_int,
        default=256,
        help="requests queued or being prepared (their template, their tokens) before new ones "
        "get 429 (default 256)",
    )
    limits.add_argument(
        "--max-body-bytes", type=size_argument, default=1 << 20, help="request body limit (default 1MiB)"
    )
    limits.add_argument(
        "-c", "--ctx-size", type=positive_int,
        help="tokens of one request, prompt and max_tokens (default: the model's context or what "
        "--kv-budget holds, whichever is less)",
    )
    limits.add_argument(
        "--max-prompt-tokens", type=nonnegative_int, default=0, help="prompt limit (default 0: the context)"
    )
    limits.add_argument(
        "--max-tokens",
        type=nonnegative_int,
        default=0,
        help="the most max_tokens a request may ask (default 0: the context)",
    )
    limits.add_argument(
        "--default-max-tokens",
        type=positive_int,
        default=256,
        help="max_tokens of a request that gives none (default 256)",
    )
    limits.add_argument(
        "--drain-seconds",
        type=float,
        default=30.0,
        help="on SIGTERM or Ctrl-C, how long running requests may finish (default 30; a second signal "
        "cancels them at once)",
    )
    parser.add_argument(
        "--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
        help="uvicorn's log level (default warning)",
    )
    parser.add_argument(
        "--access-log", action=argparse.BooleanOptionalAction, default=True,
        help="a line per request on stderr: client, route, status, tokens, time (default on)",
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from kvcache.server.run import bind

    if args.threads:
        torch.set_num_threads(args.threads)
    try:  # the port first: a port in use is said before the model's seconds of loading
        sock = bind(args.host, args.port)
    except OSError as error:
        print(f"kvcache serve: error: cannot listen on {args.host}:{args.port}: {error}", file=sys.stderr)
        return 2
    try:
        keys = _api_keys(args)
    except (ValueError, OSError) as error:
        sock.close()
        print(f"kvcache serve: error: {error}", file=sys.stderr)
        return 2
    if args.replicas > 1:
        return _run_replicas(args, sock, keys)
    events = None
    try:
        refuse_with_tenants(args.kv_pin, args.api_keys, args.require_cache_salt)
        pinned = read_pin_file(args.kv_pin) if args.kv_pin else []  # (a bad file said before loading)
        events = _event_publisher(args)  # (a taken endpoint too)
        engine, tokenizer, context = _engine(args, events)
    except (ValueError, OSError) as error:  # RequestError, BackendError, ConfigError are ValueErrors
        sock.close()
        if events is not None:
            events.close()
        print(f"kvcache serve: error: {error}", file=sys.stderr)
        return 2
    if args.host not in LOOPBACK and not args.api_key and keys is None:
        print(
            f"kvcache serve: warning: listening on {args.host} without --api-key: anyone who reaches "
            "this address can use the model",
            file=sys.stderr,
        )
    print("kvcache serve: warming the engine up (untimed)…", file=sys.stderr, flush=True)
    with compiling_said("serve"):
        engine.warm_up()
    try:
        pin_prompts(engine, pinned, args.kv_pin, context)
    except ValueError as error:  # a chat template that refuses a pinned prompt, one too long
        sock.close()
        print(f"kvcache serve: error: {error}", file=sys.stderr)
        return 2
    settings = _settings(args, context, keys, _context_source(args, engine, context))
    return _serve_until_stopped(args, engine, tokenizer, settings, sock)


def _serve_until_stopped(args: argparse.Namespace, engine, tokenizer, settings, sock) -> int:
    """Listen on `sock`, serve until a signal, write the blocks still queued for the disk or Redis
    (within a bound) and close the engine: the exit status (130 when a second signal stopped it
    before its requests finished)."""
    from kvcache.engine import RequestError
    from kvcache.server.app import build_app
    from kvcache.server.run import serve

    sock.listen(SOCKET_BACKLOG)  # connections from now on wait for the server, none is refused
    _say_started(args, engine, settings, sock.getsockname()[:2])
    _log_requests(args.access_log)
    try:
        stopped_now = serve(build_app(engine, tokenizer, settings), engine, drain_s=args.drain_seconds,
                            sock=sock, log_level=args.log_level, notify=_say_stopping)
    except RequestError as error:
        print(f"kvcache serve: error: {error}", file=sys.stderr)
        return 2
    if engine.store_tier is not None:  # blocks still queued for the disk or Redis: written, within a bound
        engine.store_tier.store.flush(10.0)
    engine.close()
    print("kvcache serve: stopped", flush=True)
    return 130 if stopped_now else 0


def _run_replicas(args: argparse.Namespace, sock, keys=None) -> int:
    """`run` with --replicas: the engines on Ray Serve, this process the HTTP server."""
    from kvcache.server.app import build_app
    from kvcache.server.run import serve

    per_process = [flag for flag, value in (("--kv-events", args.kv_events), ("--kv-disk", args.kv_disk),
                                            ("--kv-pin", args.kv_pin),
                                            ("--kv-events-replay", args.kv_events_replay)) if value]
    if per_process:
        sock.close()
        print(f"kvcache serve: error: {', '.join(per_process)} cannot be used with --replicas yet (one "
              "process per socket, folder or pin list); share blocks with --kv-store", file=sys.stderr)
        return 2
    try:
        replicas, tokenizer = _replica_set(args)
        context = _context(args, replicas)
    except (ImportError, ValueError, OSError, ConnectionError) as error:
        sock.close()
        print(f"kvcache serve: error: {error}", file=sys.stderr)
        return 2
    settings = _settings(args, context, keys, _context_source(args, replicas, context))
    sock.listen(SOCKET_BACKLOG)
    host, port = sock.getsockname()[:2]
    routing = f"prefix, imbalance {args.routing_imbalance}" if args.routing == "prefix" else args.routing
    print(f"kvcache serve: {settings.model_name} on {args.replicas} replicas (Ray Serve, routed by "
          f"{routing}) on http://{host}:{port}/v1", flush=True)
    print(f"  KV pool per replica: {replicas.num_blocks} blocks of {args.block_size} tokens", flush=True)
    _log_requests(args.access_log)
    try:
        stopped_now = serve(build_app(replicas, tokenizer, settings), replicas, drain_s=args.drain_seconds,
                            sock=sock, log_level=args.log_level, notify=_say_stopping)
    finally:
        from kvcache.replicas.replica_set import stop_replicas

        stop_replicas(started_here=args.ray_address is None)
    print("kvcache serve: stopped", flush=True)
    return 130 if stopped_now else 0


def _say_stopping(line: str) -> None:
    """What a shutdown signal does, on stderr (`serve`'s notify)."""
    print(f"kvcache serve: {line}", file=sys.stderr, flush=True)


def _replica_set(args: argparse.Namespace):
    """(ReplicaSet, tokenizer) as the arguments say; ImportError naming the extra without Ray."""
    try:
        from kvcache.replicas.deployment import ReplicaSettings
        from kvcache.replicas.replica_set import start_replicas
    except ImportError:
        raise ImportError("--replicas needs Ray Serve: pip install 'kvcache[ray]'") from None
    from kvcache.text.tokenizer import load_tokenizer

    folder = Path(resolve_model_dir(args.model))
    tokenizer = with_chat_template(load_tokenizer(folder), args.chat_template)
    engine = _engine_arguments(args, args.kv_store)
    settings = ReplicaSettings(str(folder.resolve()), args.dtype, args.threads or 1, engine,
                               activations_of(args))
    return start_replicas(settings, args.replicas, address=args.ray_address,
                          policy=args.routing.replace("-", "_"), imbalance=args.routing_imbalance,
                          max_ongoing=args.max_running + args.max_waiting), tokenizer


def _engine_arguments(args: argparse.Namespace, kv_store) -> dict:
    """The Engine's keyword arguments the flags give, in this process or on each replica, its
    pool's second tier `kv_store` (a URL or a store object; None: none)."""
    from kvcache.engine.config import PoolConfig, SchedulerConfig

    pool = PoolConfig(kv_budget=args.kv_budget, block_size=args.block_size, kv_dtype=kv_dtype_of(args),
                      kv_window=kv_window_of(args), kv_store=kv_store)
    scheduler = SchedulerConfig(max_running=args.max_running, token_budget=args.token_budget,
                                prefill_slowdown=args.prefill_slowdown or None)
    return {"backend": args.backend, "pool": pool, "scheduler": scheduler,
            "kv_drift_sample": args.kv_drift_sample, "speculate": args.speculate}


def with_chat_template(tokenizer, path: str | None):
    """`tokenizer` rendering chats with the template in the file `path` (None: its own); ValueError
    or OSError naming --chat-template and the file."""
    if path is None:
        return tokenizer
    from kvcache.files import read_text
    from kvcache.text.chat_template import MAX_TEMPLATE_BYTES, compile_chat_template
    from kvcache.text.tokenizer import Tokenizer

    source = read_text(path, "--chat-template", MAX_TEMPLATE_BYTES)
    try:
        compile_chat_template(source)
    except Exception as error:  # noqa: BLE001 (jinja2's syntax error, named)
        raise ValueError(f"--chat-template {path}: not a jinja template kvcache can run: {error}") from None
    return Tokenizer(tokenizer.backend, tokenizer.special_tokens, source, tokenizer.add_bos_token)


def _event_publisher(args: argparse.Namespace):
    """--kv-events' publisher, its socket bound (None without the flag); ValueError or OSError
    naming the flag."""
    if args.kv_events is None:
        if args.kv_events_replay is not None:
            raise ValueError("--kv-events-replay replays --kv-events' batches: give --kv-events too")
        return None
    from kvcache.engine.kv_events import KVEventPublisher

    return KVEventPublisher(args.kv_events, topic=args.kv_events_topic, connect=args.kv_events_connect,
                            replay=args.kv_events_replay)


def _engine(args: argparse.Namespace, events=None):
    """(engine, tokenizer, context in tokens) as the arguments say, the model loaded with a bar on
    stderr; ValueError or OSError naming what is wrong (a --ctx-size the pool cannot hold, too).
    events: the pool's `KVEventPublisher`, or None."""
    from kvcache.engine import Engine
    from kvcache.model import load_model
    from kvcache.report.progress import ProgressBar
    from kvcache.text.tokenizer import load_tokenizer
    from kvcache.tiers.open import open_tiers

    kv_window_of(args)  # (a flag refused before the model loads)
    folder = Path(resolve_model_dir(args.model))
    model = load_model(folder, dtype=args.dtype, activations=activations_of(args),
                       progress=ProgressBar("kvcache serve: loading the model", after_s=BAR_AFTER_S))
    say_weights("serve", model)
    tokenizer = with_chat_template(load_tokenizer(folder), args.chat_template)
    if args.kv_drift_sample and kv_dtype_of(args) is None:
        raise ValueError("--kv-drift-sample compares a pool in a KV dtype of its own with full precision: "
                         "give --kv-cache-dtype (int8, fp8, …) too")
    store = open_tiers(args.kv_disk, disk_bytes=args.kv_disk_size, url=args.kv_store, ttl_s=args.kv_store_ttl)
    print(f"kvcache serve: building the engine (the weights laid out for its kernels, a KV pool of "
          f"{format_bytes(args.kv_budget)})…", file=sys.stderr, flush=True)
    engine = Engine(model, tokenizer, **_engine_arguments(args, store), kv_events=events)
    return engine, tokenizer, _context(args, engine)


def _context(args: argparse.Namespace, engine) -> int:
    """Tokens of one request, prompt and new ones: --ctx-size, else the model's context or what
    the KV pool holds, whichever is less. ValueError when --ctx-size passes either."""
    model_context = engine.model.config.max_position_embeddings
    # (a pool of sliding layers only holds sequences of any length)
    pool_tokens = engine.num_blocks * args.block_size if engine.num_blocks else model_context
    if args.ctx_size is None:
        return min(model_context, pool_tokens)
    if args.ctx_size > model_context:
        raise ValueError(f"--ctx-size {args.ctx_size} is past the model's context of {model_context} "
                         "tokens (max_position_embeddings)")
    if args.ctx_size > pool_tokens:
        raise ValueError(f"--ctx-size {args.ctx_size}: the KV pool holds {pool_tokens} tokens (--kv-budget "
                         f"{format_bytes(args.kv_budget)}); raise --kv-budget or lower --ctx-size")
    return args.ctx_size


def _api_keys(args: argparse.Namespace):
    """--api-keys' keys (with --api-key's among them as an admin's), None without the flag; a
    warning on stderr when others may read the file."""
    from kvcache.server.tenants import api_keys

    if args.api_keys is None:
        return None
    keys = api_keys(args.api_keys, args.api_key)
    if os.stat(args.api_keys).st_mode & 0o077:
        print(f"kvcache serve: warning: --api-keys {args.api_keys} may be read by other users "
              f"(chmod 600 it)", file=sys.stderr)
    if not any(tenant.admin for tenant in keys.tenants):
        print("kvcache serve: note: no admin key (a line 'KEY NAME admin' in --api-keys, or --api-key): "
              "/metrics answers no one", file=sys.stderr)
    return keys


def _context_source(args: argparse.Namespace, engine, context: int) -> str:
    """Why a request's context is `context` tokens, for the errors that cite it and the start-up
    line: "" when it is the model's own; else --ctx-size, or what --kv-budget holds and about what
    budget would hold the model's context (the budget scaled by the blocks it needs, in MiB)."""
    model_context = engine.model.config.max_position_embeddings
    if args.ctx_size is not None:
        return "--ctx-size"
    if context >= model_context or not engine.num_blocks:
        return ""
    wanted = -(-model_context // args.block_size)  # blocks of the model's context
    needed_mib = -(-args.kv_budget * wanted // (engine.num_blocks << 20))
    return (f"what the KV pool holds at --kv-budget {format_bytes(args.kv_budget)}; the model's context of "
            f"{model_context} tokens needs about --kv-budget {needed_mib}MiB")


def _settings(args: argparse.Namespace, context: int, keys=None, context_source: str = ""):
    from kvcache.server.app import ServerSettings

    folder = Path(resolve_model_dir(args.model))
    default_name = folder.stem if folder.is_file() else folder.name  # a GGUF file: its name less .gguf
    name = args.served_model_name or ("kvcache-default" if folder == DEFAULT_MODEL_DIR else default_name)
    return ServerSettings(
        model_name=name, api_key=args.api_key or None, max_body_bytes=args.max_body_bytes,
        max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens,
        default_max_tokens=args.default_max_tokens, max_waiting=args.max_waiting, context=context,
        api_keys=keys, require_cache_salt=args.require_cache_salt, context_source=context_source,
        restore_reasoning=args.restore_reasoning, canonical_history=args.canonical_history,
        prerender_next_turn=args.prerender_next_turn,
    )


def _say_started(args: argparse.Namespace, engine, settings, address) -> None:
    """The start-up lines on stdout: where, what, and how many sequences the pool holds."""
    host, port = address
    model = engine.model
    print(f"kvcache serve: {settings.model_name} ({model.dtype}, decode step {engine.backend.name}) on "
          f"http://{host}:{port}/v1", flush=True)
    context = settings.context
    stored = "" if kv_dtype_of(args) is None else f", keys/values stored as {kv_dtype_of(args)}"
    recent = engine.pool.cache.recent
    if recent is not None:  # (its slots for --max-running rows are allocated with the engine)
        stored += (f", the last {recent.window} tokens of each running sequence also in {model.dtype} "
                   f"({format_bytes(recent.nbytes)}, --kv-window)")
    print(f"  KV pool: {engine.num_blocks} blocks of {args.block_size} tokens "
          f"({format_bytes(engine.pool.cache.nbytes)}{stored}): {engine.capacity(context)} sequences of "
          f"{context} tokens (--ctx-size), {args.max_running} running at once", flush=True)
    if args.ctx_size is None and settings.context_source:  # the pool, not the model, sets the context
        print(f"  context: {context} tokens, {settings.context_source} (or give a --ctx-size it holds)",
              flush=True)
    fits = ", ".join(f"{count} at {dtype}" for dtype, count in engine.capacity_by_kv_dtype(context).items())
    print(f"  --kv-budget {format_bytes(args.kv_budget)} holds sequences of {context} tokens: {fits} "
          f"(--kv-cache-dtype)", flush=True)
    if engine.drift_probe is not None:
        shadow = engine.drift_probe.shadow
        print(f"  KV drift probe: {args.kv_drift_sample:g} of requests also run on a full-precision shadow "
              f"pool ({format_bytes(shadow.nbytes)}); kv_drift in their responses, kvcache_kv_drift_* in "
              f"/metrics", flush=True)
    if args.kv_disk:
        disk = engine.store_tier.store.tiers[0] if args.kv_store else engine.store_tier.store
        print(f"  KV disk: {args.kv_disk} ({disk.blocks()} blocks kept from before, "
              f"{format_bytes(disk.bytes)} of {format_bytes(args.kv_disk_size)})", flush=True)
    if args.kv_store:
        print(f"  KV store: {args.kv_store} (blocks live {args.kv_store_ttl} s)", flush=True)
    if args.kv_events:
        how = "connected to" if args.kv_events_connect else "bound at"
        replay = "" if args.kv_events_replay is None else f"; replay bound at {args.kv_events_replay}"
        print(f"  KV events: {how} {args.kv_events} (topic {args.kv_events_topic!r}, vLLM's format{replay})",
              flush=True)


def _log_requests(enabled: bool) -> None:
    """An access-log line per request on stderr (`kvcache.server.access_log`), unless turned off."""
    import logging

    from kvcache.server.access_log import LOGGER

    if enabled and not LOGGER.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.INFO if enabled else logging.WARNING)
    LOGGER.propagate = False
