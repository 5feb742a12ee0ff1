"""Compiler launcher of the native libraries: run one compile and say what it built and how
long it took, so that a verbose install (``pip install -v``) shows where the minutes go (one
CUDA source can take minutes of CPU).

    timed.py --log DIR --what "nvcc sm_80 sm_90" -- COMMAND...   # one compile
    timed.py --summary DIR --what libjaxattn_cuda.so             # after the link

A compile records its seconds in DIR, keyed by source; the summary adds up the latest time
of every source of the library.
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import time

_SOURCES = (".cu", ".cc", ".cpp", ".cxx", ".c")


def _source(command: list[str]) -> str:
    # nvcc, g++ and clang all take the source after -c; fall back to any source-like argument.
    for flag, arg in zip(command, command[1:], strict=False):
        if flag == "-c" and arg.endswith(_SOURCES):
            return arg
    return next((a for a in reversed(command) if a.endswith(_SOURCES)), "?")


def main(argv: list[str]) -> int:
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1 :]
    else:
        command = []
    p = argparse.ArgumentParser(prog="timed.py")
    p.add_argument("--log", type=pathlib.Path)
    p.add_argument("--summary", type=pathlib.Path)
    p.add_argument("--what", default="")
    args = p.parse_args(argv)

    if args.summary is not None:
        times = {
            f.name.removesuffix(".seconds"): float(f.read_text())
            for f in args.summary.glob("*.seconds")
        }
        if times:
            longest = max(times, key=times.get)
            detail = (
                f"{len(times)} sources, {sum(times.values()):.0f} s of compile time, the "
                f"longest {longest} ({times[longest]:.0f} s)"
                if len(times) > 1
                else f"{longest} compiled in {times[longest]:.1f} s"
            )
            print(f"jaxattn: {args.what} ready: {detail}", flush=True)
        return 0

    start = time.perf_counter()
    rc = subprocess.call(command)
    seconds = time.perf_counter() - start
    name = pathlib.Path(_source(command)).name
    status = "" if rc == 0 else f" FAILED (exit {rc})"
    print(f"jaxattn: {name} ({args.what}) {seconds:.1f} s{status}", flush=True)
    if args.log is not None and rc == 0:
        args.log.mkdir(parents=True, exist_ok=True)
        (args.log / f"{name}.seconds").write_text(f"{seconds:.3f}\n")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
