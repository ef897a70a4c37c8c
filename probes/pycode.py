"""Python code a person pasted beside the logs: the training script's own collectives under a rank's condition.

What an engineer looks for first when a report carries the script: a collective that only some ranks call. Every
rank must call every collective of a group in the same order (torch.distributed's documentation of each collective,
accelerate's `wait_for_everyone`, DeepSpeed's `save_checkpoint`, which "must be called on all ranks"), so

- a collective inside `if <rank test>:` with no call of the same collective on the other branch is one that the
  ranks which take that branch issue and the others never do (`if rank == 0: dist.barrier()`); and
- `if <rank test>: return` (or `break`, `continue`, `raise`, `sys.exit()`) before a collective later in the same
  block means that the ranks which take it skip the collective the others wait in.

Both read as `code_conditional_collective` events (the `if` line quoted, the collective, the ranks the test names
when it names them: `rank == 0`, `is_main_process`), which `playbooks/flowchart.py` weighs as conditional_collective
at modest confidence: the code shows that the ranks can diverge there, not that they did.

The code is found in the text as runs of lines that read as Python statements (a traceback's source lines, after
its `File "..."` lines, are not code of the paste), dedented and parsed with `ast`; a run that does not parse is cut
where the parser stopped and tried again, and left when it still does not. Nothing is run.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator

from hangdx.probes.model import Evidence, LogEvent, Quote, Source
from hangdx.probes.rx import lazy

EVENT = "code_conditional_collective"

# A line that reads as a Python statement, a decorator, a comment or a continuation of one.
_CODE = lazy(
    r"\s{0,64}(?:"
    r"(?:async\s+)?def\s+\w+\s*\(|class\s+\w+|import\s+\w|from\s+[\w.]+\s+import\s|@[\w.]+"
    r"|(?:if|elif|while|for|with|assert|return|raise|del|global|nonlocal|yield|await)\b"
    r"|(?:else|try|finally)\s*:|except\b|(?:break|continue|pass)\s*(?:#|$)"
    r"|[\w.\[\]'\"]+(?:\s*,\s*[\w.\[\]'\"]+){0,8}\s*(?:[-+*/%&|^]|//|\*\*|>>|<<)?=(?!=)"
    r"|[\w.]+(?:\[[^\]]{0,80}\])?\s*\(|#|[)\]}],?\s*(?:#|$)"
    r")"
)
_TRACEBACK_FILE = lazy(r'\s{0,16}File "[^"]{1,512}", line \d{1,7}')
# Stack-dump frames that look like calls but are not code: py-spy's `all_reduce (torch/.../c10d.py:3252)`, a native
# frame `ncclCommAbort (libnccl.so.2)`.
_DUMP_FRAME = lazy(r"\s{0,16}\S{1,300} \([^()\s]{1,512}(?::\d{1,7}|\.so[\w.]{0,16})\)\s*$")
# Attribute, variable and function names that say which rank runs the line.
_RANK_NAMES = frozenset({
    "rank", "local_rank", "global_rank", "node_rank", "world_rank", "process_index", "local_process_index",
    "is_main_process", "is_local_main_process", "is_global_zero", "is_local_zero", "is_master", "is_main",
    "is_rank_zero", "is_rank_0", "main_process", "master_process", "is_world_process_zero",
    "is_local_process_zero", "should_save", "get_rank", "get_local_rank", "get_global_rank", "is_main_rank",
    "local_process_zero", "is_first_rank", "is_last_rank", "is_pipeline_first_stage", "is_pipeline_last_stage",
})  # fmt: skip
# Names that mean rank 0 when true (a test on them names rank 0).
_ZERO_NAMES = frozenset({
    "is_main_process", "is_local_main_process", "is_global_zero", "is_local_zero", "is_master", "is_main",
    "is_rank_zero", "is_rank_0", "main_process", "master_process", "is_world_process_zero",
    "is_local_process_zero", "should_save", "is_main_rank", "local_process_zero",
})  # fmt: skip
_ENV_RANKS = frozenset(
    {"RANK", "LOCAL_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "NODE_RANK"}
)
# Collectives every rank of the group must call (torch.distributed, accelerate, Horovod, DeepSpeed).
_COLLECTIVES = frozenset({
    "barrier", "monitored_barrier", "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
    "_all_gather_base", "_reduce_scatter_base", "broadcast_object_list", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather_object", "scatter_object_list",
    "wait_for_everyone", "gather_for_metrics", "allreduce", "allgather", "allgather_object",
    "broadcast_parameters", "broadcast_optimizer_state", "new_group", "save_checkpoint",
})  # fmt: skip
# Collectives with a common name, counted only when called on a module or object that is a communication library.
_QUALIFIED = frozenset({"broadcast", "reduce", "gather", "scatter", "get_state_dict"})
_COMM_OWNERS = lazy(r"(?:^|\.)(?:dist|distributed|torch\.distributed|accelerator|hvd|comm|xm|deepspeed)$")
_EXITS = (ast.Return, ast.Break, ast.Continue, ast.Raise)
_MIN_LINES = 3
_MAX_LINES = 2000  # a run longer than this is a log that happens to look like code, not a paste


def scan(lines: list, src: Source, ev: Evidence) -> int:
    """Events for the rank-conditional collectives in the code runs of these clean lines; how many code lines
    were read (0 when the text holds no code)."""
    texts = [ln.text for ln in lines]
    worth = _worth(texts)
    read = 0
    for start, end in _runs(texts):
        parsed = _parse(texts[start:end])
        if parsed is None:
            continue
        tree, used = parsed
        read += used
        if not worth:
            continue  # code, read as such, with no collective in it
        try:
            found = list(_findings(tree))
        except (RecursionError, MemoryError, ValueError):
            continue  # a paste built to nest deeper than the walk goes: left unread, never a crash
        for node, call, ranks, how in found:
            no = start + node.lineno - 1
            if no >= len(lines):
                continue
            ev.events.append(
                LogEvent(
                    EVENT,
                    Quote(src.name, lines[no].no, lines[no].text.strip()),
                    host=src.host,
                    fields={
                        "collective": call,
                        "condition": (
                            _source(node.test) if isinstance(node, ast.If) else f"@{_decorator(node)}"
                        )[:200],
                        "ranks": ranks,
                        "how": how,
                    },
                )
            )
    return read


def _worth(texts: list[str]) -> bool:
    """Cheap: does the text hold both an `if` and a name of a collective at all?"""
    joined = "\n".join(t for t in texts if len(t) < 4000)
    return "if " in joined and any(c in joined for c in ("barrier", "all_reduce", "gather", "broadcast", "reduce",
                                                       "wait_for_everyone", "all_to_all", "save_checkpoint",
                                                       "new_group", "allreduce", "allgather"))  # fmt: skip


def _runs(texts: list[str]) -> Iterator[tuple[int, int]]:
    """(start, end) of each run of code lines: blank and comment lines inside a run are kept (they count for
    nothing: a gdb backtrace's `#0 ...` lines are comments to Python), a traceback's or a stack dump's frames are not
    code."""
    start = None
    code = 0
    after_file = False
    for i, t in enumerate(texts + [""]):
        is_tb = bool(_TRACEBACK_FILE.match(t))
        is_code = (
            not is_tb
            and not after_file
            and i < len(texts)
            and len(t) < 4000
            and bool(_CODE.match(t))
            and not t.lstrip().startswith("#")
            and not _DUMP_FRAME.match(t)
        )
        after_file = is_tb
        if is_code:
            if start is None:
                start, code = i, 0
            code += 1
            continue
        if start is not None and i < len(texts) and (not t.strip() or t.lstrip().startswith("#")):
            continue  # a blank or comment line inside the code
        if start is not None:
            if _MIN_LINES <= code <= _MAX_LINES:
                yield start, i
            start = None


def _parse(chunk: list[str]) -> tuple[ast.AST, int] | None:
    """The chunk as a module, cut at the first line Python cannot parse (three tries); (tree, lines used)."""
    lines = list(chunk)
    while lines and not lines[-1].strip():
        lines.pop()
    for _ in range(3):
        if len(lines) < _MIN_LINES:
            return None
        try:
            return ast.parse(textwrap.dedent("\n".join(lines))), len(lines)
        except SyntaxError as e:
            cut = (e.lineno or len(lines)) - 1
            # The statement that opened the block the error is in cannot stand without it: cut before that too.
            while cut > 0 and lines[cut - 1].rstrip().endswith((":", "(", "[", "{", ",", "\\")):
                cut -= 1
            if cut >= len(lines):
                cut = len(lines) - 1
            lines = lines[:cut]
        except (ValueError, RecursionError, MemoryError):
            return None
    return None


def _findings(tree: ast.AST) -> Iterator[tuple[ast.If, str, list[int], str]]:
    """(the `if`, the collective, the ranks its test names, "only" | "skip") for each place where two ranks of the
    same program would issue different collectives.

    Each function (and the module) is walked as a few ranks would run it: rank 0, rank 1 and the ranks its tests
    name, with every test that does not depend on the rank taken the same way on all of them (true, then false).
    Code whose ranks end up calling the same collectives (HF's classic `if local_rank not in (-1, 0): barrier()`
    ... `if local_rank == 0: barrier()`: every rank calls one barrier) is left alone."""
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
            _call_name(d.func if isinstance(d, ast.Call) else d)[1] in _RANK_ZERO_DECORATORS
            for d in fn.decorator_list
        ):
            called = _collectives(fn.body)
            if called:
                yield fn, called[0], [0], "only"  # type: ignore[misc]
    for body in _bodies(tree):
        sized = _sized_by_rank(body)
        if sized is not None:
            yield sized
            continue
        ranks = sorted(_candidates(body))
        for same in (True, False):
            runs = {r: _run(body, r, same) for r in ranks}
            if len({tuple(c for c, _ in seq) for seq in runs.values()}) < 2:
                continue
            found = _first_divergence(runs)
            if found is not None:
                yield found
                break


# Decorators that make a function run on rank 0 only (Lightning's rank_zero_only, accelerate's on_main_process).
_RANK_ZERO_DECORATORS = frozenset({"rank_zero_only", "on_main_process", "main_process_only", "on_rank_zero"})
# Collectives whose tensors must have the same size and dtype on every rank.
_SIZED = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor",
    "_reduce_scatter_base", "all_to_all", "all_to_all_single", "reduce", "broadcast", "allreduce", "allgather",
})  # fmt: skip
# Calls that make a tensor of a given size, or give one another size or dtype.
_SHAPERS = frozenset({
    "ones", "zeros", "empty", "full", "randn", "rand", "randint", "arange", "view", "reshape", "narrow", "expand",
    "repeat", "resize_", "half", "float", "double", "bfloat16", "to", "type",
})  # fmt: skip


def _sized_by_rank(body: list[ast.stmt]) -> tuple[ast.If, str, list[int], str] | None:
    """A collective every rank calls with a tensor that some ranks made with another size or dtype: a name changed
    under a rank test (and not on the other branch) that reaches the collective's tensor through a call that sizes
    or casts it (`if rank == 0: numel *= 2` ... `torch.ones(numel)` ... `all_reduce(t)`)."""
    changed: dict[str, ast.If] = {}  # name -> the rank test under which it was changed
    shaped: dict[str, ast.If] = {}  # tensor name -> the rank test its size or dtype depends on

    def names(node: ast.AST) -> set[str]:
        return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}

    def targets(stmt: ast.stmt) -> list[str]:
        if isinstance(stmt, ast.Assign):
            return [t.id for t in stmt.targets if isinstance(t, ast.Name)]
        if isinstance(stmt, (ast.AugAssign, ast.AnnAssign)) and isinstance(stmt.target, ast.Name):
            return [stmt.target.id]
        return []

    def walk(stmts: list[ast.stmt], under: ast.If | None) -> tuple[ast.If, str, list[int], str] | None:
        for stmt in stmts:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(stmt, ast.If):
                if _rank_test(stmt.test):
                    other = {t for s in ast.walk(ast.Module(body=stmt.orelse, type_ignores=[]))
                             if isinstance(s, ast.stmt) for t in targets(s)}  # fmt: skip
                    mine = {t for s in ast.walk(ast.Module(body=stmt.body, type_ignores=[]))
                            if isinstance(s, ast.stmt) for t in targets(s)}  # fmt: skip
                    for t in mine - other:
                        changed.setdefault(t, stmt)
                    if not other:
                        continue
                found = walk(stmt.body, under) or walk(stmt.orelse, under)
                if found:
                    return found
                continue
            for block in ("body", "orelse", "finalbody"):
                inner = getattr(stmt, block, None)
                if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                    found = walk(inner, under)
                    if found:
                        return found
            value = getattr(stmt, "value", None)
            for t in targets(stmt):
                for call in (
                    (n for n in ast.walk(value) if isinstance(n, ast.Call)) if value is not None else ()
                ):
                    if _call_name(call.func)[1] in _SHAPERS:
                        used = names(call) & (set(changed) | set(shaped))
                        if used:
                            u = next(iter(used))
                            shaped[t] = changed.get(u) or shaped[u]
                            break
            for call in (n for n in ast.walk(stmt) if isinstance(n, ast.Call)):
                owner, name = _call_name(call.func)
                if name in _SIZED and (name not in _QUALIFIED or _COMM_OWNERS.search(owner)):
                    args = call.args[:1] + [k.value for k in call.keywords if k.arg in ("tensor", "input")]
                    for a in args:
                        hit = names(a) & set(shaped)
                        if hit:
                            node = shaped[next(iter(hit))]
                            return node, name, _ranks_named(node.test), "size"
        return None

    return walk(body, None)


def _decorator(fn: ast.AST) -> str:
    for d in getattr(fn, "decorator_list", []):
        name = _call_name(d.func if isinstance(d, ast.Call) else d)[1]
        if name in _RANK_ZERO_DECORATORS:
            return name
    return ""


def _bodies(tree: ast.AST) -> Iterator[list[ast.stmt]]:
    """The module's statements and each function's."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            yield node.body


def _candidates(body: list[ast.stmt]) -> set[int]:
    """Ranks worth running the code as: 0, 1, and each rank a test compares with, and the one after it."""
    out = {0, 1}
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(node, ast.Compare) and _rank_test(node):
            for c in [node.left, *node.comparators]:
                for e in c.elts if isinstance(c, (ast.Tuple, ast.List, ast.Set)) else [c]:
                    if _is_const_int(e):
                        v = _int(e)
                        out |= {v, v + 1} if v >= 0 else set()
    return {r for r in out if 0 <= r < 1 << 20}


_Step = tuple[
    str, ast.If | None
]  # a collective called, and the rank-dependent `if` that led to it (None: none)


def _run(stmts: list[ast.stmt], rank: int, same: bool, via: ast.If | None = None) -> list[_Step]:
    """The collectives rank `rank` calls running these statements, in order, each with the innermost rank test
    that decided it; a return, raise, exit, break or continue ends the walk (a skipped rest is a divergence)."""
    out: list[_Step] = []
    for stmt in stmts:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(stmt, ast.If):
            taken = _truth(stmt.test, rank, same)
            by = stmt if _rank_test(stmt.test) else via
            branch = stmt.body if taken else stmt.orelse
            steps = _run(branch, rank, same, by)
            out += steps
            if _exits(branch):
                out.append(("<exit>", by))
                return out
            continue
        if isinstance(stmt, (ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith)):
            head = (
                [stmt.iter]
                if isinstance(stmt, (ast.For, ast.AsyncFor))
                else ([stmt.test] if isinstance(stmt, ast.While) else [i.context_expr for i in stmt.items])
            )
            out += [(c, via) for c in _collectives([ast.Expr(h) for h in head])]
            out += _run(stmt.body, rank, same, via)
            continue
        if isinstance(stmt, ast.Try):
            out += _run(stmt.body + stmt.finalbody, rank, same, via)
            continue
        out += [(c, via) for c in _collectives([stmt])]
        if isinstance(stmt, _EXITS) or _exits([stmt]):
            out.append(("<exit>", via))
            return out
    return out


def _first_divergence(runs: dict[int, list[_Step]]) -> tuple[ast.If, str, list[int], str] | None:
    """Where the ranks' sequences first part: the `if` that decided it, the collective one side calls there."""
    seqs = list(runs.values())
    n = min(len(s) for s in seqs)
    at = next((i for i in range(n) if len({s[i][0] for s in seqs}) > 1), n)
    for s in seqs:
        if at < len(s) and s[at][1] is not None:
            name, node = s[at]
            if name == "<exit>":
                later = [c for t in seqs for c, _ in t[at:] if c != "<exit>"]
                if not later:
                    continue
                return node, later[0], _ranks_named(node.test), "skip"
            return node, name, _ranks_named(node.test) if _in_body(node, runs, s) else [], "only"
    return None


def _in_body(node: ast.If, runs: dict[int, list[_Step]], seq: list[_Step]) -> bool:
    """Did the ranks of `seq` take the `if`'s own branch (so that the ranks its test names are the ones that call)?"""
    for r, s in runs.items():
        if s is seq:
            return bool(_truth(node.test, r, True))
    return False


def _truth(test: ast.expr, rank: int, same: bool) -> bool:
    """The test as rank `rank` evaluates it; what does not depend on the rank is `same` on every rank."""
    v = _value(test, rank, same)
    return bool(v) if v is not None else same


def _value(node: ast.expr, rank: int, same: bool) -> object:
    """A small evaluator of rank tests: the rank's value, ints, comparisons, and/or/not; None when unknown."""
    if isinstance(node, ast.BoolOp):
        vals = [_truth(v, rank, same) for v in node.values]
        return all(vals) if isinstance(node.op, ast.And) else any(vals)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return not _truth(node.operand, rank, same)
    if _is_const_int(node):
        return _int(node)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        vals = [_value(e, rank, same) for e in node.elts]
        return None if any(v is None for v in vals) else vals
    name = _rank_name(node)
    if name is not None:
        return (rank == 0) if name in _ZERO_NAMES else rank
    if isinstance(node, ast.BinOp):
        a, b = _value(node.left, rank, same), _value(node.right, rank, same)
        if type(a) is int and type(b) is int:
            ops = {ast.Mod: lambda x, y: x % y if y else None, ast.Add: lambda x, y: x + y,
                   ast.Sub: lambda x, y: x - y, ast.FloorDiv: lambda x, y: x // y if y else None}  # fmt: skip
            f = ops.get(type(node.op))
            return f(a, b) if f else None
        return None
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        a, b = _value(node.left, rank, same), _value(node.comparators[0], rank, same)
        if a is None or b is None:
            return None
        op = node.ops[0]
        try:
            if isinstance(op, ast.In):
                return a in b  # type: ignore[operator]
            if isinstance(op, ast.NotIn):
                return a not in b  # type: ignore[operator]
            cmp = {ast.Eq: a == b, ast.NotEq: a != b}
            if type(op) in cmp:
                return cmp[type(op)]
            if type(a) is int and type(b) is int:
                return {ast.Lt: a < b, ast.LtE: a <= b, ast.Gt: a > b, ast.GtE: a >= b}.get(type(op))
        except TypeError:
            return None
    return None


def _rank_name(node: ast.expr) -> str | None:
    """The rank-naming name an expression reads (`args.local_rank`, `dist.get_rank()`, `int(os.environ["RANK"])`,
    `accelerator.is_main_process`), lower-cased; None when it reads none."""
    if isinstance(node, ast.Call):
        fname = _call_name(node.func)[1]
        if fname == "int" and len(node.args) == 1:
            return _rank_name(node.args[0])
        if fname in ("get", "getenv") and node.args and isinstance(node.args[0], ast.Constant):
            return "rank" if node.args[0].value in _ENV_RANKS else None
        return fname.lower() if fname.lower() in _RANK_NAMES else None
    if isinstance(node, ast.Name) and node.id.lower() in _RANK_NAMES:
        return node.id.lower()
    if isinstance(node, ast.Attribute) and node.attr.lower() in _RANK_NAMES:
        return node.attr.lower()
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return "rank" if node.slice.value in _ENV_RANKS else None
    return None


def _exits(body: list[ast.stmt]) -> bool:
    """The block ends the function, the loop's turn or the program: return, break, continue, raise, sys.exit()."""
    if not body:
        return False
    last = body[-1]
    if isinstance(last, _EXITS):
        return True
    if isinstance(last, ast.Expr) and isinstance(last.value, ast.Call):
        return _call_name(last.value.func)[1] in ("exit", "_exit", "quit")
    return False


def _rank_test(test: ast.expr) -> bool:
    """Does the test read the rank (a name, attribute, call or environment variable that names it)?"""
    return any(_rank_name(n) is not None for n in ast.walk(test) if isinstance(n, ast.expr))


def _ranks_named(test: ast.expr) -> list[int]:
    """The ranks for which the test is true, when they are a few named ones (`rank == 0`, `rank in (-1, 0)`,
    `is_main_process`); [] when it is true for all ranks past some (`rank != 0`, `rank > 0`) or says none."""
    consts = [_int(n) for n in ast.walk(test) if isinstance(n, ast.expr) and _is_const_int(n)]
    top = max([c for c in consts if c >= 0] + [0]) + 2
    true = [r for r in range(top + 1) if _value(test, r, True) is True]
    return true if true and top not in true else []


def _is_const_int(node: ast.expr) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and _is_const_int(node.operand):
        return True
    return isinstance(node, ast.Constant) and type(node.value) is int


def _int(node: ast.expr) -> int:
    if isinstance(node, ast.UnaryOp):
        return -_int(node.operand)
    return node.value  # type: ignore[attr-defined, return-value]


def _collectives(stmts: list[ast.stmt]) -> list[str]:
    """The collectives these statements call, in order (not inside a function or class they define)."""
    out: list[str] = []
    todo: list[ast.AST] = list(reversed(stmts))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Call):
            owner, name = _call_name(node.func)
            if name in _COLLECTIVES or name in _QUALIFIED and _COMM_OWNERS.search(owner):
                if name not in out:
                    out.append(name)
        todo.extend(reversed(list(ast.iter_child_nodes(node))))
    return out


def _call_name(func: ast.expr) -> tuple[str, str]:
    """(owner as written, name) of a call's function: `dist.barrier` -> ("dist", "barrier")."""
    if isinstance(func, ast.Attribute):
        return _source(func.value), func.attr
    if isinstance(func, ast.Name):
        return "", func.id
    return "", ""


def _source(node: ast.AST) -> str:
    try:
        return ast.unparse(node)
    except Exception:  # noqa: BLE001 - a node unparse cannot print is left unnamed
        return ""
