"""Read a CosyVoice HyperPyYAML config as plain data, without executing any of it.

The official code loads ``cosyvoice2.yaml`` with HyperPyYAML, which instantiates classes
(``!new:``), binds partials (``!name:``), calls functions (``!apply:``) and evaluates
references with arithmetic (``!ref <chunk_size> * <token_mel_ratio>``). We only need the
numbers, so tags are recorded as :class:`Tagged` nodes and ``!ref`` is evaluated here with a
tiny arithmetic evaluator. Nothing is imported, nothing is called.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import ModelDirError

__all__ = ["Tagged", "load_hyperyaml", "find_tagged"]

_REF_PATTERN = re.compile(r"<([^<>]+)>")


@dataclass
class Tagged:
    """A ``!new:``/``!name:``/``!apply:`` node: the tag kind, the dotted target, its arguments."""

    kind: str  # "new" | "name" | "apply"
    target: str  # e.g. "cosyvoice.flow.flow.CausalMaskedDiffWithXvec"
    kwargs: dict[str, Any] = field(default_factory=dict)
    args: list[Any] = field(default_factory=list)

    @property
    def class_name(self) -> str:
        return self.target.rsplit(".", 1)[-1]

    def get(self, key: str, default: Any = None) -> Any:
        return self.kwargs.get(key, default)

    def __getitem__(self, key: str) -> Any:
        return self.kwargs[key]


@dataclass
class _Ref:
    expression: str


class _Loader(yaml.SafeLoader):
    """SafeLoader that turns HyperPyYAML tags into inert data."""


def _construct_tagged(kind: str):
    def construct(loader: _Loader, suffix: str, node: yaml.Node) -> Tagged:
        if isinstance(node, yaml.MappingNode):
            return Tagged(kind, suffix, kwargs=loader.construct_mapping(node, deep=True))
        if isinstance(node, yaml.SequenceNode):
            return Tagged(kind, suffix, args=loader.construct_sequence(node, deep=True))
        value = loader.construct_scalar(node)
        return Tagged(kind, suffix, args=[value] if value not in ("", None) else [])

    return construct


def _construct_ref(loader: _Loader, node: yaml.Node) -> _Ref:
    return _Ref(str(loader.construct_scalar(node)))


for _kind in ("new", "name", "apply"):
    _Loader.add_multi_constructor(f"!{_kind}:", _construct_tagged(_kind))
_Loader.add_constructor("!ref", _construct_ref)

_BINARY_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def _eval_arithmetic(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _eval_arithmetic(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        return _BINARY_OPS[type(node.op)](_eval_arithmetic(node.left), _eval_arithmetic(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval_arithmetic(node.operand)
    raise ValueError(f"unsupported expression element {ast.dump(node)}")


class _Resolver:
    def __init__(self, root: dict[str, Any], source: Path):
        self.root = root
        self.source = source
        self.resolving: set[str] = set()

    def lookup(self, key: str) -> Any:
        if key in self.resolving:
            raise ModelDirError(f"{self.source}: circular !ref <{key}>. The yaml file is malformed.")
        node: Any = self.root
        for part in key.split("."):
            if isinstance(node, Tagged):
                node = node.kwargs
            if not isinstance(node, dict) or part not in node:
                raise ModelDirError(
                    f"{self.source}: !ref <{key}> names a key that does not exist. "
                    "The yaml file is malformed; re-download the release."
                )
            node = node[part]
        self.resolving.add(key)
        try:
            return self.resolve(node)
        finally:
            self.resolving.discard(key)

    def evaluate(self, ref: _Ref) -> Any:
        text = ref.expression.strip()
        whole = _REF_PATTERN.fullmatch(text)
        if whole:
            return self.lookup(whole.group(1))
        values: dict[str, Any] = {}

        def substitute(match: re.Match[str]) -> str:
            name = f"_ref{len(values)}"
            values[name] = self.lookup(match.group(1))
            return repr(values[name])

        expression = _REF_PATTERN.sub(substitute, text)
        try:
            return _eval_arithmetic(ast.parse(expression, mode="eval"))
        except (SyntaxError, ValueError, TypeError) as exc:
            raise ModelDirError(
                f"{self.source}: cannot evaluate '!ref {ref.expression}' ({exc})."
            ) from exc

    def resolve(self, node: Any) -> Any:
        if isinstance(node, _Ref):
            return self.evaluate(node)
        if isinstance(node, Tagged):
            node.kwargs = {k: self.resolve(v) for k, v in node.kwargs.items()}
            node.args = [self.resolve(v) for v in node.args]
            return node
        if isinstance(node, dict):
            return {k: self.resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [self.resolve(v) for v in node]
        return node


def load_hyperyaml(path: Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Parse a HyperPyYAML file into dicts, lists, scalars and :class:`Tagged` nodes.

    ``overrides`` replace top-level keys before references are resolved, as HyperPyYAML does
    (the official loader overrides ``qwen_pretrain_path``).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ModelDirError(f"cannot read {path}: {exc.strerror or exc}.") from exc
    try:
        root = yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ModelDirError(f"{path} is not valid YAML ({exc}). Re-download the release.") from exc
    if not isinstance(root, dict):
        raise ModelDirError(f"{path} does not hold a mapping at top level; expected a CosyVoice yaml.")
    root.update(overrides or {})
    resolved = _Resolver(root, path).resolve(root)
    return resolved


def find_tagged(node: Any, class_name: str) -> Tagged | None:
    """Depth-first search for the first tagged node whose class name is ``class_name``."""
    if isinstance(node, Tagged):
        if node.class_name == class_name:
            return node
        children = list(node.kwargs.values()) + list(node.args)
    elif isinstance(node, dict):
        children = list(node.values())
    elif isinstance(node, list):
        children = node
    else:
        return None
    for child in children:
        found = find_tagged(child, class_name)
        if found is not None:
            return found
    return None
