"""The `chatloom` command.

Every subcommand is an argparse subparser that sets `func` with set_defaults; `main`
calls `args.func(args)`. Other rooms add their own commands through a
`register(subparsers)` function (chatloom.cli.serve, chatloom.cli.bench).

Problems the user can fix (a missing or corrupt model file, an unknown model id, a
prompt longer than the context window, an out-of-range option) end the command with
one line on stderr, "chatloom: error: ...", and exit status 2; never a traceback.
"""
from __future__ import annotations

import argparse
import sys
from typing import NoReturn, TextIO

from chatloom.argtypes import float_in, int_at_least, positive_float, positive_int
from chatloom.model_args import add_model_args, load_from_args
from chatloom.cli.model_info import cmd_capacity, cmd_models

PROG = "chatloom"
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class CLIError(Exception):
    """A problem with the user's input, reported as one line."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line: `chatloom: error: ...`."""

    def error(self, message: str) -> NoReturn:
        sub = self.prog[len(PROG):].strip()
        hint = f" (see `{self.prog} --help`)"
        where = f"{sub}: " if sub else ""
        self.exit(EXIT_USAGE, f"{PROG}: error: {where}{message}{hint}\n")


# -- argument types (checked before any model is loaded) ----------------------------

_temperature = float_in(0.0, 100.0, "must be between 0 (greedy) and 100")
_top_p = float_in(0.0, 1.0, "must be in (0, 1]", lo_open=True)
_top_k = int_at_least(-1, "must be 0 or -1 (off) or a positive integer")


# -- helpers -----------------------------------------------------------------------

def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    """The sampling flags; their defaults are the settings tree's (CHATLOOM_SAMPLING__* applies too)."""
    from chatloom.settings import environment_settings

    d = environment_settings().sampling
    p.add_argument("--max-tokens", type=positive_int, default=d.max_tokens, metavar="N",
                   help=f"most tokens to generate (default {d.max_tokens})")
    p.add_argument("--temperature", type=_temperature, default=d.temperature, metavar="T",
                   help=f"sampling temperature; 0 means greedy (default {d.temperature})")
    p.add_argument("--top-p", type=_top_p, default=d.top_p, metavar="P", help=f"nucleus sampling mass (default {d.top_p})")
    p.add_argument("--top-k", type=_top_k, default=d.top_k, metavar="K",
                   help=f"sample among the K likeliest tokens (default {d.top_k}; 0: off)")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="seed for reproducible sampling")


def _sampling_params(args: argparse.Namespace):
    from chatloom.engine import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)


def _one_window_kv(args: argparse.Namespace):
    return lambda cfg: (min(cfg.max_position, 8192) + 32) * cfg.kv_bytes_per_token(args.dtype)


def _engine(loaded, seed: int | None):
    """An engine sized for one conversation at a time: a KV pool of one context window."""
    from chatloom.engine import EngineConfig, LLMEngine

    context = min(loaded.config.max_position, 8192)
    block = 16
    return LLMEngine(loaded, EngineConfig(block_size=block, num_blocks=-(-context // block) + 1,
                                          max_num_seqs=4, seed=seed))


def stream(engine, prompt, params, out: TextIO):
    """Run one request to its end, writing its text to `out` as it is produced."""
    rid = engine.add_request(prompt, params)
    try:
        while True:
            outputs = engine.step()
            for o in outputs:
                if o.request_id != rid:
                    continue
                if o.delta_text:
                    out.write(o.delta_text)
                    out.flush()
                if o.finished:
                    return o
            if not outputs and not engine.has_unfinished_requests():
                raise RuntimeError("the engine stopped without finishing the request")
    except BaseException:
        engine.abort(rid)
        raise


# -- generate ------------------------------------------------------------------------

def cmd_generate(args: argparse.Namespace) -> int:
    if args.system is not None and not args.chat:
        raise CLIError("--system needs --chat")
    from chatloom.models.chat_template import encode_chat

    # The KV pool _engine allocates (one context window and a block) is checked with the weights.
    loaded = load_from_args(args, kv_cache_bytes=_one_window_kv(args))
    engine = _engine(loaded, args.seed)
    tok = loaded.tokenizer
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system is not None else []
        prompt = encode_chat(tok, messages + [{"role": "user", "content": args.prompt}])
    else:
        prompt = tok.encode(args.prompt)
    final = stream(engine, prompt, _sampling_params(args), sys.stdout)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.verbose:
        m = final.metrics
        tpot = f", {1 / m.tpot:.1f} tokens/s" if m and m.tpot else ""
        print(f"[{final.num_prompt_tokens} prompt + {final.num_output_tokens} output tokens, "
              f"finish: {final.finish_reason}, load {loaded.load_seconds:.1f} s{tpot}]", file=sys.stderr)
    return 0


# -- chat ----------------------------------------------------------------------------

CHAT_HELP = "commands: /reset forgets the conversation, /exit (or end of input) quits"


def cmd_chat(args: argparse.Namespace) -> int:
    from chatloom.models.chat_template import encode_chat

    interactive = sys.stdin.isatty()
    # The KV pool _engine allocates (one context window and a block) is checked with the weights.
    loaded = load_from_args(args, kv_cache_bytes=_one_window_kv(args))
    engine = _engine(loaded, args.seed)
    tok = loaded.tokenizer
    params = _sampling_params(args)
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    history: list[dict] = []
    # Leave room for the answer; drop the oldest turns when the conversation outgrows it.
    budget = engine.max_model_len - min(args.max_tokens, engine.max_model_len // 2)
    if interactive:
        try:
            import readline  # noqa: F401  (line editing for input())
        except ImportError:
            pass
        print(f"chatloom chat with {loaded.id} ({CHAT_HELP})", file=sys.stderr)
    while True:
        try:
            line = input(">>> ") if interactive else sys.stdin.readline()
        except EOFError:
            line = ""
        if not line:  # end of input
            if interactive:
                print(file=sys.stderr)
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit", "/bye"):
            return 0
        if text == "/reset":
            history.clear()
            continue
        if text in ("/help", "/?"):
            print(CHAT_HELP, file=sys.stderr)
            continue
        history.append({"role": "user", "content": text})
        prompt = encode_chat(tok, system + history)
        while len(prompt) > budget and len(history) > 1:
            del history[:2]  # the oldest user message and its answer
            prompt = encode_chat(tok, system + history)
        try:
            final = stream(engine, prompt, params, sys.stdout)
        except KeyboardInterrupt:
            if not interactive:
                raise
            print("\n[stopped]", file=sys.stderr)
            history.pop()
            continue
        except ValueError as exc:  # InvalidRequest: e.g. one message longer than the window
            print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr)
            history.pop()
            continue
        sys.stdout.write("\n" if interactive else "\n\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": final.text})


# -- the parser and main ---------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    from chatloom.cli import serve as serve_cli
    from chatloom.cli import bench as bench_cli
    from chatloom.cli import batch as batch_cli
    from chatloom.cli import sim as sim_cli
    from chatloom.cli import autoscale_sim
    from chatloom.cli import replica as replica_cli

    parser = _Parser(prog=PROG, description="chatloom: a self-hostable chat service and LLM serving engine")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("generate", help="complete one prompt, streaming the text to stdout")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user message")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    add_model_args(p)
    _add_sampling_args(p)
    p.add_argument("-v", "--verbose", action="store_true", help="print token counts and speed to stderr")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="multi-turn chat in the terminal (reads stdin; /exit or end of input quits)")
    p.add_argument("--system", default=None, help="system message")
    add_model_args(p)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("models", help="the models chatloom knows, with their KV-cache cost")
    p.add_argument("specs", nargs="*", metavar="MODEL", help="describe these ids or paths instead of the registry")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("capacity", help="how many tokens and conversations fit in a KV-cache memory budget, "
                                         "or in the pool the engine gives the model by default")
    p.add_argument("--model", required=True, metavar="ID|PATH|CONFIG.json",
                   help="registry id, GGUF file, HF folder or config.json; "
                        "or a shipped example by name (llama-70b)")
    mem = p.add_mutually_exclusive_group()
    mem.add_argument("--memory-gb", type=positive_float, metavar="X", help="KV-cache memory in GB (10^9 bytes)")
    mem.add_argument("--memory-gib", type=positive_float, metavar="X", help="KV-cache memory in GiB (2^30 bytes)")
    p.add_argument("--context", type=positive_int, default=None, metavar="N",
                   help="tokens per conversation (default 8000 with a memory budget; without one, the "
                        "context window the engine gives the model)")
    p.add_argument("--dtype", choices=("fp16", "bf16", "fp8", "fp32"), default=None,
                   help="KV-cache dtype (default fp16 with a memory budget; without one, what the engine "
                        "chooses: fp32 in the exact mode)")
    p.add_argument("--weights", choices=("F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "all"),
                   default=None, help="also print the memory the weights take in chatloom when the model's "
                                      "file is stored this way (all: every type)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_capacity)

    serve_cli.register(sub)
    replica_cli.register(sub)
    bench_cli.register(sub)
    batch_cli.register(sub)
    sim_cli.register(sub)
    autoscale_sim.register(sub)
    return parser


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        func = getattr(args, "func", None)
        if func is None:  # a command group given without its subcommand
            raise CLIError(f"{args.command} needs a subcommand (see `{PROG} {args.command} --help`)")
        return int(func(args) or 0)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): stop quietly.
        try:
            sys.stdout = open("/dev/null", "w")  # noqa: SIM115  (no flush error at exit)
        except OSError:
            pass
        return 1
    except (CLIError, ValueError, OSError) as exc:
        print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:
        from chatloom.models import ModelError

        if isinstance(exc, ModelError):
            print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr)
            return EXIT_USAGE
        raise


if __name__ == "__main__":
    sys.exit(main())
