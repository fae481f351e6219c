"""Entry point of the ``triton-mla-sparse`` command."""

from __future__ import annotations

import argparse
import sys

from .. import __version__

# every subcommand's help shows its defaults
HELP_FORMAT = argparse.ArgumentDefaultsHelpFormatter


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
    p.set_defaults(run=verify.main)
    p = sub.add_parser(
        "bench",
        help="time the kernel over a grid of shapes (GPU)",
        description=bench.DESCRIPTION,
        formatter_class=HELP_FORMAT,
    )
    bench.add_args(p)
    p.set_defaults(run=bench.main)
    p = sub.add_parser(
        "doctor",
        help="which attention backend vLLM selects for a model on this (or a given) GPU",
        description=doctor.DESCRIPTION,
        formatter_class=HELP_FORMAT,
    )
    doctor.add_doctor_args(p)
    p.set_defaults(run=doctor.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
