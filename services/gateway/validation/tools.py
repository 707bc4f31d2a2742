"""`tools` and `tool_choice` of a chat request -> what the chat template gets and how the
output is read (ToolPlan), and, for `required` or a named function, the JSON-schema
constraint that makes every call valid by construction:

    named      the output is the function's arguments object (its `parameters` schema)
    required   the output is a non-empty array of {"name", "arguments"}, one of the tools each
    auto       free text, read by --tool-call-parser's format (services/gateway/tools)
    none       the tools are shown to the template; the output is all content
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import msgspec

from services.gateway.errors import invalid
from services.gateway.validation.limits import MAX_CONSTRAINT_CHARS, SCHEMA_NAME_PATTERN
from shared.messages.common import Constraint, JsonSchemaConstraint

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict[str, Any]] = field(default_factory=list)  # as the template takes them
    name: str = ""  # named: the function
    parallel: bool = True  # parallel_tool_calls

    def parameters(self, name: str) -> dict[str, Any]:
        for t in self.tools:
            if t["function"]["name"] == name:
                params: dict[str, Any] = t["function"].get("parameters") or ANY_OBJECT
                return params
        return ANY_OBJECT


def tool_plan(
    tools: list[Any] | None, choice: str | dict[str, Any] | None, parallel: bool | None, parser: str
) -> ToolPlan | None:
    """None when the request has no tools (a tool_choice without tools is a 400)."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise invalid("tool_choice needs tools", "tool_choice")
        return None
    checked = [check_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in checked]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise invalid(f"tools[{i}].function.name {name!r} repeats", f"tools[{i}].function.name")
    multiple = parallel is not False
    if choice is None or choice == "auto":
        if not parser:
            raise invalid(
                "tool_choice auto needs the server started with --tool-call-parser; ask for "
                'tool_choice "required" or a named function, or "none"',
                "tool_choice",
            )
        return ToolPlan("auto", checked, parallel=multiple)
    if choice in ("none", "required"):
        return ToolPlan(str(choice), checked, parallel=multiple)
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise invalid(
                'tool_choice must be "none", "auto", "required" or {"type": "function", '
                '"function": {"name": ...}}',
                "tool_choice",
            )
        if name not in names:
            raise invalid(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
        return ToolPlan("named", checked, name=name, parallel=False)
    raise invalid(
        f'tool_choice must be "none", "auto", "required" or a function; got {choice!r}',
        "tool_choice",
    )


def check_tool(tool: Any, at: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise invalid(f'{at}.type must be "function"', f"{at}.type")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise invalid(f"{at}.function must be an object", f"{at}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME_PATTERN.match(name):
        raise invalid(
            f"{at}.function.name must be 1 to 64 letters, digits, underscores or dashes",
            f"{at}.function.name",
        )
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise invalid(
            f"{at}.function.parameters must be a JSON schema object", f"{at}.function.parameters"
        )
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid(f"{at}.function.description must be a string", f"{at}.function.description")
    out = {"name": name, "parameters": params or ANY_OBJECT}
    if description:
        out["description"] = description
    return {"type": "function", "function": out}


def tool_constraint(plan: ToolPlan | None) -> Constraint | None:
    if plan is None or plan.mode not in ("required", "named"):
        return None
    if plan.mode == "named":
        schema = plan.parameters(plan.name)
    else:
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    "arguments": t["function"]["parameters"],
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in plan.tools
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not plan.parallel:
            schema["maxItems"] = 1
    text = msgspec.json.encode(schema).decode()
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise invalid(
            f"the tools' schemas may be at most {MAX_CONSTRAINT_CHARS} characters", "tools"
        )
    return JsonSchemaConstraint(schema=text, param="tools")


def message_tool_calls(calls: list[Any], at: str) -> list[dict[str, Any]]:
    """An assistant message's tool_calls as templates take them (arguments as an object)."""
    out = []
    for j, call in enumerate(calls):
        here = f"{at}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid(f"{here}.function.name is required", f"{here}.function.name")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise invalid(
                    f"{here}.function.arguments must be JSON text of an object",
                    f"{here}.function.arguments",
                ) from None
        if not isinstance(args, dict):
            raise invalid(
                f"{here}.function.arguments must be an object", f"{here}.function.arguments"
            )
        out.append(
            {
                "id": str(call.get("id") or f"call_{j}"),
                "type": "function",
                "function": {"name": fn["name"], "arguments": args},
            }
        )
    return out
