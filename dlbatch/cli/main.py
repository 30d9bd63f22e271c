"""`dlbatch` command line. Heavy imports live inside the command functions so that
`dlbatch --help` answers at once."""
from __future__ import annotations

import argparse
import sys

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="run the engine on one prompt and print the completion")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", default="smollm2-135m-instruct", help="alias, HF model directory or GGUF file/URL")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-chat", action="store_true", help="do not apply the model's chat template")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    from dlbatch.engine.llm import LLM
    from dlbatch.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
              chat=False if args.no_chat else None)
    out = llm.generate([args.prompt], params)[0]
    print(out.text)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dlbatch",
        description="Batch LLM inference for long documents: Ray Data pipeline, own engine, "
                    "prefill/decode disaggregation, prefix-aware routing and a PD solver.")
    from dlbatch import __version__

    parser.add_argument("--version", action="version", version=f"dlbatch {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_generate(sub)
    for register in _extra_commands():
        register(sub)
    return parser


def _extra_commands():
    from dlbatch import bench
    from dlbatch.cli import batch, cluster, jobs, solver, validate

    return [jobs.register, batch.register, validate.register, bench.register, cluster.register, solver.register]




def main(argv: list[str] | None = None) -> int:
    """Run one command. What it writes to stdout and stderr (messages, log, tracebacks) goes
    through `connectors.secrets.redacting_streams`: a credential resolved from ``${env:NAME}``
    is never printed."""
    from connectors.secrets import redacting_streams

    parser = build_parser()
    args = parser.parse_args(argv)
    with redacting_streams():
        return _run(parser, args)


def _run(parser: argparse.ArgumentParser, args) -> int:
    import logging

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_INVALID
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:  # bad user input (a value, a path): say what and exit 2
        if args.verbose:
            raise
        print(f"error: {e if isinstance(e, ValueError) else f'{type(e).__name__}: {e}'}", file=sys.stderr)
        return EXIT_INVALID
    except Exception as e:  # never a traceback unless asked for (-v)
        if args.verbose:
            raise
        print(f"error: {type(e).__name__}: {e} (dlbatch -v ... shows the traceback)", file=sys.stderr)
        return EXIT_FAILED


def entry() -> None:
    """The `dlbatch` command: run main, then leave without the interpreter's teardown.

    Native thread pools loaded along the way (Arrow's, behind every parquet read) can abort
    the process while the interpreter tears itself down: `std::terminate` on a thread still
    joinable (apache/arrow#34314), so a job that finished and committed everything would exit
    -6. By the time main returns, output is committed and the local Ray (if we started one)
    is shut down; what is left to do is disconnect from a cluster and flush, done here."""
    import logging
    import os

    rc = main()
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


