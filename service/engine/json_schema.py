"""What outlines-core's regex of a JSON schema leaves out (grammar.py's `schema_regex` refuses it).

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
"""
from __future__ import annotations

from collections.abc import Iterator

UNENFORCED = frozenset({
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "uniqueItems", "contains", "minContains", "maxContains",
    "minProperties", "maxProperties", "patternProperties", "propertyNames", "unevaluatedProperties",
    "dependentRequired", "dependentSchemas", "dependencies",
    "not", "if", "then", "else",
})
MAPS = ("properties", "$defs", "definitions")              # keywords whose values map names to schemas
ONE = ("items", "additionalProperties")                    # a schema
LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")          # a list of schemas


def refusal(schema: object) -> str | None:
    """Why the regex of `schema` would not hold text to it, or None."""
    for pointer, node in _nodes(schema, ""):
        if why := _why(node):
            return f"{why} (at {pointer or '/'})"
    return None


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
    return None
