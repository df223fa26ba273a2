"""A key of the run config must be read by the code it configures: a schema field that nothing
outside ``megarl/config`` reads is a promise the run does not keep (issue 38: ``algorithm.
dynamic_sampling`` and ``algorithm.overlong_penalty`` were validated, switched on by
configs/algorithm/dapo.yaml, and read by nothing).

What counts as reading field ``f`` of section ``S`` (found with ``ast`` in megarl/ outside
megarl/config/, parallel/, tools/ and model_specs/; validation and the loader do not count):

* ``<expr>.f`` where ``<expr>`` is a section ``S``: an attribute named as ``S`` is in its parent
  (``cfg.rollout.multi_turn.max_turns``), a name bound to such an expression or a parameter
  annotated ``S`` (``m = cfg.rollout.multi_turn`` ... ``m.max_turns``), a variable named as the
  section (``layout.tp``), a schema method returning ``S`` (``cfg.layout_for(role).tp``), or
  ``getattr(cfg, role)`` (one of the role sections); ``getattr(<expr>, "f")`` is ``<expr>.f``.
  ``RunConfig`` itself is ``cfg``/``config`` (a name or an attribute: ``self.cfg``), or what is
  annotated or returned as one (``cfg.for_sft()``).
* wholesale: ``dataclasses.asdict(<S>)`` reads every field of ``S`` (not of its subsections).
* a schema method or property (``to_megatron``, ``staleness``, ``effective_overlong_buffer``...)
  that code outside the package calls, or that such a method calls: its own reads count
  (``self`` is its section). Dunder methods (``__str__``) do not: printing a key is not using it.

The qualification is what makes the test useful: ``.enabled`` is read for a dozen sections, so a
bare name search would have passed ``algorithm.dynamic_sampling.enabled`` while nothing read it.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCHEMA = ROOT / "megarl/config/schema.py"
CODE_DIRS = ("megarl", "parallel", "tools", "model_specs")
EXCLUDED_DIR = "megarl/config"
ROOT_SECTION = "RunConfig"
ROOT_NAMES = ("cfg", "config")  # what the run calls its RunConfig



@dataclasses.dataclass
class Section:
    name: str
    fields: list[str]
    children: dict[str, str]  # field -> section class name
    methods: dict[str, ast.FunctionDef]
    returns: dict[str, str]  # method -> the section it returns


def _names_in(node: ast.AST | None) -> set[str]:
    """Identifiers in an annotation (``Layout | None``, ``"RunConfig"``, ``list[X]``)."""
    if node is None:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return set(re.findall(r"[A-Za-z_]\w*", node.value))
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        w for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
        for w in re.findall(r"[A-Za-z_]\w*", n.value)}


def parse_schema(source: str) -> dict[str, Section]:
    """The section classes of a schema module: those with annotated fields, or the root."""
    classes = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)]
    names = {c.name for c in classes}
    sections = {}
    for c in classes:
        fields = [s.target.id for s in c.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                  and "ClassVar" not in _names_in(s.annotation)]
        if not fields:
            continue
        children = {}
        for s in c.body:
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
                inner = _names_in(s.annotation) & names
                if inner:
                    (children[s.target.id],) = inner
        methods = {s.name: s for s in c.body if isinstance(s, ast.FunctionDef)}
        returns = {m: next(iter(_names_in(f.returns) & names)) for m, f in methods.items()
                   if _names_in(f.returns) & names}
        sections[c.name] = Section(c.name, fields, children, methods, returns)
    for s in sections.values():  # children that are sections (a class with fields)
        s.children = {f: t for f, t in s.children.items() if t in sections}
    return sections


def section_paths(sections: dict[str, Section]) -> dict[str, list[tuple[str, ...]]]:
    """Section class -> the dotted paths it is found at, from the root."""
    paths: dict[str, list[tuple[str, ...]]] = {ROOT_SECTION: [()]}
    todo = [(ROOT_SECTION, ())]
    while todo:
        name, path = todo.pop(0)
        for f, child in sections[name].children.items():
            paths.setdefault(child, []).append(path + (f,))
            todo.append((child, path + (f,)))
    return paths


class _Reads(ast.NodeVisitor):
    """Field reads of one module (or one schema method body), with its own name -> section aliases."""

    def __init__(self, sections: dict[str, Section], parent_names: dict[str, set[str]], dynamic: set[str],
                 self_section: str | None = None):
        self.sections, self.parent_names, self.dynamic = sections, parent_names, dynamic
        self.returns = {m: t for s in sections.values() for m, t in s.returns.items()}
        self.aliases: dict[str, set[str]] = {"self": {self_section}} if self_section else {}
        self.reads: set[tuple[str, str]] = set()
        self.attributes: set[str] = set()  # every attribute name accessed (which methods are called)

    def kind(self, node: ast.AST) -> set[str]:
        """The sections an expression may be."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, set()) | self.parent_names.get(node.id, set())
        if isinstance(node, ast.Attribute):
            return self.parent_names.get(node.attr, set()) | self.aliases.get("." + node.attr, set())
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in self.returns:
                return {self.returns[func.attr]}
            if isinstance(func, ast.Name) and func.id == "getattr" and len(node.args) >= 2:
                name = node.args[1]
                if isinstance(name, ast.Constant) and isinstance(name.value, str):
                    return self.parent_names.get(name.value, set())
                return set(self.dynamic)
        if isinstance(node, ast.IfExp):
            return self.kind(node.body) | self.kind(node.orelse)
        if isinstance(node, ast.BoolOp):
            return set().union(*(self.kind(v) for v in node.values))
        return set()

    def bind(self, target: ast.AST, value: ast.AST | None, annotation: ast.AST | None = None) -> None:
        kinds = (self.kind(value) if value is not None else set()) | (_names_in(annotation) & set(self.sections))
        if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)):
            for t, v in zip(target.elts, value.elts):
                self.bind(t, v)
            return
        key = target.id if isinstance(target, ast.Name) else "." + target.attr if isinstance(target, ast.Attribute) \
            else target.arg if isinstance(target, ast.arg) else None
        if key and kinds:
            self.aliases.setdefault(key, set()).update(kinds)

    def collect_aliases(self, tree: ast.AST) -> None:
        for _ in range(3):  # aliases of aliases
            for node in ast.walk(tree):
                if isinstance(node, ast.Assign):
                    for target in node.targets:
                        self.bind(target, node.value)
                elif isinstance(node, ast.AnnAssign):
                    self.bind(node.target, node.value, node.annotation)
                elif isinstance(node, ast.arg) and node.annotation is not None:
                    self.bind(node, None, node.annotation)

    def read(self, value: ast.AST, attr: str) -> None:
        self.attributes.add(attr)
        for kind in self.kind(value):
            if attr in self.sections[kind].fields:
                self.reads.add((kind, attr))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self.read(node.value, node.attr)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name == "getattr" and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str):
            self.read(node.args[0], node.args[1].value)
        if name == "asdict" and node.args:
            for kind in self.kind(node.args[0]):
                self.reads.update((kind, f) for f in self.sections[kind].fields)
        self.generic_visit(node)


def unread_keys(schema_source: str, code: dict[str, str], dynamic_getattr: tuple[str, ...]) -> list[str]:
    """The dotted keys (first path of each section) whose field no code in ``code`` (path -> source)
    reads; ``dynamic_getattr``: the root's fields ``getattr(cfg, role)`` may return."""
    sections = parse_schema(schema_source)
    paths = section_paths(sections)
    parent_names: dict[str, set[str]] = {name: {ROOT_SECTION} for name in ROOT_NAMES}
    for name, where in paths.items():
        for path in where:
            if path:
                parent_names.setdefault(path[-1], set()).add(name)
    dynamic = {sections[ROOT_SECTION].children[f] for f in dynamic_getattr}
    reads: set[tuple[str, str]] = set()
    attributes: set[str] = set()
    for source in code.values():
        visitor = _Reads(sections, parent_names, dynamic)
        tree = ast.parse(source)
        visitor.collect_aliases(tree)
        visitor.visit(tree)
        reads |= visitor.reads
        attributes |= visitor.attributes
    # Schema methods called from outside (or by such a method) read on its behalf.
    done: set[tuple[str, str]] = set()
    while True:
        called = [(s.name, m) for s in sections.values() for m in s.methods
                  if m in attributes and not m.startswith("__") and (s.name, m) not in done]
        if not called:
            break
        for section, method in called:
            done.add((section, method))
            visitor = _Reads(sections, parent_names, dynamic, self_section=section)
            body = sections[section].methods[method]
            visitor.collect_aliases(body)
            visitor.visit(body)
            reads |= visitor.reads
            attributes |= visitor.attributes
    unread = []
    for name, section in sections.items():
        if name not in paths:
            continue  # not reachable from the root (a base class)
        for f in section.fields:
            if (name, f) not in reads:
                unread.append(".".join(paths[name][0] + (f,)))
    return unread


def _code() -> dict[str, str]:
    files = sorted(p for d in CODE_DIRS for p in (ROOT / d).rglob("*.py")
                   if not p.relative_to(ROOT).as_posix().startswith(EXCLUDED_DIR + "/"))
    return {str(p.relative_to(ROOT)): p.read_text() for p in files}


def _dynamic() -> tuple[str, ...]:
    from megarl.config.schema import ROLES

    return tuple(ROLES)


def test_every_config_key_is_read_outside_the_config_package():
    unread = unread_keys(SCHEMA.read_text(), _code(), _dynamic())
    assert not unread, (f"config keys no code outside megarl/config reads: {unread}; wire each where it belongs, or "
                        "delete it from megarl/config/schema.py, configs/ and docs/")


def test_the_schema_parse_is_the_dataclasses():
    """The ast view of the schema has the fields and nesting of the live dataclasses."""
    from megarl.config import schema

    sections = parse_schema(SCHEMA.read_text())
    paths = section_paths(sections)
    for name, where in paths.items():
        cls = getattr(schema, name)
        assert sections[name].fields == [f.name for f in dataclasses.fields(cls)], name
        for path in where:
            obj = schema.RunConfig()
            for part in path:
                obj = getattr(obj, part) or getattr(schema, sections[name].name)()  # a null section: its class
            assert type(obj).__name__ == name
    assert len(paths) == 20
    # The layouts are not sections of the schema but the code's own type, parallel.layout.MegatronLayout.
    assert type(schema.RunConfig().actor.layout).__name__ == "MegatronLayout" and "layout" not in sections["ActorConfig"].children


def test_a_new_unread_key_in_the_real_schema_is_caught():
    """What the test says when someone adds a key and forgets to wire it: the schema with new
    fields, some named like keys other sections have, against the real code. (The layouts are not
    in the schema: they are ``parallel.layout.MegatronLayout``, the type the code itself takes.)"""
    source = SCHEMA.read_text()
    for section, line in (("RolloutConfig", "    speculative_tokens: Int = 0\n"),
                          ("TrainerConfig", "    enabled: Bool = True\n"),  # `.enabled` is read for other sections
                          ("MultiTurnConfig", "    tp: Int = 1\n"),  # and `.tp` for the layouts and the rollout
                          ("OptimSettings", "    foreach: Bool = True\n")):
        head = f"class {section}(_Section):\n"
        start = source.index(head)
        body = source.index('"""\n', source.index('"""', start + len(head)) + 3) + 4  # after the docstring
        source = source[:body] + line + source[body:]
    unread = unread_keys(source, _code(), _dynamic())
    assert unread == ["actor.optim.foreach", "rollout.multi_turn.tp", "rollout.speculative_tokens", "trainer.enabled"]


# Synthetic schemas and code: each way of reading a key, and each near miss.
_SCHEMA = '''
class _Section:
    pass

class Layout(_Section):
    tp: int = 1
    pp: int = 1

    def __str__(self):
        return f"{self.tp} {self.pp}"

    def to_other(self):
        return Other(**asdict(self))

class Sampling(_Section):
    enabled: bool = False
    rounds: int = 3

class Penalty(_Section):
    enabled: bool = False
    factor: float = 1.0

class Algo(_Section):
    sampling: Sampling = field(default_factory=Sampling)
    penalty: Penalty = field(default_factory=Penalty)

class Actor(_Section):
    layout: Layout = field(default_factory=Layout)
    micro: int = 1

class RunConfig(_Section):
    actor: Actor = field(default_factory=Actor)
    algo: Algo = field(default_factory=Algo)

    def layout_for(self, role) -> Layout:
        return self.actor.layout

    @property
    def buffer(self) -> int:
        return self.algo.penalty.factor * 2
'''
_LEAVES = ["actor.layout.tp", "actor.layout.pp", "algo.sampling.enabled", "algo.sampling.rounds", "algo.penalty.enabled",
           "algo.penalty.factor", "actor.micro"]  # (in the schema's order)


@pytest.mark.parametrize("code, read", [
    ("x = 1", []),
    ("def f(cfg):\n    return cfg.actor.layout.tp, cfg.algo.sampling.enabled", ["actor.layout.tp", "algo.sampling.enabled"]),
    # an alias of a section, and an alias of an alias
    ("def f(cfg):\n    a = cfg.algo\n    s = a.sampling\n    return s.rounds", ["algo.sampling.rounds"]),
    ("def f(cfg):\n    p, s = cfg.algo.penalty, cfg.algo.sampling\n    return p.factor", ["algo.penalty.factor"]),
    ("def f(p: Penalty):\n    return p.enabled", ["algo.penalty.enabled"]),
    ("def f(cfg):\n    return getattr(cfg.actor, 'micro', 1)", ["actor.micro"]),
    ("def f(cfg, role):\n    return getattr(cfg, role).micro", ["actor.micro"]),
    ("def f(cfg):\n    return cfg.layout_for('actor').pp", ["actor.layout.pp"]),
    ("def f(layout):\n    return layout.tp", ["actor.layout.tp"]),  # a variable named as the section
    ("def f(self):\n    self.layout = self.cfg.actor.layout\n    return self.layout.tp", ["actor.layout.tp"]),
    # wholesale, directly or through a schema method that is called
    ("import dataclasses\ndef f(cfg):\n    return dataclasses.asdict(cfg.actor.layout)", ["actor.layout.tp", "actor.layout.pp"]),
    ("def f(cfg):\n    return cfg.actor.layout.to_other()", ["actor.layout.tp", "actor.layout.pp"]),
    ("def f(cfg):\n    return cfg.buffer", ["algo.penalty.factor"]),
    # near misses: a field of the same name in another section, printing a section, an unrelated `.rounds`
    ("def f(cfg):\n    return cfg.algo.penalty.enabled", ["algo.penalty.enabled"]),
    ("def f(cfg):\n    return str(cfg.actor.layout), f'{cfg.actor.layout}'", []),
    ("def f(game):\n    return game.rounds, game.factor", []),
    ("import dataclasses\ndef f(cfg):\n    return dataclasses.asdict(cfg)", []),  # the root's own fields only
])
def test_what_counts_as_a_read(code, read):
    unread = unread_keys(_SCHEMA, {"m.py": code}, dynamic_getattr=("actor",))
    assert [k for k in unread if k in _LEAVES] == [k for k in _LEAVES if k not in read]


def test_a_section_nothing_reads_is_caught_with_its_keys():
    code = "def f(cfg):\n    return cfg.algo.penalty.factor, cfg.actor.layout.tp, cfg.actor.layout.pp, cfg.actor.micro"
    assert unread_keys(_SCHEMA, {"m.py": code}, dynamic_getattr=()) == [
        "algo.sampling.enabled", "algo.sampling.rounds", "algo.penalty.enabled", "algo.sampling"]
