"""The flags of `met serve` that are the server's own; the engine flags come from EngineArgs."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from metrale.entrypoints.parsers import REASONING_PARSER_NAMES, TOOL_CALL_PARSER_NAMES

DEFAULT_MAX_BODY_BYTES = 16 << 20
DEFAULT_MAX_HEADER_BYTES = 32 << 10


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server options")
    group.add_argument("--host", default="127.0.0.1", help="Address to listen on (0.0.0.0: every interface)")
    group.add_argument("--port", type=int, default=8000, help="Port to listen on")
    group.add_argument("--served-model-name", default=None,
                       help="The model name clients send and /v1/models lists; default: 'demo' for the "
                            "built-in model, else the --model value")
    group.add_argument("--api-key", default=None,
                       help="Require 'Authorization: Bearer KEY' on every route but /health. A key on the "
                            "command line shows in `ps`: prefer --api-key-file or the MET_API_KEY variable")
    group.add_argument("--api-key-file", default=None, metavar="PATH",
                       help="Read the API key from this file (its first line)")
    group.add_argument("--max-waiting", type=int, default=512,
                       help="Most requests (counting each of n completions) queued beyond --max-num-seqs; "
                            "the next one gets 503 with Retry-After")
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="Seconds SIGTERM waits for in-flight requests before aborting them")
    group.add_argument("--max-n", type=int, default=16, help="Largest n (completions per request) accepted")
    group.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                       help="Largest request body; a larger one gets 413")
    group.add_argument("--max-header-bytes", type=int, default=DEFAULT_MAX_HEADER_BYTES,
                       help="Largest request line plus headers; larger ones get 431")
    group.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=False,
                       help="Log one line per HTTP request")
    group.add_argument("--check-kernels", action="store_true",
                       help="Start up to the kernel audit, print every Triton kernel variant the forward launches "
                            "(compiled, cached, interpreted or unresolved), and exit with the unresolved count; on a "
                            "CPU the kernels run through Triton's interpreter")
    group.add_argument("--profile", default=None, metavar="DIR",
                       help="Enable POST /start_profile and /stop_profile: the PyTorch profiler over chosen engine "
                            "steps, traces written to DIR (vLLM's routes)")
    group.add_argument("--stall-timeout", type=float, default=120.0,
                       help="GET /health answers 503 while one engine step has run longer than this many seconds "
                            "(0: never)")
    group.add_argument("--reasoning-parser", choices=REASONING_PARSER_NAMES, default=None,
                       help="Split the model's reasoning (<think>...</think>) from its answer into "
                            "reasoning_content, in this family's format")
    group.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSER_NAMES, default=None,
                       help="The format the model writes tool calls in, for tool_choice auto")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="Accept tool_choice auto (the default when a request has tools): the model's output "
                            "is parsed for calls with --tool-call-parser")


API_KEY_VARIABLE = "MET_API_KEY"


def api_key_of(args: argparse.Namespace, environ=None) -> str | None:
    """The key from --api-key, --api-key-file or $MET_API_KEY (one of them at most), or None."""
    env = os.environ if environ is None else environ
    given = [name for name, value in (("--api-key", args.api_key), ("--api-key-file", args.api_key_file),
                                      (API_KEY_VARIABLE, env.get(API_KEY_VARIABLE))) if value is not None]
    if len(given) > 1:
        raise ValueError(f"give the API key one way, not {' and '.join(given)}")
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read --api-key-file {args.api_key_file}: {e}") from None
    else:
        key = args.api_key if args.api_key is not None else env.get(API_KEY_VARIABLE)
    if key is not None and not key.strip():
        raise ValueError(f"the API key from {given[0]} is empty")
    return key


@dataclass(frozen=True)
class ServerConfig:
    host: str
    port: int
    served_model_name: str
    api_key: str | None
    max_waiting: int
    shutdown_timeout: float
    max_n: int
    max_body_bytes: int
    max_header_bytes: int
    access_log: bool
    stall_timeout: float = 120.0
    profile_dir: str | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerConfig":
        from metrale.messages.sampling_params import MAX_N

        name = args.served_model_name or ("demo" if args.model in (None, "demo") else args.model)
        checks = [
            (0 <= args.port <= 65535, f"--port must be in 0..65535 (0: any free port), got {args.port}"),
            (args.max_waiting >= 0, f"--max-waiting must be >= 0, got {args.max_waiting}"),
            (args.shutdown_timeout >= 0, f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}"),
            (1 <= args.max_n <= MAX_N, f"--max-n must be in 1..{MAX_N}, got {args.max_n}"),
            (args.max_body_bytes >= 1024, f"--max-body-bytes must be at least 1024, got {args.max_body_bytes}"),
            (args.max_header_bytes >= 1024,
             f"--max-header-bytes must be at least 1024, got {args.max_header_bytes}"),
            (args.stall_timeout >= 0, f"--stall-timeout must be >= 0, got {args.stall_timeout}"),
            (not getattr(args, "enable_auto_tool_choice", False) or getattr(args, "tool_call_parser", None),
             "--enable-auto-tool-choice needs --tool-call-parser (the format the model writes calls in)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        return cls(args.host, args.port, name, api_key_of(args), args.max_waiting, args.shutdown_timeout, args.max_n,
                   args.max_body_bytes, args.max_header_bytes, args.access_log, args.stall_timeout,
                   getattr(args, "profile", None), getattr(args, "reasoning_parser", None),
                   getattr(args, "tool_call_parser", None), bool(getattr(args, "enable_auto_tool_choice", False)))
