"""Reading a spec's YAML text with bounds: duplicate keys refused, nesting depth and node count capped while the
document is composed, and aliases resolved once into a plain tree.

PyYAML's composer and constructor recurse once per nesting level and share an aliased node between every place
that names it, so without bounds a 50,000-deep document ends in a RecursionError, `&s [*s]` builds a cycle that
any walk over the spec follows forever, and a "billion laughs" alias chain is a few lines that expand to 10^9
nodes. Here the composer counts each node as it is built (an alias counts as the whole node it names) and stops
at the first node over a limit, so a hostile document costs at most the limits, not its expansion.
"""

from __future__ import annotations

from typing import Any

import yaml

# A job spec nests about six levels (data.sources[i].field); 64 leaves room for any real one.
MAX_DEPTH = 64
# Nodes after alias expansion; a spec with a thousand data sources has ~10,000.
MAX_NODES = 200_000


class YamlLimitError(yaml.YAMLError):
    """The document is nested too deep, expands to too many nodes, or an alias names a node that holds it."""

    def __init__(self, problem: str, mark: yaml.Mark | None) -> None:
        self.problem = problem
        self.problem_mark = mark
        super().__init__(problem)


class DuplicateKeyError(yaml.YAMLError):
    """A mapping names the same key twice: YAML would keep the last silently."""

    def __init__(self, key: Any, first_line: int, second_line: int) -> None:
        super().__init__(f"duplicate key {key!r} at lines {first_line} and {second_line} (the second would "
                         "silently replace the first): keep one")


class BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses duplicate keys, documents deeper than MAX_DEPTH, documents that expand to
    more than MAX_NODES nodes, and recursive aliases."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0
        self._num_nodes = 0
        self._open_anchors: set[str] = set()
        self._anchored: dict[str, tuple[int, int]] = {}  # anchor → (expanded nodes, height)
        self._child_heights: list[int] = []

    def fetch_flow_collection_start(self, TokenClass: Any) -> None:  # noqa: N803 - PyYAML's name
        # The scanner looks up to 1024 characters ahead at every flow level before it hands out a token, so
        # `[[[[...` is stopped here, at the scanner, instead of after a thousand levels of look-ahead.
        if self.flow_level >= MAX_DEPTH:
            raise YamlLimitError(f"nested deeper than {MAX_DEPTH} levels", self.get_mark())
        super().fetch_flow_collection_start(TokenClass)

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        anchor = getattr(event, "anchor", None)
        mark = event.start_mark
        if isinstance(event, yaml.AliasEvent):
            if anchor in self._open_anchors:
                raise YamlLimitError(f"alias *{anchor} refers to a node that contains it (a cycle)", mark)
            node = super().compose_node(parent, index)  # PyYAML names an undefined alias
            size, height = self._anchored[anchor]
        elif isinstance(event, yaml.ScalarEvent):
            node = super().compose_node(parent, index)
            size, height = 1, 0
        else:
            if self._depth >= MAX_DEPTH:
                raise YamlLimitError(f"nested deeper than {MAX_DEPTH} levels", mark)
            self._depth += 1
            self._child_heights.append(0)
            if anchor is not None:
                self._open_anchors.add(anchor)
            before = self._num_nodes
            node = super().compose_node(parent, index)
            self._open_anchors.discard(anchor)  # type: ignore[arg-type]
            self._depth -= 1
            size, height = self._num_nodes - before + 1, self._child_heights.pop() + 1
            self._num_nodes = before  # the children are counted in `size`
        if self._depth + height > MAX_DEPTH:
            raise YamlLimitError(f"alias *{anchor} nests the document deeper than {MAX_DEPTH} levels", mark)
        self._num_nodes += size
        if self._num_nodes > MAX_NODES:
            raise YamlLimitError(f"the document expands to more than {MAX_NODES:,} nodes (counting every use "
                                 "of an alias)", mark)
        if anchor is not None and not isinstance(event, yaml.AliasEvent):
            self._anchored[anchor] = (size, height)
        if self._child_heights:
            self._child_heights[-1] = max(self._child_heights[-1], height)
        return node


def _unique_mapping(loader: BoundedLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        try:
            if key in seen:
                raise DuplicateKeyError(key, seen[key], line)
            seen[key] = line
        except TypeError:  # an unhashable key: the default constructor reports it
            break
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


BoundedLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def as_tree(node: Any, *, where: str = "spec") -> Any:
    """A copy of `node` in which every dict and list is its own object (aliases resolved once), so an edit at one
    place (a `--set`, a profile) never shows up at another. Refuses a cycle, more than MAX_DEPTH levels or more
    than MAX_NODES nodes with YamlLimitError, so a mapping built in code is held to the same bounds as a file."""
    num_nodes = 0

    def copy(value: Any, depth: int, open_ids: set[int]) -> Any:
        nonlocal num_nodes
        num_nodes += 1
        if num_nodes > MAX_NODES:
            raise YamlLimitError(f"{where} has more than {MAX_NODES:,} values", None)
        if not isinstance(value, dict | list):
            return value
        if depth >= MAX_DEPTH:
            raise YamlLimitError(f"{where} is nested deeper than {MAX_DEPTH} levels", None)
        if id(value) in open_ids:
            raise YamlLimitError(f"{where} contains itself (a cycle)", None)
        open_ids.add(id(value))
        if isinstance(value, dict):
            out: Any = {k: copy(v, depth + 1, open_ids) for k, v in value.items()}
        else:
            out = [copy(v, depth + 1, open_ids) for v in value]
        open_ids.discard(id(value))
        return out

    return copy(node, 0, set())


def load_yaml_text(text: str) -> Any:
    """Parse YAML text within the bounds above and return a plain tree (no shared nodes)."""
    return as_tree(yaml.load(text, Loader=BoundedLoader))  # noqa: S506 - a SafeLoader


def describe_yaml_error(err: yaml.YAMLError) -> str:
    """`line L, column C: <problem>` for a parse or limit error."""
    if isinstance(err, DuplicateKeyError):
        return str(err)
    mark = getattr(err, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    problem = getattr(err, "problem", None) or str(err)
    kind = "" if isinstance(err, YamlLimitError) else "YAML syntax error: "
    return f"{where}{kind}{problem}"
