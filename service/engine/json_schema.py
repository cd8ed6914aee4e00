"""What outlines-core's regex of a JSON schema leaves out (grammar.py's `schema_regex` refuses it),
and the schema it is given (`prepared`: its patterns anchored, its free-form values' nesting bounded).

outlines-core turns a schema into a regex keyword by keyword, and passes over the keywords it does
not know: the text that follows the regex need not follow the schema. A request whose schema
holds one of them answers 422, naming the keyword and where it is, rather than a 200 whose JSON
breaks the schema. Checked on outlines-core 0.2.14 (tests/service/engine/test_json_schema.py
generates from each and validates with `jsonschema`):

    minimum, maximum, exclusiveMinimum/Maximum, multipleOf   numbers and integers unbounded
    uniqueItems, contains, minContains, maxContains          arrays unchecked
    minProperties, maxProperties, patternProperties, ...     objects unchecked
    not, if, then, else                                      dropped
    `required` names absent from `properties`                 the property may be missing
    `allOf` of two or more schemas                            the values written one after another
    an empty `enum`, `anyOf` or `oneOf`                       the empty text, which is no JSON
    a `pattern` that may match '"', '\\' or a control         written raw inside the string's
      character (`.`, `[^,]`, `\\s`, ...)                       quotes: text that is not JSON
    format email, time, uri                                   the same, from outlines-core's own
                                                              regex of the format
    two of minLength/maxLength, pattern, format               all but the first dropped
    objects and arrays nested over DEEPEST levels             no regex: its JSON parser reads
                                                              none ("Expected a valid JSON string")

A pattern is read as outlines-core reads it (regex_syntax.py): a Unicode property (`\\p{L}`) as the
characters outlines-core's engine puts in it; syntax that Rust's regex and JSON Schema's read
differently (nested classes, `&&` in a class), or that Python's `re` cannot parse, is refused too.
`oneOf` is outlines-core's alternation, as `anyOf` (TGI's too; llguidance refuses it unless told to
coerce it so): exactly one holds only where no text matches two alternatives (README).
"""
from __future__ import annotations

import copy
import re
from collections.abc import Iterator

from .regex_syntax import ESCAPED, Unchecked, anchored, checkable

try:
    from re import _constants as sre
    from re import _parser as sre_parse
except ImportError:                                        # Python 3.10
    import sre_constants as sre
    import sre_parse

UNENFORCED = frozenset({
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "uniqueItems", "contains", "minContains", "maxContains",
    "minProperties", "maxProperties", "patternProperties", "propertyNames", "unevaluatedProperties",
    "dependentRequired", "dependentSchemas", "dependencies",
    "not", "if", "then", "else",
})
BROKEN_FORMATS = frozenset({"email", "time", "uri"})
STRING_KINDS = (("minLength", "maxLength"), ("pattern",), ("format",))   # outlines-core writes the first only
CATEGORIES = {"DIGIT": r"\d", "NOT_DIGIT": r"\D", "SPACE": r"\s", "NOT_SPACE": r"\S", "WORD": r"\w",
              "NOT_WORD": r"\W", "LINEBREAK": r"\n", "NOT_LINEBREAK": r"[^\n]"}
NESTING = 1                 # free-form values' depth (outlines-core's `depth`; its default, 2: 7 s, not 0.4)
SCALARS = ({"type": "boolean"}, {"type": "null"}, {"type": "number"}, {"type": "string"})
MAPS = ("properties", "$defs", "definitions")              # keywords whose values map names to schemas
ONE = ("items", "additionalProperties")                    # a schema
LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")          # a list of schemas
DEEPEST = 127               # levels of objects and arrays outlines-core's JSON parser (serde_json's) reads
TOO_DEEP = f"objects and arrays nested over {DEEPEST} levels deep, which outlines-core does not read"


def refusal(schema: object) -> str | None:
    """Why the regex of `schema` would not hold text to it, or None."""
    if _deeper_than(schema, DEEPEST):                      # first: the walks below recurse a level a frame
        return TOO_DEEP
    for pointer, node in _nodes(schema, ""):
        if why := _why(node):
            return f"{why} (at {pointer or '/'})"
    return None


def prepared(schema: object) -> object:
    """A copy of `schema` for outlines-core: its patterns `anchored` (regex_syntax.py), its
    free-form values (an object without `properties`, an array without
    `items`, the empty schema: any JSON inside) nesting NESTING levels below them at most:
    {"type": "object"} takes {"a": {"b": 1}, "c": [1]}, not {"a": {"b": {"c": 1}}} nor {"a": [[1]]}.
    outlines-core writes every level out in full: the regex grows fourfold a level, the index's
    cost over the demo's vocabulary (0.3, 1.1, 20 s for depths 0, 1, 2 on a loaded 2-core CPU)
    steeply (docs/BENCHMARKS.md). A schema's own `depth` is kept."""
    schema = copy.deepcopy(schema)
    for _, node in _nodes(schema, ""):
        types = node.get("type") if isinstance(node.get("type"), list) else [node.get("type")]
        if "object" in types or "array" in types:
            node.setdefault("depth", NESTING)
        elif not node:                                     # outlines-core's any value, at its depth
            node["anyOf"] = [*SCALARS, {"type": "array", "depth": NESTING}, {"type": "object", "depth": NESTING}]
        if isinstance(node.get("pattern"), str):
            node["pattern"] = anchored(node["pattern"])
    return schema


def _deeper_than(value: object, levels: int) -> bool:
    """Whether `value` nests objects and arrays over `levels` deep, walked without recursion (a
    schema nested past Python's recursion limit raised RecursionError in `_nodes`: a 500)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            if depth > levels:
                return True
            stack.extend((sub, depth + 1) for sub in (node.values() if isinstance(node, dict) else node))
    return False


def _nodes(node: object, pointer: str) -> Iterator[tuple[str, dict]]:
    """Every schema in `node` with its JSON pointer, `node` first."""
    if not isinstance(node, dict):
        return
    yield pointer, node
    for key in MAPS:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                yield from _nodes(sub, f"{pointer}/{key}/{str(name).replace('~', '~0').replace('/', '~1')}")
    for key in ONE:
        yield from _nodes(node.get(key), f"{pointer}/{key}")
    for key in LISTS:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                yield from _nodes(sub, f"{pointer}/{key}/{i}")


def _why(node: dict) -> str | None:
    if unenforced := sorted(UNENFORCED & node.keys()):
        return f"keyword {unenforced[0]!r} cannot be enforced"
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    if missing := [name for name in required if name not in properties]:
        return f"required property {missing[0]!r} is not in 'properties'"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "'allOf' of more than one schema cannot be enforced"
    if empty := [key for key in ("enum", "anyOf", "oneOf") if node.get(key) == []]:
        return f"an empty {empty[0]!r} admits no value"
    if len(kinds := [next(k for k in keys if k in node) for keys in STRING_KINDS if node.keys() & set(keys)]) > 1:
        return f"keyword {kinds[1]!r} cannot be enforced beside {kinds[0]!r} (outlines-core writes only the latter)"
    if node.get("format") in BROKEN_FORMATS:
        return f"format {node['format']!r} cannot be enforced (its regex lets through text that is not JSON)"
    if isinstance(node.get("pattern"), str):
        return _pattern_refusal(node["pattern"])
    return None


def _pattern_refusal(pattern: str) -> str | None:
    """Why a string `pattern` matches would break the JSON text, or None."""
    try:
        parsed = sre_parse.parse(checkable(pattern))
    except Unchecked as e:
        return f"pattern {pattern!r} cannot be checked: {e}"
    except (re.error, RecursionError) as e:
        return f"pattern {pattern!r} cannot be checked (Python's re reads it as: {e})"
    if _escaped_in(parsed):
        return (f"pattern {pattern!r} may match a quote, a backslash or a control character, "
                "which the regex would leave unescaped (not JSON)")
    return None


def _escaped_in(items) -> bool:
    """Whether the parsed pattern `items` may match a character of ESCAPED."""
    for op, arg in items:
        if op in (sre.ANY, sre.NOT_LITERAL) or (op is sre.LITERAL and chr(arg) in ESCAPED):
            return True
        if op is sre.IN and any(_in_set(arg, c) for c in ESCAPED):
            return True
        if any(_escaped_in(sub) for sub in _subpatterns(op, arg)):
            return True
    return False


def _subpatterns(op, arg) -> list:
    """The parsed patterns inside one that is not a character (lookarounds match none)."""
    if op is sre.BRANCH:
        return arg[1]
    if op in (sre.MAX_REPEAT, sre.MIN_REPEAT, getattr(sre, "POSSESSIVE_REPEAT", None)):
        return [arg[2]]
    if op is sre.SUBPATTERN:
        return [arg[-1]]
    if op is getattr(sre, "ATOMIC_GROUP", None):
        return [arg]
    return [p for p in arg[1:] if p is not None] if op is sre.GROUPREF_EXISTS else []


def _in_set(items, c: str) -> bool:
    """Whether the character class `items` ([...], \\d, ...) matches `c`."""
    negate = bool(items) and items[0][0] is sre.NEGATE
    hit = False
    for op, arg in items:
        if op is sre.LITERAL:
            hit |= ord(c) == arg
        elif op is sre.RANGE:
            hit |= arg[0] <= ord(c) <= arg[1]
        elif op is sre.CATEGORY:
            name = str(arg).removeprefix("CATEGORY_").removeprefix("UNI_").removeprefix("LOC_")
            hit |= re.fullmatch(CATEGORIES[name], c) is not None
    return hit != negate
