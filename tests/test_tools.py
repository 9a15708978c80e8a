"""The tool layer: schema derivation, declaration checks, execute_call's error outcomes (bad
arguments, unknown tool, exception, timeout, truncation), the tool registry, the calculator (hand
values, a property test against Python's arithmetic, rejections) and search over a real index."""

from __future__ import annotations

import math
import random
import subprocess
import sys
import threading
import time
from typing import Literal, Optional

import pytest

from agent_core.envs.builtin_tools import (
    MAX_EXPRESSION_CHARS,
    SearchTool,
    calculator,
    evaluate_expression,
    format_number,
)
from agent_core.envs.registry import EnvResources
from agent_core.envs.search import Bm25Index
from agent_core.envs import tools as tools_module
from agent_core.envs.tools import (
    TOOLS,
    FunctionTool,
    Tool,
    ToolCallOutcome,
    ToolResult,
    abandoned_calls,
    execute_call,
    function_tool,
    make_tool,
    tool_kwarg_names,
)
from agent_core.registry import UnknownNameError
from agent_core.types import Document

# ---- function_tool: schema derivation -------------------------------------------------------------


@function_tool(timeout_s=2.5)
def find_flights(
    origin: str,
    passengers: int,
    cabin: Literal["economy", "business"],
    stops: list[int],
    budget: float | None,
    airline: Optional[str] = None,
    refundable: bool = False,
    limits: dict[str, int] = {},  # noqa: B006 - a JSON default, never mutated
) -> str:
    """Find flights from an airport.

    Results are sorted by price.

    Args:
        origin: IATA code of the departure airport,
            for example "LHR".
        passengers (int): How many people travel.
        cabin: Cabin class.
        stops: Allowed numbers of stops.
        budget: Highest total price, or null for any.
        airline: Only this airline.

    Returns:
        A table of flights.
    """
    return f"{origin}|{passengers}|{cabin}|{stops}|{budget}|{airline}|{refundable}|{limits}"


def test_function_tool_derives_the_schema_from_hints_defaults_and_docstring():
    assert isinstance(find_flights, FunctionTool)
    assert find_flights.spec() == {
        "type": "function",
        "function": {
            "name": "find_flights",
            "description": "Find flights from an airport.",
            "parameters": {
                "type": "object",
                "properties": {
                    "origin": {"type": "string", "description": 'IATA code of the departure airport, for example "LHR".'},
                    "passengers": {"type": "integer", "description": "How many people travel."},
                    "cabin": {"type": "string", "enum": ["economy", "business"], "description": "Cabin class."},
                    "stops": {"type": "array", "items": {"type": "integer"}, "description": "Allowed numbers of stops."},
                    "budget": {"type": ["number", "null"], "description": "Highest total price, or null for any."},
                    "airline": {"type": ["string", "null"], "description": "Only this airline.", "default": None},
                    "refundable": {"type": "boolean", "default": False},
                    "limits": {"type": "object", "additionalProperties": {"type": "integer"}, "default": {}},
                },
                "required": ["origin", "passengers", "cabin", "stops"],
                "additionalProperties": False,
            },
        },
    }
    assert find_flights.timeout_s == 2.5


def test_function_tool_calls_the_function_with_defaults_and_none_for_missing_optionals():
    outcome = execute_call(
        {"find_flights": find_flights}, "find_flights",
        {"origin": "LHR", "passengers": 2, "cabin": "economy", "stops": [0, 1]}, default_timeout_s=5,
    )
    assert outcome.ok, outcome.text
    assert outcome.text == "LHR|2|economy|[0, 1]|None|None|False|{}"
    assert find_flights("A", 1, "business", [], 9.5) == "A|1|business|[]|9.5|None|False|{}"  # still callable


def test_function_tool_with_options_and_optional_literal():
    @function_tool(name="set-mode", description="Switch the mode.")
    def switch(mode: Optional[Literal["fast", "slow"]] = None, level: Literal[1, 2, 3] = 1):
        return ToolResult(text=f"{mode}:{level}", reward=0.5, info={"mode": mode})

    assert switch.name == "set-mode" and switch.description == "Switch the mode."
    assert switch.parameters["properties"] == {
        "mode": {"type": ["string", "null"], "enum": ["fast", "slow", None], "default": None},
        "level": {"type": "integer", "enum": [1, 2, 3], "default": 1},
    }
    outcome = execute_call({"set-mode": switch}, "set-mode", {"mode": "slow"}, default_timeout_s=5)
    assert (outcome.ok, outcome.text, outcome.reward, outcome.info["mode"]) == (True, "slow:1", 0.5, "slow")


def _untyped(query, top_k: int = 3):
    """Search."""


def _set_param(ids: set[int]):
    """Ids."""


def _bad_union(value: int | str):
    """Either."""


def _star_args(*queries: str):
    """Many."""


def _documents_ghost(query: str):
    """Search.

    Args:
        query: What to find.
        top_k: Not a parameter.
    """


def _undocumented(query: str):
    pass


def _bad_default(when: float = math.nan):
    """NaN is not JSON."""


@pytest.mark.parametrize(
    "function, words",
    [
        (_untyped, ["_untyped", "'query'", "no type hint"]),
        (_set_param, ["_set_param", "'ids'", "unsupported type"]),
        (_bad_union, ["_bad_union", "'value'", "X | None"]),
        (_star_args, ["_star_args", "'queries'"]),
        (_documents_ghost, ["_documents_ghost", "'top_k'"]),
        (_undocumented, ["_undocumented", "docstring"]),
        (_bad_default, ["_bad_default", "'when'", "not JSON"]),
    ],
)
def test_bad_function_declarations_raise_naming_the_function_and_parameter(function, words):
    with pytest.raises(TypeError) as raised:
        function_tool(function)
    for word in words:
        assert word in str(raised.value)


# ---- Tool: explicit declarations -------------------------------------------------------------------


class Echo(Tool):
    name = "echo"
    description = "Repeat the text, optionally shouting."
    parameters = {
        "type": "object",
        "properties": {
            "text": {"type": "string"},
            "volume": {"type": "string", "enum": ["quiet", "loud"]},
            "times": {"type": "integer", "minimum": 1, "maximum": 3},
        },
        "required": ["text"],
        "additionalProperties": False,
    }

    def execute(self, arguments):
        text = arguments["text"].upper() if arguments.get("volume") == "loud" else arguments["text"]
        return " ".join([text] * arguments.get("times", 1))


def test_subclass_tool_runs_with_its_declared_schema():
    tools = {"echo": Echo()}
    outcome = execute_call(tools, "echo", {"text": "hi", "volume": "loud", "times": 2}, default_timeout_s=5)
    assert outcome == ToolCallOutcome(
        name="echo", arguments={"text": "hi", "volume": "loud", "times": 2}, ok=True, text="HI HI",
        reward=0.0, error_kind=None, latency_s=outcome.latency_s, info={"truncated_chars": 0},
    )
    assert Echo().spec()["function"]["parameters"] is Echo.parameters


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"name": "has space"}, ["'has space'", "name must match"]),
        ({"name": "9lives"}, ["'9lives'", "name must match"]),
        ({"name": "x" * 65}, ["name must match"]),
        ({"parameters": {"type": "string"}}, ["'echo'", '"type": "object"']),
        (
            {"parameters": {"type": "object", "properties": {"text": {"type": "strnig"}}}},
            ["'echo'", "not a valid JSON schema", "properties/text/type"],
        ),
        ({"description": " "}, ["'echo'", "description"]),
        ({"timeout_s": -1}, ["'echo'", "timeout_s"]),
    ],
)
def test_bad_tool_declarations_raise_value_error(kwargs, words):
    with pytest.raises(ValueError) as raised:
        Echo(**kwargs)
    for word in words:
        assert word in str(raised.value)


# ---- execute_call: argument validation --------------------------------------------------------------


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({}, "missing required argument 'text'"),
        ({"text": 7}, "argument 'text' must be string, got integer 7"),
        ({"text": "hi", "colour": "red"}, "unexpected argument 'colour' (valid: text, times, volume)"),
        ({"text": "hi", "volume": "medium"}, "argument 'volume' must be one of \"quiet\", \"loud\"; got \"medium\""),
        ({"text": "hi", "times": 9}, "argument 'times': 9 fails maximum 3"),
        (["hi"], "arguments for tool 'echo' must be a JSON object, got array"),
        ("hi", "arguments for tool 'echo' must be a JSON object, got string"),
    ],
)
def test_bad_arguments_give_a_short_readable_error(arguments, message):
    outcome = execute_call({"echo": Echo()}, "echo", arguments, default_timeout_s=5, error_reward=-0.1)
    assert (outcome.ok, outcome.error_kind, outcome.reward) == (False, "bad_arguments", -0.1)
    assert message in outcome.text
    assert "Failed validating" not in outcome.text and len(outcome.text) < 200


def test_a_huge_bad_value_is_not_echoed_in_full():
    outcome = execute_call({"echo": Echo()}, "echo", {"text": ["x" * 10_000]}, default_timeout_s=5)
    assert outcome.error_kind == "bad_arguments" and len(outcome.text) < 200


def test_unknown_tool_lists_the_available_tools():
    tools = {"echo": Echo(), "calculator": calculator}
    for name in ("serach", None, ["echo"]):
        outcome = execute_call(tools, name, {}, default_timeout_s=5, error_reward=-1.0)
        assert (outcome.ok, outcome.error_kind, outcome.reward) == (False, "unknown_tool", -1.0)
        assert outcome.text.endswith("Available tools: calculator, echo")


# ---- execute_call: tool failures ------------------------------------------------------------------


@function_tool
def divide(a: int, b: int) -> str:
    """Divide a by b."""
    return str(a // b)


def test_an_exception_becomes_an_error_observation_and_the_next_call_still_works():
    tools = {"divide": divide}
    failed = execute_call(tools, "divide", {"a": 1, "b": 0}, default_timeout_s=5, error_reward=-0.5)
    assert (failed.ok, failed.error_kind, failed.reward) == (False, "exception", -0.5)
    assert failed.text == "Error: ZeroDivisionError: integer division or modulo by zero"
    assert "Traceback" in failed.info["traceback"] and "a // b" in failed.info["traceback"]
    assert execute_call(tools, "divide", {"a": 7, "b": 2}, default_timeout_s=5).text == "3"


@pytest.mark.parametrize(
    "make_result, words",
    [
        (lambda: 42, ["TypeError", "tool 'raw' returned int; expected ToolResult or str"]),
        (lambda: ToolResult(text="x", reward=math.nan), ["ValueError", "reward must be a finite number"]),
    ],
)
def test_a_tool_returning_the_wrong_thing_is_an_exception_outcome(make_result, words):
    class Raw(Tool):
        name, description, parameters = "raw", "Return junk.", {"type": "object"}

        def execute(self, arguments):
            return make_result()

    outcome = execute_call({"raw": Raw()}, "raw", {}, default_timeout_s=5)
    assert (outcome.ok, outcome.error_kind) == (False, "exception")
    for word in words:
        assert word in outcome.text


class Stuck(Tool):
    name = "stuck"
    description = "Wait for a release."
    parameters = {"type": "object", "properties": {}}

    def __init__(self, release: threading.Event, timeout_s: float | None):
        self.release = release
        super().__init__(timeout_s=timeout_s)

    def execute(self, arguments):
        self.release.wait(5.0)
        return "finally"


@pytest.mark.parametrize("tool_timeout_s, default_timeout_s", [(0.2, 60.0), (None, 0.2)])
def test_a_tool_past_its_timeout_is_abandoned(tool_timeout_s, default_timeout_s):
    release = threading.Event()
    try:
        started = time.monotonic()
        outcome = execute_call({"stuck": Stuck(release, tool_timeout_s)}, "stuck", {},
                               default_timeout_s=default_timeout_s, error_reward=-0.2)
        assert time.monotonic() - started < 2.0  # did not wait the 5 s the tool needs
    finally:
        release.set()
    assert (outcome.ok, outcome.error_kind, outcome.reward) == (False, "timeout", -0.2)
    assert outcome.text == "Error: tool 'stuck' timed out after 0.2 s"


def test_a_stuck_tool_does_not_block_interpreter_exit():
    script = (
        "import threading\n"
        "from agent_core.envs.tools import Tool, execute_call\n"
        "class Forever(Tool):\n"
        "    name, description, parameters = 'forever', 'Never returns.', {'type': 'object'}\n"
        "    def execute(self, arguments):\n"
        "        threading.Event().wait()\n"
        "print(execute_call({'forever': Forever()}, 'forever', {}, default_timeout_s=0.1).error_kind)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "timeout"), done.stderr


class Hung(Stuck):
    name = "hung"  # its own name: the limit on abandoned calls is per tool name


def test_abandoned_calls_are_bounded_per_tool_and_further_calls_fail_fast(monkeypatch):
    monkeypatch.setattr(tools_module, "MAX_ABANDONED_CALLS_PER_TOOL", 2)
    release = threading.Event()
    tools = {"hung": Hung(release, timeout_s=None), "echo": Echo()}
    try:
        timed_out = [execute_call(tools, "hung", {}, default_timeout_s=0.05).error_kind for _ in range(2)]
        assert timed_out == ["timeout", "timeout"] and abandoned_calls("hung") == 2
        started = time.monotonic()
        refused = execute_call(tools, "hung", {}, default_timeout_s=30, error_reward=-1.0)
        assert time.monotonic() - started < 1.0  # did not wait out any timeout
        assert (refused.ok, refused.error_kind, refused.reward) == (False, "unavailable", -1.0)
        assert "2 earlier calls timed out and are still running" in refused.text
        assert execute_call(tools, "echo", {"text": "hi"}, default_timeout_s=5).ok  # other tools are unaffected
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while abandoned_calls("hung") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert abandoned_calls("hung") == 0  # finished threads give their slots back
    assert execute_call(tools, "hung", {}, default_timeout_s=5).text == "finally"


def test_long_results_are_truncated_with_a_visible_marker():
    tools = {"echo": Echo()}
    long = execute_call(tools, "echo", {"text": "x" * 50}, default_timeout_s=5, max_result_chars=20)
    assert long.text == "x" * 20 + "\n[truncated 30 chars]"
    assert long.info["truncated_chars"] == 30
    short = execute_call(tools, "echo", {"text": "x" * 20}, default_timeout_s=5, max_result_chars=20)
    assert (short.text, short.info["truncated_chars"]) == ("x" * 20, 0)


# ---- registry -------------------------------------------------------------------------------------


def test_registry_has_the_builtins_and_checks_kwargs():
    assert {"calculator", "search"} <= set(TOOLS.names())
    assert tool_kwarg_names("search") == ["top_k"]
    with pytest.raises(TypeError, match=r"tool 'search' got unexpected argument\(s\) 'k'; valid arguments: top_k"):
        make_tool("search", {"k": 2}, EnvResources())
    with pytest.raises(UnknownNameError, match="valid tool names: .*calculator"):
        make_tool("abacus", {}, EnvResources())
    with pytest.raises(ValueError, match="needs a corpus"):
        make_tool("search", {}, EnvResources(search_index=None))
    assert make_tool("calculator", {}, EnvResources()) is calculator


# ---- calculator -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expression, shown",
    [
        ("1 + 2 * 3", "7"),
        ("(1 + 2) * 3", "9"),
        ("7 / 2", "3.5"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("2 ** 10", "1024"),
        ("-2 ** 2", "-4"),
        ("2 ** -1", "0.5"),
        ("0.1 + 0.2", "0.3"),
        ("1 / 3", "0.333333333333"),
        ("sqrt(16) + abs(-2)", "6"),
        ("round(2.567, 2)", "2.57"),
        ("round(2.5)", "2"),
        ("min(4, 2.5, 9) + max(1, 3)", "5.5"),
        ("log(8, 2)", "3"),
        ("log(e)", "1"),
        ("exp(0) + sin(0) + cos(0) + tan(0)", "2"),
        ("floor(-2.5) * ceil(2.1)", "-9"),
        ("2 * pi", "6.28318530718"),
        ("12345678901234567890 * 10", "123456789012345678900"),
        ("1e20", "1e+20"),
        ("-0.0", "0"),
    ],
)
def test_calculator_hand_worked_values(expression, shown):
    outcome = execute_call({"calculator": calculator}, "calculator", {"expression": expression}, default_timeout_s=5)
    assert (outcome.ok, outcome.text) == (True, shown)


_REFERENCE_NAMES = {
    "__builtins__": {}, "abs": abs, "round": round, "min": min, "max": max, "sqrt": math.sqrt,
    "floor": math.floor, "ceil": math.ceil, "exp": math.exp, "sin": math.sin, "pi": math.pi, "e": math.e,
}


def _random_expression(rng: random.Random, depth: int) -> str:
    if depth == 0 or rng.random() < 0.25:
        return rng.choice([str(rng.randint(0, 9)), f"{rng.randint(0, 9)}.{rng.choice([5, 25, 75])}", "pi", "e"])
    kind = rng.random()
    if kind < 0.5:
        operator = rng.choice(["+", "-", "*", "/", "//", "%"])
        text = f"{_random_expression(rng, depth - 1)} {operator} {_random_expression(rng, depth - 1)}"
    elif kind < 0.65:  # base: a leaf or a small parenthesized expression, exponent: a small literal
        text = f"({_random_expression(rng, 1)}) ** {rng.choice(['-2', '-1', '0', '1', '2', '3', '0.5'])}"
    elif kind < 0.75:
        text = rng.choice(["-", "+"]) + _random_expression(rng, depth - 1)
    elif kind < 0.9:
        function = rng.choice(["abs", "round", "floor", "ceil", "sqrt", "exp", "sin"])
        text = f"{function}({_random_expression(rng, depth - 1)})"
    else:
        arguments = ", ".join(_random_expression(rng, depth - 1) for _ in range(rng.randint(2, 3)))
        text = f"{rng.choice(['min', 'max'])}({arguments})"
    return f"({text})" if rng.random() < 0.6 else text


def test_calculator_agrees_with_python_arithmetic_on_random_expressions():
    rng = random.Random(20240611)
    agreed = refused = 0
    for _ in range(500):
        expression = _random_expression(rng, depth=4)
        try:
            expected = eval(expression, dict(_REFERENCE_NAMES))  # reference only, in the test
        except (ArithmeticError, ValueError, TypeError):  # TypeError: e.g. complex // int
            expected = None
        not_real = isinstance(expected, complex) or (isinstance(expected, float) and not math.isfinite(expected))
        if expected is None or not_real:
            with pytest.raises(ValueError):
                evaluate_expression(expression)
            refused += 1
            continue
        value = evaluate_expression(expression)
        assert (type(value), value) == (type(expected), expected), expression
        assert format_number(value) == calculator.execute({"expression": expression})
        agreed += 1
    assert agreed > 300 and refused > 5  # both paths were exercised


@pytest.mark.parametrize(
    "expression, words",
    [
        ("__import__('os')", ["unknown function '__import__'"]),
        ("__import__('os').system('true')", ["not allowed: attribute access"]),
        ("(1).real", ["not allowed: attribute access"]),
        ("x + 1", ["unknown name 'x'"]),
        ("sqrt", ["sqrt is a function"]),
        ("(lambda: 1)()", ["not allowed: lambda"]),
        ("(2)(3)", ["only named functions"]),
        ("lambda: 1", ["not allowed: lambda"]),
        ("[i for i in range(9)]", ["not allowed: comprehensions"]),
        ("sum(i for i in range(9))", ["unknown function 'sum'"]),
        ("9**9**9", ["too large"]),
        ("10 ** 400", ["too large"]),
        ("2.0 ** 5000", ["too large"]),
        ("exp(1000)", ["too large"]),
        ("'a' * 10", ["only numbers"]),
        ("1 + 2" * 200, [f"limit is {MAX_EXPRESSION_CHARS}"]),
        ("-" * 150 + "1", ["nested too deeply"]),
        ("1 / 0", ["division by zero in 1 / 0"]),
        ("5 % (2 - 2)", ["division by zero"]),
        ("sqrt(-1)", ["sqrt()", "math domain error"]),
        ("(-8) ** 0.5", ["not a real number"]),
        ("1e999", ["not finite"]),
        ("2j", ["imaginary"]),
        ("True + 1", ["only numbers"]),
        ("2 ^ 3", ["use ** for powers"]),
        ("1 < 2", ["not allowed: comparisons"]),
        ("round(1.5, ndigits=1)", ["positional arguments only"]),
        ("round(5, -1000)", ["ndigits"]),
        ("sqrt(1, 2)", ["sqrt() takes 1 argument(s), got 2"]),
        ("max()", ["max() takes at least 1 argument(s), got 0"]),
        ("2 +", ["not a valid arithmetic expression"]),
    ],
)
def test_calculator_rejects_everything_but_bounded_arithmetic(expression, words):
    with pytest.raises(ValueError) as raised:
        evaluate_expression(expression)
    for word in words:
        assert word in str(raised.value)
    outcome = execute_call({"calculator": calculator}, "calculator", {"expression": expression}, default_timeout_s=5)
    assert (outcome.error_kind, outcome.text) == ("exception", f"Error: ValueError: {raised.value}")


# ---- search ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def search_tool():
    documents = [
        Document("d1", "Quillport", "Quillport is a harbour city founded in 1721."),
        Document("d2", "Tessa Dunmar", "Tessa Dunmar is a film director born in Quillport."),
        Document("d3", "Norveth", "Norveth is a mountain country with three rivers."),
        Document("d4", "Varo Kelmin", "Varo Kelmin is a 1987 film directed by Tessa Dunmar."),
    ]
    return make_tool("search", {"top_k": 2}, EnvResources(search_index=Bm25Index(documents)))


def test_search_returns_numbered_passages_best_first(search_tool):
    assert isinstance(search_tool, SearchTool) and search_tool.parameters["properties"]["top_k"]["default"] == 2
    outcome = execute_call({"search": search_tool}, "search", {"query": "Norveth mountain rivers"}, default_timeout_s=5)
    assert outcome.ok and outcome.info["doc_ids"] == ["d3"]
    assert outcome.text == "Doc 1 (Norveth): Norveth is a mountain country with three rivers."
    many = execute_call({"search": search_tool}, "search", {"query": "Tessa Dunmar film", "top_k": 3},
                        default_timeout_s=5)
    # d2 has the name twice (title and text); d1 shares no term, so top_k=3 still gives two.
    assert many.info["doc_ids"] == ["d2", "d4"]
    assert many.text.splitlines() == [
        "Doc 1 (Tessa Dunmar): Tessa Dunmar is a film director born in Quillport.",
        "Doc 2 (Varo Kelmin): Varo Kelmin is a 1987 film directed by Tessa Dunmar.",
    ]


def test_search_uses_the_default_top_k_and_reports_no_results(search_tool):
    default = execute_call({"search": search_tool}, "search", {"query": "Tessa Dunmar film Quillport"},
                           default_timeout_s=5)
    assert len(default.info["doc_ids"]) == 2
    nothing = execute_call({"search": search_tool}, "search", {"query": "zeppelin"}, default_timeout_s=5)
    assert (nothing.ok, nothing.text, nothing.info["doc_ids"]) == (True, "No results for 'zeppelin'.", [])


@pytest.mark.parametrize(
    "arguments, message",
    [({"query": "x", "top_k": 11}, "argument 'top_k': 11 fails maximum 10"), ({"query": ""}, "fails minLength 1")],
)
def test_search_arguments_are_bounded(search_tool, arguments, message):
    outcome = execute_call({"search": search_tool}, "search", arguments, default_timeout_s=5)
    assert outcome.error_kind == "bad_arguments" and message in outcome.text


def test_search_top_k_is_checked_when_the_tool_is_made(search_tool):
    with pytest.raises(ValueError, match=r"tool 'search': top_k must be in 1\.\.10, got 0"):
        make_tool("search", {"top_k": 0}, EnvResources(search_index=search_tool.index))


def test_calculator_parses_again_after_the_interpreters_ast_race(monkeypatch):
    """CPython 3.11's gh-106905: a thread building an AST elsewhere can make ast.parse raise
    SystemError on valid input; the calculator parses again instead of failing a clean call."""
    import ast

    from agent_core.envs import builtin_tools

    real, raised = ast.parse, []

    def racing(*args, **kwargs):
        if not raised:
            raised.append(True)
            raise SystemError("AST constructor recursion depth mismatch (before=2, after=1)")
        return real(*args, **kwargs)

    monkeypatch.setattr(builtin_tools.ast, "parse", racing)
    assert builtin_tools.calculator("12 / 4") == "3" and raised == [True]
    monkeypatch.setattr(builtin_tools.ast, "parse", lambda *a, **k: (_ for _ in ()).throw(SystemError("always")))
    with pytest.raises(SystemError):  # a real, lasting fault is not hidden
        builtin_tools.calculator("1 + 1")
