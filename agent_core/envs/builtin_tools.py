"""The built-in tools, registered in `agent_core.envs.tools.TOOLS`: `search` and `calculator`.

`search` is BM25 over the rollout's corpus, the same retrieval as the `search_qa` env, but called
as a function-calling tool and rendered as numbered "Doc i (Title): text" lines.

`calculator` evaluates arithmetic without eval/exec: the expression is parsed with `ast` and only
number literals, + - * / // % **, unary +/-, a whitelist of functions and the constants pi and e
are interpreted. Python's own semantics apply (`/` is true division, `//` floors, ints are exact),
with limits Python lacks, so one call cannot eat the machine: the expression length, the nesting
depth and the size of integers (hence of `**`) are capped, and non-finite results are errors.

Registered when the `agent_core.envs` package is imported (its `__init__` imports this module).
"""

from __future__ import annotations

import ast
import math
import operator
import threading
from typing import TYPE_CHECKING, Any, Callable

from agent_core.envs.tools import TOOLS, Tool, ToolResources, ToolResult, function_tool

if TYPE_CHECKING:
    from agent_core.envs.search import Bm25Index

MAX_SEARCH_TOP_K = 10


class SearchTool(Tool):
    """BM25 search over a corpus; the model may ask for 1..MAX_SEARCH_TOP_K passages."""

    name = "search"
    description = "Search the document collection and return the best-matching passages, best first."

    def __init__(self, index: Bm25Index, default_top_k: int = 3):
        if not 1 <= default_top_k <= MAX_SEARCH_TOP_K:
            raise ValueError(f"tool 'search': top_k must be in 1..{MAX_SEARCH_TOP_K}, got {default_top_k}")
        self.index = index
        self.default_top_k = default_top_k
        super().__init__(parameters={
            "type": "object",
            "properties": {
                "query": {
                    "type": "string", "minLength": 1, "description": "What to search for, e.g. a name or a question.",
                },
                "top_k": {
                    "type": "integer", "minimum": 1, "maximum": MAX_SEARCH_TOP_K, "default": default_top_k,
                    "description": "How many passages to return.",
                },
            },
            "required": ["query"],
            "additionalProperties": False,
        })

    def execute(self, arguments: dict[str, Any]) -> ToolResult:
        query = arguments["query"]
        documents = self.index.search(query, arguments.get("top_k", self.default_top_k))
        if not documents:
            return ToolResult(text=f"No results for {query!r}.", info={"doc_ids": []})
        text = "\n".join(f"Doc {i} ({doc.title}): {doc.text}" for i, doc in enumerate(documents, start=1))
        return ToolResult(text=text, info={"doc_ids": [doc.doc_id for doc in documents]})


@TOOLS.register("search")
def _make_search(resources: ToolResources, *, top_k: int = 3) -> SearchTool:
    if getattr(resources, "search_index", None) is None:
        raise ValueError(
            "tool 'search' needs a corpus to search: resources.search_index is None "
            "(the env needs a corpus: build a Bm25Index from the dataset's documents)"
        )
    return SearchTool(resources.search_index, default_top_k=top_k)


# ---- calculator -------------------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 500
MAX_NESTING_DEPTH = 100  # AST levels; a flat sum of n terms is n levels deep
MAX_INT_DIGITS = 300  # ints beyond this are refused (floats stop at ~1e308 anyway)
_INT_LIMIT = 10**MAX_INT_DIGITS

_BINARY_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY_OPERATORS: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_UNSUPPORTED_OPERATORS = {
    ast.BitXor: "^ (bitwise xor; use ** for powers)", ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<",
    ast.RShift: ">>", ast.MatMult: "@", ast.Invert: "~", ast.Not: "not",
}


def _round(x: Any, ndigits: Any = None) -> Any:
    if ndigits is not None and (not isinstance(ndigits, int) or abs(ndigits) > MAX_INT_DIGITS):
        raise ValueError(f"ndigits must be an integer within ±{MAX_INT_DIGITS}, got {ndigits!r}")
    return round(x) if ndigits is None else round(x, ndigits)


# name -> (function, min args, max args or None for any number)
_FUNCTIONS: dict[str, tuple[Callable[..., Any], int, int | None]] = {
    "abs": (abs, 1, 1), "round": (_round, 1, 2), "min": (lambda *xs: min(xs), 1, None),
    "max": (lambda *xs: max(xs), 1, None), "sqrt": (math.sqrt, 1, 1), "log": (math.log, 1, 2),
    "exp": (math.exp, 1, 1), "sin": (math.sin, 1, 1), "cos": (math.cos, 1, 1), "tan": (math.tan, 1, 1),
    "floor": (math.floor, 1, 1), "ceil": (math.ceil, 1, 1),
}
_CONSTANTS = {"pi": math.pi, "e": math.e}
_GRAMMAR = (
    "allowed: numbers, + - * / // % **, parentheses, the functions "
    f"{', '.join(_FUNCTIONS)} and the constants {', '.join(_CONSTANTS)}"
)
_NODE_NAMES = {
    ast.Attribute: "attribute access", ast.Lambda: "lambda", ast.ListComp: "comprehensions",
    ast.SetComp: "comprehensions", ast.DictComp: "comprehensions", ast.GeneratorExp: "comprehensions",
    ast.Subscript: "indexing", ast.Compare: "comparisons", ast.BoolOp: "and/or", ast.IfExp: "if/else",
    ast.List: "lists", ast.Tuple: "tuples", ast.Dict: "dicts", ast.Set: "sets", ast.JoinedStr: "strings",
    ast.NamedExpr: "assignment (:=)", ast.Starred: "* unpacking", ast.Await: "await",
}


# CPython 3.11's parser is not safe to call from several threads at once (gh-106905: "AST
# constructor recursion depth mismatch" on valid input); env workers run tools in threads.
_PARSE_LOCK = threading.Lock()


def _parse(expression: str, attempts: int = 3) -> ast.Expression:
    """ast.parse under the lock; parsed again on the SystemError of gh-106905, which a thread outside
    the lock (any library compiling code) can still cause on valid input."""
    for attempt in range(attempts):
        try:
            with _PARSE_LOCK:
                return ast.parse(expression, mode="eval")
        except SystemError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def evaluate_expression(expression: str) -> int | float:
    """The value of arithmetic `expression`; ValueError saying what is wrong for anything else."""
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression is {len(expression)} characters long; the limit is {MAX_EXPRESSION_CHARS}")
    try:
        tree = _parse(expression.strip())
    except SyntaxError as exc:
        raise ValueError(f"not a valid arithmetic expression ({exc.msg}); {_GRAMMAR}") from None
    except (RecursionError, MemoryError):
        raise ValueError("expression is nested too deeply") from None
    return _evaluate(tree.body, depth=1)


def _evaluate(node: ast.AST, depth: int) -> int | float:
    if depth > MAX_NESTING_DEPTH:
        raise ValueError(f"expression is nested too deeply (more than {MAX_NESTING_DEPTH} levels)")
    if isinstance(node, ast.Constant):
        return _checked(_literal(node.value))
    if isinstance(node, ast.Name):
        return _constant(node.id)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPERATORS:
        operand = _evaluate(node.operand, depth + 1)
        return _checked(_UNARY_OPERATORS[type(node.op)](operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPERATORS:
        left, right = _evaluate(node.left, depth + 1), _evaluate(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _apply(_BINARY_OPERATORS[type(node.op)], left, right, what=f"{ast.unparse(node):.60}")
    if isinstance(node, ast.Call):
        return _call(node, depth)
    if isinstance(node, (ast.BinOp, ast.UnaryOp)):
        symbol = _UNSUPPORTED_OPERATORS.get(type(node.op), type(node.op).__name__)
        raise ValueError(f"not allowed: operator {symbol}; {_GRAMMAR}")
    what = _NODE_NAMES.get(type(node), f"{type(node).__name__} syntax")
    raise ValueError(f"not allowed: {what}; {_GRAMMAR}")


def _literal(value: Any) -> int | float:
    if isinstance(value, complex):
        raise ValueError("imaginary numbers are not supported")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"only numbers are allowed, got {type(value).__name__} {value!r:.40}")
    return value


def _constant(name: str) -> float:
    if name in _CONSTANTS:
        return _CONSTANTS[name]
    if name in _FUNCTIONS:
        raise ValueError(f"{name} is a function; call it like {name}(x)")
    raise ValueError(f"unknown name {name!r:.40}; {_GRAMMAR}")


def _call(node: ast.Call, depth: int) -> int | float:
    if not isinstance(node.func, ast.Name):
        _evaluate(node.func, depth + 1)  # raises naming the syntax, e.g. attribute access, lambda
        raise ValueError(f"only named functions can be called; {_GRAMMAR}")
    if node.func.id not in _FUNCTIONS:
        raise ValueError(f"unknown function {node.func.id!r:.40}; allowed functions: {', '.join(_FUNCTIONS)}")
    name = node.func.id
    function, min_args, max_args = _FUNCTIONS[name]
    if node.keywords or any(isinstance(arg, ast.Starred) for arg in node.args):
        raise ValueError(f"{name}() takes plain positional arguments only")
    if not min_args <= len(node.args) <= (max_args if max_args is not None else len(node.args)):
        expected = (
            f"{min_args}" if min_args == max_args else f"{min_args} to {max_args}" if max_args else f"at least {min_args}"
        )
        raise ValueError(f"{name}() takes {expected} argument(s), got {len(node.args)}")
    arguments = [_evaluate(arg, depth + 1) for arg in node.args]
    return _apply(function, *arguments, what=f"{name}()")


def _check_power(base: int | float, exponent: int | float) -> None:
    # Only int ** positive int can grow without bound (float powers overflow to an error instead).
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if exponent * math.log10(abs(base)) > MAX_INT_DIGITS:
            raise ValueError(f"result too large: {base} ** {exponent} has more than {MAX_INT_DIGITS} digits")


def _apply(function: Callable[..., Any], *arguments: Any, what: str) -> int | float:
    try:
        value = function(*arguments)
    except ZeroDivisionError:
        raise ValueError(f"division by zero in {what}") from None
    except OverflowError:
        raise ValueError(f"result too large in {what}") from None
    except (ValueError, TypeError) as exc:
        raise ValueError(f"invalid input to {what}: {exc}") from None
    return _checked(value)


def _checked(value: Any) -> int | float:
    if isinstance(value, complex):
        raise ValueError("the result is not a real number (e.g. a fractional power of a negative number)")
    if isinstance(value, int) and abs(value) >= _INT_LIMIT:
        raise ValueError(f"result too large: more than {MAX_INT_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("result is not finite (overflow or undefined)")
    return value


def format_number(value: int | float) -> str:
    """Ints exactly; floats with up to 12 significant digits (so 0.1 + 0.2 shows as 0.3)."""
    if isinstance(value, int):
        return str(value)
    return "0" if value == 0 else format(value, ".12g")


@function_tool(name="calculator")
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: Numbers, + - * / // % ** and parentheses, the functions abs, round, min, max,
            sqrt, log, exp, sin, cos, tan, floor, ceil and the constants pi and e,
            e.g. "sqrt(2) * (3 + 4) ** 2".
    """
    return format_number(evaluate_expression(expression))


@TOOLS.register("calculator")
def _make_calculator(resources: ToolResources) -> Tool:
    return calculator  # stateless, so every env shares one instance
