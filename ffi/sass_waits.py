"""Where a kernel waits for its global loads, read from the machine code (no GPU needed).

Each sm_70+ instruction carries scheduling bits beside its opcode: the scoreboard a
variable-latency instruction (a global or shared load, a transcendental, a shuffle) sets when
its result lands, and the scoreboards an instruction waits for before it issues. This lists,
for every kernel whose name matches, each register load from global memory (``LDG``) and the
first instruction that waits for it, with the tensor-core instructions between them: a load
waited for before any product of its loop has its whole latency exposed every iteration.

    python3 ffi/sass_waits.py build/gpu/ffi/libjaxattn_cuda.so 'paged_decode_mma_kernel<bf16_t, 64>'
    python3 ffi/sass_waits.py LIB REGEX --exposed     # only loads with no product before the wait

The library is disassembled with ``cuobjdump -sass`` (on PATH; CUDA's, or the
``nvidia-cuda-cuobjdump`` wheel's). The waiter is the next instruction in address order, so a
load at the end of a loop body is reported against the code after the loop; read such a load
against the loop's start by hand (ffi/NOTES.md, round 47, has two read this way).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass

_FUNCTION = re.compile(r"\n\s*Function : (\S+)")
_LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*/\* (0x[0-9a-f]+) \*/")
_WORD = re.compile(r"/\* (0x[0-9a-f]+) \*/")
_PRODUCTS = ("HMMA", "HGMMA", "IMMA", "QGMMA")
_NO_BARRIER = 7


@dataclass(frozen=True)
class Instr:
    address: int
    text: str
    write_barrier: int  # scoreboard set when the result lands (7: none)
    wait_mask: int  # scoreboards waited for before issue (bit i: scoreboard i)

    @property
    def opcode(self) -> str:
        words = self.text.split()
        return words[1] if words and words[0].startswith("@") and len(words) > 1 else words[0]


def decode(listing: str) -> list[Instr]:
    """The instructions of one function's ``cuobjdump -sass`` listing. The scheduling bits are
    bits 105-125 of the 128-bit word (the second 64-bit word's bits 41-61): stall cycles (4),
    yield (1), write barrier (3), read barrier (3), wait mask (6), operand reuse (4)."""
    lines = listing.splitlines()
    out = []
    for i, line in enumerate(lines[:-1]):
        m = _LINE.match(line)
        if not m:
            continue
        hi = _WORD.search(lines[i + 1])
        if hi is None:
            continue
        control = int(hi.group(1), 16) >> 41
        out.append(
            Instr(int(m.group(1), 16), m.group(2), (control >> 5) & 7, (control >> 11) & 0x3F)
        )
    return out


def load_waits(instrs: list[Instr]):
    """(load, its first waiter or None, tensor-core instructions between them) for every LDG
    that sets a scoreboard."""
    for k, ins in enumerate(instrs):
        op = ins.opcode
        if not (op == "LDG" or op.startswith("LDG.")) or ins.write_barrier == _NO_BARRIER:
            continue
        waiter, products = None, 0
        for later in instrs[k + 1 :]:
            if later.wait_mask >> ins.write_barrier & 1:
                waiter = later
                break
            products += later.opcode.startswith(_PRODUCTS)
        yield ins, waiter, products


def functions(library: str) -> dict[str, str]:
    text = subprocess.run(
        ["cuobjdump", "-sass", library], capture_output=True, text=True, check=True
    ).stdout
    parts = _FUNCTION.split(text)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def demangle(names):
    try:
        out = subprocess.run(
            ["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True
        ).stdout.splitlines()
        return out if len(out) == len(names) else list(names)
    except (OSError, subprocess.CalledProcessError):
        return list(names)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("library")
    ap.add_argument("pattern", help="regular expression over the demangled kernel names")
    ap.add_argument("--exposed", action="store_true", help="only loads waited before a product")
    args = ap.parse_args(argv)
    funcs = functions(args.library)
    names = list(funcs)
    for mangled, name in zip(names, demangle(names), strict=True):
        if not re.search(args.pattern, name):
            continue
        rows = []
        for load, waiter, products in load_waits(decode(funcs[mangled])):
            if args.exposed and (products or waiter is None):
                continue
            at = "never" if waiter is None else f"{waiter.address:05x} {waiter.text[:40]}"
            rows.append(f"  {load.address:05x} {load.text[:48]:48s} -> {at} ({products} products)")
        if rows:
            print(name)
            print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
