"""ffi/sass_waits.py: the scheduling bits of a cuobjdump listing, decoded (no GPU, no cuobjdump)."""

import importlib.util
import pathlib
import sys

_PATH = pathlib.Path(__file__).resolve().parents[1] / "ffi" / "sass_waits.py"
_spec = importlib.util.spec_from_file_location("sass_waits", _PATH)
sass_waits = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("sass_waits", sass_waits)  # dataclasses look their module up there
_spec.loader.exec_module(sass_waits)


def _word(write_barrier=7, wait_mask=0):
    """The second 64-bit word of an instruction with these scheduling bits (bits 41-61)."""
    return ((write_barrier << 5) | (7 << 8) | (wait_mask << 11)) << 41


def _listing(rows):
    lines = []
    for addr, text, wb, wait in rows:
        lines.append(f"        /*{addr:04x}*/  {text} ;  /* 0x000000000000ab12 */")
        lines.append(f"                          /* {_word(wb, wait):#018x} */")
    return "\n".join(lines)


def test_a_load_waited_before_any_product_is_exposed():
    listing = _listing(
        [
            (0x10, "LDG.E R4, desc[UR4][R2.64]", 5, 0),
            (0x20, "LDGDEPBAR", 0, 0),
            (0x30, "IMAD.MOV.U32 R8, RZ, RZ, RZ", 7, 0b100000),
            (0x40, "@P0 LDG.E R6, desc[UR4][R2.64+0x4]", 2, 0),
            (0x50, "HMMA.16816.F32.BF16 R8, R12, R16, R8", 7, 0),
            (0x60, "ISETP.GE.AND P1, PT, R6, RZ, PT", 7, 0b000100),
        ]
    )
    instrs = sass_waits.decode(listing)
    assert [i.address for i in instrs] == [0x10, 0x20, 0x30, 0x40, 0x50, 0x60]
    assert instrs[0].write_barrier == 5 and instrs[2].wait_mask == 0b100000
    assert instrs[3].opcode == "LDG.E"
    waits = [(ld.address, w.address, n) for ld, w, n in sass_waits.load_waits(instrs)]
    # LDGDEPBAR is no load; the first load is waited before the product, the second after it.
    assert waits == [(0x10, 0x30, 0), (0x40, 0x60, 1)]
