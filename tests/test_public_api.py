"""What `import rollout_trio` promises."""

import inspect

import rollout_trio
from rollout_trio import engines

ROOT_NAMES = [
    "GenerationConfig", "ModelRequest", "ModelResponse", "Trajectory", "Interaction", "RolloutGroup",
    "WorkflowContractError", "concat_trajectories", "split_trajectories", "RolloutWorkflow",
    "resolve_workflow", "workflow_context", "EngineError", "EngineConnectError", "EngineTimeoutError",
    "EngineServerError", "EngineProtocolError", "GroupedRolloutWorkflow", "run_group", "NormConfig", "normalize_rewards",
]


def test_root_exposes_documented_names_from_the_public_module():
    for name in ROOT_NAMES:
        obj = getattr(rollout_trio, name)
        assert inspect.getdoc(obj), f"{name} has no docstring"
        if not inspect.ismodule(obj):
            assert obj.__module__ == "rollout_trio", name


def test_engine_protocol_is_public():
    assert inspect.getdoc(engines.InferenceEngine)


def test_error_tree():
    assert issubclass(rollout_trio.WorkflowContractError, ValueError)
    for name in ("EngineConnectError", "EngineTimeoutError", "EngineServerError", "EngineProtocolError"):
        assert issubclass(getattr(rollout_trio, name), rollout_trio.EngineError)
    assert issubclass(rollout_trio.EngineError, rollout_trio.RolloutError)


def test_package_is_typed():
    from importlib.resources import files

    assert files("rollout_trio").joinpath("py.typed").is_file()
