"""Griffe extension for the API reference: the package's docstrings, read the way the site shows them.

The docstrings are written for ``help()`` and doctest as much as for the site. Two of their habits
are translated here, at load time, so that the source stays as it is:

* reStructuredText roles (``:func:`info_nce```, ``:class:`~contrastive_dist.EmptySafeCollate```)
  become links to the API page of their target when that target has one, and code otherwise
  (private helpers named in a docstring have no page);
* an ``Example:`` section becomes ``Examples:``, the Google-style section whose ``>>>`` lines are
  shown as highlighted code.

A link the site cannot resolve fails the strict build, so a docstring that names a public object
under a wrong name is caught in the test suite.
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Module, Object

ROLE = re.compile(r":(?:func|class|meth|attr|mod|data|exc|obj):`(~?)([\w.]+)`")
EXAMPLE_SECTION = re.compile(r"^(\s*)Example:\s*$", flags=re.MULTILINE)
PACKAGE = "contrastive_dist"
DOCUMENTED_MODULES = ("lightning", "testing")  # rendered with their members on API pages


def _documented(obj: Object, path: str, into: dict[str, str]) -> None:
    """Record ``obj`` under its public ``path``, and its public members that have a docstring."""
    target = obj.final_target if obj.is_alias else obj  # type: ignore[attr-defined]
    name = path.rsplit(".", 1)[-1]
    if target.is_module and name in target.members:
        # `siglip` is both a module of `losses` and the function it exports: the page renders the function
        # under its own path, contrastive_dist.losses.siglip.siglip.
        target = target.members[name]
        path = target.path
    into[target.path] = path
    into.setdefault(path, path)
    if target.is_class:
        for name, member in target.members.items():
            if not name.startswith("_") and not member.is_alias and member.docstring:
                into[member.path] = f"{path}.{name}"
                into.setdefault(f"{path}.{name}", f"{path}.{name}")


def public_paths(package: Module) -> dict[str, str]:
    """Every path the API pages render, mapped to the public path its heading is registered under.

    Canonical paths (``contrastive_dist.losses.infonce.info_nce``) map to the public one
    (``contrastive_dist.info_nce``), and public paths to themselves.
    """
    paths: dict[str, str] = {}
    for name in package.exports or ():
        _documented(package[name], f"{PACKAGE}.{name}", paths)
        if f"{PACKAGE}.{name}" not in paths:  # shadowed by a module of the same name: see _documented
            paths[f"{PACKAGE}.{name}"] = paths[package[name].final_target.members[name].path]
    for module_name in DOCUMENTED_MODULES:
        module = package[module_name]
        paths[module.path] = module.path
        for name in module.exports or ():
            _documented(module[name], f"{module.path}.{name}", paths)
    return paths


def _candidates(target: str, owner: Object) -> list[str]:
    """Where a role's target may live, most specific first (the docstring's class, module, the package)."""
    if target.startswith(PACKAGE):
        return [target]
    scopes: list[str] = []
    scope: Any = owner
    while scope is not None:
        scopes.append(scope.path)
        scope = scope.parent
    if target.startswith("."):
        module = owner if owner.is_module else owner.module
        return [f"{module.path}{target}"]
    public = [f"{PACKAGE}.{target}", *(f"{PACKAGE}.{module}.{target}" for module in DOCUMENTED_MODULES)]
    return [f"{scope_path}.{target}" for scope_path in scopes] + public


def link_roles(text: str, owner: Object, paths: dict[str, str]) -> str:
    """Replace every role in ``text`` by a cross-reference (documented target) or code (any other)."""

    def replace(match: re.Match[str]) -> str:
        short, target = match.group(1), match.group(2)
        shown = target.rsplit(".", 1)[-1] if short else target.lstrip(".")
        for candidate in _candidates(target, owner):
            if candidate in paths:
                return f"[`{shown}`][{paths[candidate]}]"
        return f"`{shown}`"

    return ROLE.sub(replace, text)


def _objects(obj: Object) -> list[Object]:
    found = [obj]
    for member in obj.members.values():
        if not member.is_alias:
            found.extend(_objects(member))  # type: ignore[arg-type]
    return found


class SiteDocstrings(Extension):
    """Links reStructuredText roles to API pages and shows ``Example:`` sections as code."""

    def on_package(self, *, pkg: Module, **kwargs: Any) -> None:
        """Rewrite every docstring of the package once it is loaded."""
        if pkg.name != PACKAGE:
            return
        paths = public_paths(pkg)
        for obj in _objects(pkg):
            if obj.docstring is not None:
                value = link_roles(obj.docstring.value, obj, paths)
                obj.docstring.value = EXAMPLE_SECTION.sub(r"\1Examples:", value)
