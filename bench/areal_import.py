"""Import the few AReaL 1.0.4 modules the benchmarks run, inside the AReaL environment.

What is run: ``areal.infra.remote_inf_engine`` (``GroupedRolloutWorkflow``,
``RemoteInfEngine``), ``areal.utils.data`` (``concat_padded_tensors``, ``Normalization``),
``areal.engine.sglang_remote`` (``SGLangBackend``, the aiohttp client's wire format),
``areal.api`` (``ModelRequest`` / ``ModelResponse``, ``RolloutWorkflow``, configs) and
``areal.infra.workflow_context`` (the shared aiohttp session).

Two things are not run, because they reach for the cluster runtime:

* the ``__init__`` of ``areal`` and of ``areal.infra``: they import every launcher and
  scheduler (Ray, Slurm). The packages are registered with their real ``__path__``, so
  each submodule is loaded from AReaL's own file; ``areal.infra`` then gets the names its
  submodules import from it (``RemoteInfEngine``, ``RolloutController``,
  ``WorkflowExecutor``, ``workflow_context``), taken from those real submodules.
* ``ray``: ``areal.utils.name_resolve`` (imported by the config module) decorates one
  class with ``@ray.remote`` at import time and uses Ray nowhere on these paths. Ray is a
  ~200 MB distributed runtime; a module whose ``remote`` returns the class unchanged
  stands in for it, and any other attribute access fails loudly.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types


class _NoRay(types.ModuleType):
    def __getattr__(self, name: str):
        raise AttributeError(f"ray.{name}: Ray is not installed in the AReaL bench environment")


def _install_ray_stand_in() -> None:
    if "ray" in sys.modules:
        return
    ray = _NoRay("ray")

    def remote(*args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return lambda obj: obj

    ray.remote = remote  # type: ignore[attr-defined]
    sys.modules["ray"] = ray


def _register_package(name: str, root: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = [os.path.join(root, *name.split(".")[1:])]  # type: ignore[attr-defined]
    mod.__package__ = name
    sys.modules[name] = mod
    return mod


def load() -> types.SimpleNamespace:
    """Import the AReaL pieces and return them by name."""
    _install_ray_stand_in()
    spec = importlib.util.find_spec("areal")
    if spec is None or spec.origin is None:
        raise ImportError("areal is not installed in this environment (run bench/areal_env.py)")
    root = os.path.dirname(spec.origin)
    if "areal" not in sys.modules:
        _register_package("areal", root)
        infra = _register_package("areal.infra", root)
        infra.workflow_context = importlib.import_module("areal.infra.workflow_context")  # type: ignore[attr-defined]
    else:
        infra = sys.modules["areal.infra"]
    version = importlib.import_module("areal.version")
    data = importlib.import_module("areal.utils.data")
    api = importlib.import_module("areal.api")
    cli_args = importlib.import_module("areal.api.cli_args")
    remote = importlib.import_module("areal.infra.remote_inf_engine")
    executor = importlib.import_module("areal.infra.workflow_executor")
    controller = importlib.import_module("areal.infra.controller")
    infra.RemoteInfEngine = remote.RemoteInfEngine  # type: ignore[attr-defined]
    infra.WorkflowExecutor = executor.WorkflowExecutor  # type: ignore[attr-defined]
    infra.RolloutController = controller.RolloutController  # type: ignore[attr-defined]
    sglang = importlib.import_module("areal.engine.sglang_remote")
    importlib.import_module("areal.experimental.openai")  # GroupedRolloutWorkflow imports it per call
    return types.SimpleNamespace(
        version=version.__version__,
        GroupedRolloutWorkflow=remote.GroupedRolloutWorkflow,
        RemoteInfEngine=remote.RemoteInfEngine,
        RolloutWorkflow=api.RolloutWorkflow,
        ModelRequest=api.ModelRequest,
        ModelResponse=api.ModelResponse,
        GenerationHyperparameters=cli_args.GenerationHyperparameters,
        InferenceEngineConfig=cli_args.InferenceEngineConfig,
        NormConfig=cli_args.NormConfig,
        Normalization=data.Normalization,
        concat_padded_tensors=data.concat_padded_tensors,
        SGLangBackend=sglang.SGLangBackend,
        workflow_context=infra.workflow_context,
    )
