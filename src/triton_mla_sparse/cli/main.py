"""Entry point of the ``triton-mla-sparse`` command."""

from __future__ import annotations

import argparse
import sys

from .. import __version__


class HelpFormat(argparse.ArgumentDefaultsHelpFormatter):
    """Every subcommand's help shows its defaults; an option whose default is None (absent, or
    a default the option's help states itself) shows none rather than "(default: None)"."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


HELP_FORMAT = HelpFormat


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="triton-mla-sparse",
        description="Sparse MLA attention in Triton: check, time and diagnose on this machine.",
        formatter_class=HELP_FORMAT,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{verify,bench,doctor}")
    from . import bench, doctor, verify

    p = sub.add_parser(
        "verify",
        help="run the kernel against the reference on the default workload",
        description=verify.DESCRIPTION,
        formatter_class=HELP_FORMAT,
    )
    verify.add_args(p)
    p.set_defaults(run=verify.main, check=None, parser=p)
    p = sub.add_parser(
        "bench",
        help="time the kernel over a grid of shapes (GPU)",
        description=bench.DESCRIPTION,
        formatter_class=HELP_FORMAT,
    )
    bench.add_args(p)
    p.set_defaults(run=bench.main, check=bench.check_args, parser=p)
    p = sub.add_parser(
        "doctor",
        help="which attention backend vLLM selects for a model on this (or a given) GPU",
        description=doctor.DESCRIPTION,
        formatter_class=HELP_FORMAT,
    )
    doctor.add_doctor_args(p)
    p.set_defaults(run=doctor.run, check=None, parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # checks across options: a usage error of the subcommand (exit 2) before anything runs
    problem = args.check(args) if args.check is not None else None
    if problem:
        args.parser.error(problem)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
