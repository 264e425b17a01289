"""verl's tool-config file (``multi_turn.tool_config_path``): ``tools:`` a list of ``{class_name,
config, tool_schema}``, ``tool_schema`` an OpenAI function. Read and checked at the dry run, built
on every rank.

``class_name`` is one of verl's classes that has an equivalent here (``TOOL_CLASSES``: its GSM8K
tool, its SandboxFusion code tool, ReTool's variant of it, its search tool), a name of that
registry, or the dotted path of the user's own class implementing ``rlhf_hpc.tools.tool.Tool``;
anything else is refused with what is available."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.plugin_class import read_entry_list, resolve_class
from rlhf_hpc.config.registry import Registry
from rlhf_hpc.config.sandbox_schema import SandboxConfig, SandboxFusionConfig
from rlhf_hpc.config.schema import Config
from rlhf_hpc.tools.tool import Tool

__all__ = ["TOOL_CLASSES", "ToolEntry", "ToolSpec", "build_tools", "read_tool_config", "run_tools", "tool_schemas"]

KEY = "actor_rollout_ref.rollout.multi_turn.tool_config_path"


@dataclass(frozen=True)
class ToolSpec:
    """A built-in tool: ``entry`` its class (``module:Class``, imported when built), ``verl_class``
    verl's class it stands for (None: this project's own), ``sandbox``: it runs code (the dry run
    checks the sandbox)."""

    name: str
    entry: str
    verl_class: Optional[str] = None
    sandbox: bool = False


TOOL_CLASSES: Registry[ToolSpec] = Registry("tool class", f"{KEY}: class_name")
for _spec in (
    ToolSpec("gsm8k", "rlhf_hpc.rewards.gsm8k_tool:Gsm8kTool", "verl.tools.gsm8k_tool.Gsm8kTool"),
    ToolSpec(
        "code_interpreter",
        "rlhf_hpc.tools.code_interpreter:CodeInterpreterTool",
        "verl.tools.sandbox_fusion_tools.SandboxFusionTool",
        sandbox=True,
    ),
    ToolSpec(
        "retool_code_interpreter",
        "rlhf_hpc.tools.code_interpreter:ReToolCodeInterpreterTool",
        "recipe.retool.retool.CustomSandboxFusionTool",
        sandbox=True,
    ),
    ToolSpec("search", "rlhf_hpc.tools.search_tool:SearchTool", "verl.tools.search_tool.SearchTool"),
    ToolSpec("lookup", "rlhf_hpc.tools.lookup_tool:LookupTool"),
):  # (the built-in tool task's)
    TOOL_CLASSES.register(_spec.name, _spec)


@dataclass
class ToolEntry:
    """One checked entry: ``cls`` the class to build, ``sandbox`` whether it runs code."""

    name: str
    cls: type
    config: dict = field(default_factory=dict)
    schema: dict = field(default_factory=dict)
    sandbox: bool = False


def read_tool_config(path: str) -> list[ToolEntry]:
    """The file's tools, each checked (a ConfigError names the file, the entry and the fix)."""
    tools = read_entry_list(path, KEY, "tools", "{class_name, config, tool_schema}")
    out, errors = [], []
    for i, item in enumerate(tools):
        where = f"{path}, tools[{i}]"
        try:
            if not isinstance(item, dict) or not isinstance(item.get("class_name"), str):
                raise ConfigError(f"{where}: no class_name")
            schema, config = item.get("tool_schema"), item.get("config") or {}
            name = (schema or {}).get("function", {}).get("name") if isinstance(schema, dict) else None
            if not isinstance(name, str) or not name:
                raise ConfigError(
                    f"{where}: tool_schema.function.name missing (an OpenAI function schema: "
                    f"type: function, function: {{name, description, parameters}})"
                )
            kind = config.get("type", "native") if isinstance(config, dict) else None
            if kind != "native":
                raise ConfigError(
                    f"{where}: config.type={kind!r}: only native tools run here (verl's mcp tools need an MCP server)"
                )
            spec, cls = resolve_class(item["class_name"], TOOL_CLASSES, Tool, "execute", where)
            sandbox = bool(spec and spec.sandbox)
            problems = cls.config_problems(config)
            if problems:
                raise ConfigError([f"{where}: {p}" for p in problems])
            if any(e.name == name for e in out):
                raise ConfigError(f"{where}: a second tool named {name!r}")
            out.append(ToolEntry(name, cls, dict(config), schema, sandbox))
        except ConfigError as e:
            errors += e.errors
    if errors:
        raise ConfigError(errors)
    return out


def run_tools(cfg: Config) -> list[ToolEntry]:
    """The run's tools (none for a single-turn run, or a multi-turn one without a tool config)."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    return read_tool_config(mt.tool_config_path) if mt.enable and mt.tool_config_path else []


def tool_schemas(entries: list[ToolEntry]) -> list[dict]:
    """The schemas the chat template shows the model (``tools=``)."""
    return [e.schema for e in entries]


def build_tools(
    entries: list[ToolEntry],
    sandbox: Optional[SandboxConfig] = None,
    sandbox_fusion: Optional[SandboxFusionConfig] = None,
) -> dict[str, Tool]:
    """name -> the built tool; a code tool gets the run's sandbox limits and service."""
    return {
        e.name: (e.cls(e.config, e.schema, sandbox, sandbox_fusion) if e.sandbox else e.cls(e.config, e.schema))
        for e in entries
    }
