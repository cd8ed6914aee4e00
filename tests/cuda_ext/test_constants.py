"""The extension's constants header mirrors codec/constants.py (one format, one set of numbers)."""
import re
from pathlib import Path

from codec import constants as C
from cuda_ext import plan

HEADER = (Path(__file__).parents[2] / "cuda_ext" / "csrc" / "wcodec_constants.h").read_text()


def header_value(name: str) -> int:
    m = re.search(rf"constexpr \w+ {name} = (.+?);", HEADER)
    assert m, name
    expr = m.group(1).replace("u <<", " <<").replace("int64_t", "").replace("{", "").replace("}", "")
    return int(eval(expr, {"kLanes": C.LANES, "kProbBits": C.PROB_BITS}))   # noqa: S307 (our own header)


def test_constants_match_codec():
    assert header_value("kProbBits") == C.PROB_BITS
    assert header_value("kProbScale") == C.PROB_SCALE
    assert header_value("kRansL") == C.RANS_L
    assert header_value("kRenormBits") == C.RENORM_BITS
    assert header_value("kLanes") == C.LANES
    assert header_value("kSegmentSymbols") == C.SEGMENT_SYMBOLS
    assert header_value("kSegmentAlign") == C.SEGMENT_ALIGN
    assert header_value("kStateBytes") == C.STATE_BYTES
    assert header_value("kTableBitmapBytes") == C.TABLE_BITMAP_BYTES
    assert header_value("kMaxCtxBits") == C.MAX_CTX_BITS
    assert header_value("kSegmentSteps") == C.SEGMENT_STEPS
    assert header_value("kMinCodedElements") == C.MIN_CODED_ELEMENTS
    assert header_value("kLog2FracBits") == C.LOG2_FRAC_BITS
    groups = re.search(r"kTableGroups\[\] = \{(.+?)\};", HEADER).group(1)
    assert tuple(int(g) for g in groups.split(",")) == C.TABLE_GROUPS


def test_modes_and_lut_layout_match():
    from codec import tables
    assert [int(v) for v in re.findall(r"k(?:Bulk|Record|Indexed) = (\d)", HEADER)] == \
        [plan.MODE_BULK, plan.MODE_RECORD, plan.MODE_INDEXED]
    common = (Path(__file__).parents[2] / "cuda_ext" / "csrc" / "decode_common.h").read_text()
    assert "kLutSymShift = kProbBits, kLutFreqShift = kProbBits + 8" in common
    assert (tables.LUT_SYM_SHIFT, tables.LUT_FREQ_SHIFT) == (C.PROB_BITS, C.PROB_BITS + 8)
    assert header_value("kMinEntrySteps") == 8


def test_descriptor_fields_match_plan():
    body = re.search(r"enum DescField : int \{(.+?)\};", HEADER, re.S).group(1)
    names = [re.sub(r"^kDesc", "", n.split("=")[0].strip()) for n in body.split(",") if n.strip()]
    camel = ["".join(p.title() for p in f.split("_")) for f in plan.DESC_FIELDS]
    assert names == camel + ["Fields"]
    assert re.search(r"kBF16 = (\d)", HEADER).group(1) == str(plan.DTYPE_CODES["bfloat16"])
    assert re.search(r"kFP32 = (\d)", HEADER).group(1) == str(plan.DTYPE_CODES["float32"])


def test_kernel_block_matches_table_group_quantum():
    cu = (Path(__file__).parents[2] / "cuda_ext" / "csrc" / "decode_float.cu").read_text()
    assert f"kWarpsPerBlock = {C.TABLE_GROUP_QUANTUM};" in cu
    assert plan.WARPS_PER_BLOCK == C.TABLE_GROUP_QUANTUM
    assert f"kIndexedWarpsPerBlock = {plan.INDEXED_WARPS_PER_BLOCK};" in cu
    assert "if ((per % w == 0 || (w % per == 0 && w / per <= span)) && units >= w * sms) return w;" in cu
    idx, bulk, sms, big = plan.MODE_INDEXED, plan.MODE_BULK, 132, 10**6
    cases = [(idx, 64, 64 * 132, 4), (idx, 256, 16 * 132, 4), (idx, 256, 16 * 132 - 1, 4), (idx, 256, 8 * 132 - 1, 4),
             (idx, 512, big, 4), (idx, 1024, big, 4), (idx, 2048, big, 4), (idx, 4096, big, 4),
             (bulk, 256, big, 4), (plan.MODE_RECORD, 8, big, 4), (bulk, 0, big, 8), (bulk, 0, big, 16),
             (bulk, 0, 16 * 132 - 1, 1 << 30), (idx, 4096, big, 16)]
    assert [plan.warps_per_block(m, k, u, sms, span) for m, k, u, span in cases] == \
        [16, 16, 8, 4, 16, 16, 8, 4, 4, 4, 8, 16, 8, 16]


def test_gguf_block_layouts_match_codec():
    """gguf_blocks.h's layout table is codec/gguf_blocks.py's: codes, geometry, plane spans in order."""
    from codec import gguf_blocks
    text = (Path(__file__).parents[2] / "cuda_ext" / "csrc" / "gguf_blocks.h").read_text()
    body = re.search(r"kLayouts\[\] = \{(.+?)\n\};", text, re.S).group(1)
    rows = {}
    for line in body.strip().splitlines():
        nums = [int(v) for v in re.findall(r"\d+", line.split("//")[0])]
        rows[nums[0]] = (nums[1], nums[2], nums[3], [tuple(nums[4 + 2 * k:6 + 2 * k]) for k in range(nums[3])])
    want = {bt.code: (bt.block_size, bt.type_size, len(bt.planes), [(offs[0], len(offs)) for _, offs in bt.planes])
            for bt in gguf_blocks.BLOCK_TYPES.values()}
    assert rows == want
    assert re.search(r"kU8 = (\d)", HEADER).group(1) == str(plan.BYTES_CODE)


def test_int8_tile_constants_match_codec():
    from codec import int8
    text = (Path(__file__).parents[2] / "cuda_ext" / "csrc" / "int8_tiles.h").read_text()
    assert re.search(r"constexpr int kTile = (\d+);", text).group(1) == str(int8.TILE)
    assert re.search(r"constexpr int kModes = (\d+);", text).group(1) == str(len(int8.MODES))
