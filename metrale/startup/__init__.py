"""Startup: the composition root that builds an engine from EngineArgs (engine_parts.py), and
what it needs to know where the model comes from, how much memory to plan and how to join the
other ranks. It sits above the engine and the executor; nothing below imports it."""

from metrale.startup.engine_parts import EngineParts, build_engine_parts, build_llm_engine, build_runner
from metrale.startup.model_source import load_tokenizer, read_model_config, resolve_device, resolve_model_dir
from metrale.startup.parallel import start_parallel
from metrale.startup.phases import StartupLog

__all__ = ["EngineParts", "StartupLog", "build_engine_parts", "build_llm_engine", "build_runner", "load_tokenizer",
           "read_model_config", "resolve_device", "resolve_model_dir", "start_parallel"]
