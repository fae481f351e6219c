"""Entry point of the ``triton-mla-sparse`` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="triton-mla-sparse",
        description="Sparse MLA attention in Triton: check, time and diagnose on this machine.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    from . import bench, doctor, verify

    p = sub.add_parser(
        "verify", help="run the kernel against the reference on the default workload"
    )
    verify.add_args(p)
    p.set_defaults(run=verify.main)
    p = sub.add_parser("bench", help="time the kernel over a grid of shapes (GPU)")
    bench.add_args(p)
    p.set_defaults(run=bench.main)
    p = sub.add_parser("doctor", help="what vLLM would select on this (or a given) GPU, and why")
    doctor.add_doctor_args(p)
    p.set_defaults(run=doctor.run)
    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
