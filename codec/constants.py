"""Format constants of `.wcodec` v1. docs/FORMAT.md is the prose version of this file.

cuda_ext/include/wcodec_constants.h mirrors the rANS and segment constants; a test checks they agree.
"""
from __future__ import annotations

# ---- container -------------------------------------------------------------------------------
MAGIC = b"\x89WCODEC\n"            # 8 bytes; the 0x89 keeps text tools from taking it for text
FORMAT_MAJOR = 1                    # a reader refuses any other major version
FORMAT_MINOR = 0                    # readers accept newer minors (additive changes only)
PREAMBLE_SIZE = 64
DATA_ALIGN = 4096                   # the data region starts page-aligned (mmap / O_DIRECT)
STREAM_ALIGN = 64                   # every stream starts on a cache line (16-byte GPU loads)
MAX_HEADER_BYTES = 64 << 20         # a header larger than this is refused unread

# ---- rANS ------------------------------------------------------------------------------------
PROB_BITS = 12                      # frequencies sum to M = 2**PROB_BITS
PROB_SCALE = 1 << PROB_BITS
RANS_L = 1 << 16                    # decoder invariant: L <= x < 2**32
RENORM_BITS = 16                    # one 16-bit word in or out per renormalisation, at most one per symbol
LANES = 32                          # interleaved states per segment: one warp, one lane per state
SEGMENT_STEPS = 4096                # symbols per lane in a full segment
SEGMENT_SYMBOLS = LANES * SEGMENT_STEPS
SEGMENT_ALIGN = 16                  # segments start 16-byte aligned inside their stream
STATE_BYTES = 4 * LANES             # a segment begins with its 32 little-endian u32 states
TABLE_BITMAP_BYTES = 32             # a table begins with a 256-bit presence bitmap
LOG2_FRAC_BITS = 24                 # encoder costs: bits in fixed point (tables.LOG2); not format

# ---- lossless float codec --------------------------------------------------------------------
MAX_CTX_BITS = 2                    # the exponent is coded with one table per value of the top
                                    # ctx_bits mantissa bits (read from the raw plane first)
MIN_CODED_ELEMENTS = 4096           # smaller float tensors are stored raw
TABLE_GROUP_QUANTUM = 4             # table_group is a multiple of this, or covers the whole tensor:
                                    # a GPU block of 4 warps then decodes 4 segments with one table set
TABLE_GROUPS = (4, 8, 16)           # segments per table set the encoder may choose, besides "all"

CODEC_FLOAT = "float"
CODEC_RAW = "raw"
CODEC_GGUF = "gguf"                 # GGUF quantized blocks kept as stored (codec/gguf_blocks.py)
CODEC_INT8 = "int8"                 # lossy, opt-in: per-row int8 + tile predictors (codec/int8.py)

# ---- the fixed-rate GPU form (in memory, not in the file; codec/fixedrate.py, FORMAT.md §6) ---
FR_GROUP = 32                       # weights per group: the unit one thread of the fused kernel decodes
FR_TILE = 128                       # weights sharing one base: 4 consecutive groups of a row
FR_BLOCK_GROUPS = 32                # groups per escape block (one warp): esc_start is kept per block
FR_CODES = 8                        # 3-bit codes: field = base + code, a window of 8 fields a tile
FR_MAX_BASE = 256 - FR_CODES        # 248: base + 7 <= 255
FR_POS_MASK = 0x7F                  # an escape entry (u16): its position in the tile in bits 0..6,
FR_FIELD_SHIFT = 8                  # its field in bits 8..15
FR_LO_WORDS = 2                     # u32 code words per group in `lo` (a third in `hi`)
