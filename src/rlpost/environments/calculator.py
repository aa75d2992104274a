"""A calculator tool for multi-turn episodes (env=calculator; data=calc asks for it).

Each model turn is read as either a tool call or the final answer:
- a turn containing `<call>EXPR</call>` calls the calculator: the environment answers `<result>VALUE</result>`
  and the episode goes on (the next turn stops at `</call>` again); reward 0 for the call itself;
- a turn with no call is the final answer, scored with math-verify against the row's answer (1 or 0), and the
  episode ends.

EXPR is arithmetic on numbers: + - * / // % ** and parentheses, parsed with `ast` (no names, no calls, nothing
else). A malformed call (`<call>` without `</call>`, or an expression that doesn't parse or divides by zero) is
answered with `<result>error: ...</result>`, never a crash, and counted in `train/calculator_malformed_calls`. Each
evaluation and each final scoring runs in the environment's killable worker processes (env.calculator.timeout_s),
so a call that would never finish (e.g. `9**9**9**9`) is killed and answered `<result>error: timed out</result>`.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable, Mapping, Sequence

from rlpost.config.schema.env import CalculatorEnvConfig
from rlpost.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from rlpost.environments.math_environment import math_verify_reward, warm_up_math_verify
from rlpost.environments.verifier_pool import VerifierPool

CALL_OPEN, CALL_CLOSE = "<call>", "</call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.S)
_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculate(expression: str) -> float:
    """The value of an arithmetic expression; ValueError for anything that is not plain arithmetic."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")

    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"does not parse: {exc.msg}") from None
    return float(value(tree.body))


def tool_worker(kind: str, text: str, answer: str) -> float:
    """What the killable workers run: a calculator call ('call') or the final answer's score ('answer')."""
    return calculate(text) if kind == "call" else math_verify_reward(text, answer)


def format_number(x: float) -> str:
    return str(int(x)) if x == int(x) and abs(x) < 1e15 else f"{x:.6g}"


def parse_turn(response: str) -> tuple[str, str]:
    """('call', EXPR), ('malformed', why) or ('answer', response) for one model turn."""
    match = _CALL.search(response)
    if match is not None:
        return "call", match.group(1)
    if CALL_OPEN in response:
        return "malformed", f"a call must end with {CALL_CLOSE}"
    return "answer", response


class CalculatorEnvironment(EnvironmentInterface):
    """Answers `<call>EXPR</call>` with `<result>VALUE</result>`, scores the final answer with math-verify."""

    cfg: CalculatorEnvConfig

    def __init__(self, cfg: CalculatorEnvConfig) -> None:
        self.cfg = cfg
        self.pool = VerifierPool.from_config(tool_worker, cfg, warmup=warm_up_math_verify)

    @classmethod
    def answer_problem(cls, answer: str) -> str | None:
        from rlpost.environments.math_environment import MathEnvironment

        return MathEnvironment.answer_problem(answer)

    def step(self, responses: list[str], metadata: Sequence[Mapping[str, object]]) -> EnvironmentReturn:
        turns = [parse_turn(r) for r in responses]
        jobs = [(i, (kind, text, str(m["expected_answer"])))
                for i, ((kind, text), m) in enumerate(zip(turns, metadata, strict=True)) if kind != "malformed"]
        res = self.pool.run([args for _, args in jobs])
        rewards = [0.0] * len(responses)
        observations: list[str] = [""] * len(responses)
        terminated = [False] * len(responses)
        malformed = answer_errors = 0
        for k, (i, (kind, _, _)) in enumerate(jobs):
            status = res.status[k]
            if kind == "answer":
                rewards[i], terminated[i] = res.rewards[k], True
                answer_errors += status.startswith("error")
            elif status == "ok":
                observations[i] = f"<result>{format_number(res.rewards[k])}</result>"
            else:
                malformed += status.startswith("error")
                why = "timed out" if status in ("timeout", "unfinished") else status.removeprefix("error: ")
                observations[i] = f"<result>error: {why}</result>"
        for i, (kind, why) in enumerate(turns):
            if kind == "malformed":
                malformed += 1
                observations[i] = f"<result>error: {why}</result>"
        calls = sum(1 for kind, _ in turns if kind != "answer")
        return EnvironmentReturn(
            rewards, res.timeouts, answer_errors, unfinished=res.unfinished,
            metrics={"calculator_calls": float(calls), "calculator_malformed_calls": float(malformed)},
            observations=observations, terminateds=terminated,
            next_stop_strings=[None if t else [CALL_CLOSE] for t in terminated],
        )

    def shutdown(self) -> None:
        self.pool.shutdown()
