"""The fused fixed-rate kernels' main loops in SASS, counted here (cuobjdump reads sm_90a code on a
machine without a GPU): for each `mma_kernel` instantiation, its registers and spills, and its
tile loops (one for each specialized walk), with their instructions a tile of W and the register
moves among them. A loop also holds the escape path, which most tiles skip: compare builds, not
absolute counts. This is how the moves that built x's mma operands were found (docs/BENCHMARKS.md,
2026-11-29).

    pip download nvidia-cuda-cuobjdump-cu13 ...; export PATH=<its bin>:$PATH     # once
    python scripts/gpu/sass_loop.py .extbuild/wcodec_ext_cuda.so [mma_kernelILb1]
"""
from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter

MMA_PER_TILE = 8            # a warp's mma a 128-weight tile for each m16 tile of x (fixedrate_mma.cu)


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    """Each function's instructions as (address, text)."""
    out = {}
    for body in re.split(r"\n\s*Function : ", sass)[1:]:
        name = body.split("\n", 1)[0].strip()
        out[name] = [(int(a, 16), i.strip()) for a, i in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", body)]
    return out


def op(text: str) -> str:
    """The instruction's opcode with its modifiers (IMAD.MOV.U32), past a predicate."""
    return text.split()[1] if text.startswith("@") else text.split()[0]


def opcode(text: str) -> str:
    return op(text).split(".")[0]


def mma_loops(ins: list[tuple[int, str]], m_tiles: int) -> list[list[tuple[int, str]]]:
    """The tile loops: spans closed by a backward branch that hold an HMMA, keeping those within 1.5x
    the fewest instructions a tile (one for each specialized walk; the others are jumps back from
    the escape path that span a loop and more)."""
    at = {a: k for k, (a, _) in enumerate(ins)}
    spans = []
    for k, (a, text) in enumerate(ins):
        m = re.search(r"BRA(?:\.\w+)* (?:\w+, )?0x([0-9a-f]+)", text)
        target = int(m.group(1), 16) if m else a
        if target < a and target in at:
            span = ins[at[target]:k + 1]
            if any(opcode(t) == "HMMA" for _, t in span):
                spans.append(span)
    per_tile = [len(sp) / tiles_in(sp, m_tiles) for sp in spans]
    return [sp for sp, n in zip(spans, per_tile) if n <= 1.5 * min(per_tile, default=0)]


def tiles_in(span: list[tuple[int, str]], m_tiles: int) -> float:
    return sum(opcode(t) == "HMMA" for _, t in span) / MMA_PER_TILE / m_tiles


def usage(lib: str) -> dict[str, str]:
    """Registers and stack (spills show there) of each function, from `cuobjdump -res-usage`."""
    text = subprocess.run(["cuobjdump", "-res-usage", lib], capture_output=True, text=True, check=True).stdout
    return {m.group(1): f"{m.group(2)} registers, {m.group(3)} bytes of stack"
            for m in re.finditer(r"Function (\S+):\s*\n?\s*REG:(\d+) STACK:(\d+)", text)}


def main() -> int:
    lib, pattern = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "mma_kernel"
    sass = subprocess.run(["cuobjdump", "-sass", lib], capture_output=True, text=True, check=True).stdout
    regs = usage(lib)
    for name, ins in functions(sass).items():
        if pattern not in name or "sum_parts" in name:
            continue
        slots = re.search(r"ELi(\d+)E", name)
        m_tiles = max(1, int(slots.group(1)) // 2) if slots else 1
        w_as_a = "ELi1ELb1E" in name                                 # 16 rows of W a tile (fixedrate_mma.cu)
        print(f"{name[-60:]}: {regs.get(name, '?')}" + (" (W as A: a tile is 16 rows of W)" if w_as_a else ""))
        for loop in mma_loops(ins, m_tiles):
            ops = Counter(opcode(t) for _, t in loop)
            tiles = tiles_in(loop, m_tiles)
            moves = sum(1 for _, t in loop if "MOV" in op(t).split("."))
            print(f"  loop at {loop[0][0]:#x}: {len(loop)} instructions, {tiles:g} tile(s): {len(loop) / tiles:.0f} a tile, "
                  f"{moves} moves, {ops['LDG']} LDG, {ops['HMMA']} HMMA")
    return 0


if __name__ == "__main__":
    sys.exit(main())
