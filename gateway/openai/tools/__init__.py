"""Tool calling (torch-free): validating `tools` / `tool_choice`, the history prepared for the
chat template, the grammar forcing a call, and calls parsed out of the generated text."""

from gateway.openai.tools.parser import ToolCallParser, ToolDelta
from gateway.openai.tools.plan import ToolPlan, plan_tools
from gateway.openai.tools.spec import ToolSpecError
from gateway.openai.tools.templates import FORMATS, detect_format

__all__ = [
    "FORMATS",
    "ToolCallParser",
    "ToolDelta",
    "ToolPlan",
    "ToolSpecError",
    "detect_format",
    "plan_tools",
]
