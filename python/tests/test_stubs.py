"""The type stubs (kvbridge/__init__.pyi) match the module: every name, every
parameter name and every literal default, both ways, so they cannot drift."""
import ast
import inspect
import pathlib
import re

import kvbridge

STUB = pathlib.Path(kvbridge.__file__).with_name("__init__.pyi")
_SIG = re.compile(r"^\s*(?:\d+\. )?(\w+)\((.*)\) -> ")


def _split(params):
    out, depth, cur = [], 0, ""
    for ch in params:
        depth += ch in "([{<"
        depth -= ch in ")]}>"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + ([cur.strip()] if cur.strip() else [])


def _literal(text):
    try:
        return ("value", ast.literal_eval(text))
    except (ValueError, SyntaxError):
        return ("text", text)


def module_signatures(obj):
    """[(name, default or None)] per overload: pybind11 puts them in the docstring."""
    try:
        sig = inspect.signature(obj)
        return [[(p.name, None if p.default is inspect.Parameter.empty else ("value", p.default))
                 for p in sig.parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]]
    except (TypeError, ValueError):
        pass
    sigs = []
    for line in (getattr(obj, "__doc__", "") or "").splitlines():
        m = _SIG.match(line)
        if not m:
            continue
        params = []
        for p in _split(m.group(2)):
            if p.startswith("*"):
                continue
            name = p.split(":")[0].split("=")[0].strip()
            params.append((name, _literal(p.split("=", 1)[1].strip()) if "=" in p else None))
        sigs.append(params)
    return sigs


def stub_signature(fn):
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args]
    defaults = [None] * (len(names) - len(a.defaults)) + [_literal(ast.unparse(d)) for d in a.defaults]
    params = list(zip(names, defaults))
    params += [(k.arg, None if d is None else _literal(ast.unparse(d))) for k, d in zip(a.kwonlyargs, a.kw_defaults)]
    return params


def same(stub, module):
    if [n for n, _ in stub] != [n for n, _ in module]:
        return False
    for (_, s), (_, m) in zip(stub, module):
        if (s is None) != (m is None):
            return False
        # Literal defaults must agree; others (enums, objects) are shown as
        # text, and the stub's `...` stands for any default.
        if s is not None and s[0] == "value" and m[0] == "value" and s[1] is not Ellipsis and s[1] != m[1]:
            return False
    return True


def check_function(where, obj, node, method, problems):
    stub = stub_signature(node)
    if method and stub and stub[0][0] in ("self", "cls"):
        stub = stub[1:]
    sigs = module_signatures(obj)
    if not sigs:
        return
    for sig in sigs:
        if method and sig and sig[0][0] == "self":
            sig = sig[1:]
        if same(stub, sig):
            return
    problems.append(f"{where}: the stub says {stub}, the module {sigs}")


def stub_names(tree):
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | {
        n.target.id for n in tree.body if isinstance(n, ast.AnnAssign)}


def test_every_stub_name_and_signature_matches_the_module():
    tree = ast.parse(STUB.read_text())
    problems = []
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and not hasattr(kvbridge, node.target.id):
            problems.append(f"{node.target.id}: in the stub, not in the module")
        if isinstance(node, ast.FunctionDef):
            if not hasattr(kvbridge, node.name):
                problems.append(f"{node.name}(): in the stub, not in the module")
                continue
            check_function(node.name, getattr(kvbridge, node.name), node, False, problems)
        if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
            continue
        cls = getattr(kvbridge, node.name, None)
        if cls is None:
            problems.append(f"class {node.name}: in the stub, not in the module")
            continue
        for m in node.body:
            if isinstance(m, ast.FunctionDef):
                if not hasattr(cls, m.name):
                    problems.append(f"{node.name}.{m.name}: in the stub, not in the module")
                elif m.name == "__init__" or not m.name.startswith("__"):
                    check_function(f"{node.name}.{m.name}", getattr(cls, m.name), m, True, problems)
            elif isinstance(m, ast.AnnAssign) and not hasattr(cls, m.target.id):
                if (node.name, m.target.id) != ("Error", "code"):  # set on each raised error, checked below
                    problems.append(f"{node.name}.{m.target.id}: in the stub, not in the module")
    assert not problems, "\n".join(problems)


def test_every_public_name_of_the_module_is_in_the_stub_and_in_all():
    names = stub_names(ast.parse(STUB.read_text()))
    public = {n for n in dir(kvbridge) if not n.startswith("_") and not inspect.ismodule(getattr(kvbridge, n))}
    assert not (public - names), f"in the module, not in the stub: {sorted(public - names)}"
    missing = public - set(kvbridge.__all__) - {"testing"}
    assert not missing, f"public but not in __all__: {sorted(missing)}"
    extra = {n for n in kvbridge.__all__ if not hasattr(kvbridge, n)}
    assert not extra, f"in __all__, not in the module: {sorted(extra)}"


def test_a_raised_error_has_its_code():
    try:
        kvbridge.make_preset("no-such-preset")
    except kvbridge.Error as e:
        assert e.code == "not_found"
    else:
        raise AssertionError("make_preset of an unknown name raised nothing")
