"""Workflow resolution (spec/executor.md §5.2, adapted: functions and duck types are workflows)."""

import logging
import sys
import types

import pytest

from rollout_trio import AgentWorkflow, RolloutWorkflow, resolve_workflow


class Echo(RolloutWorkflow):
    def __init__(self, tag="x"):
        self.tag = tag

    async def arun_episode(self, engine, data):
        return (self.tag, data)


class Duck:
    async def arun_episode(self, engine, data):
        return ("duck", data)


class Agent:
    async def run(self, data, **kw):
        return 1.0


async def fn_workflow(engine, data, *, scale=1):
    return data * scale


@pytest.fixture
def module():
    mod = types.ModuleType("rt_test_workflows")
    mod.Echo, mod.instance, mod.Agent, mod.fn = Echo, Echo("inst"), Agent, fn_workflow
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


async def test_instance_is_used_as_is_and_kwargs_warn(caplog):
    wf = Echo()
    assert resolve_workflow(wf) is wf
    with caplog.at_level(logging.WARNING, logger="rollout_trio.workflow"):
        assert resolve_workflow(wf, {"tag": "y"}) is wf
    assert "workflow_kwargs is ignored when workflow is already an instance" in caplog.text


async def test_class_needs_kwargs():
    with pytest.raises(ValueError, match="workflow_kwargs is required when workflow is a class. Got workflow="):
        resolve_workflow(Echo)
    wf = resolve_workflow(Echo, {})
    assert isinstance(wf, Echo) and wf.tag == "x"
    assert resolve_workflow(Echo, {"tag": "z"}).tag == "z"


async def test_async_function_is_a_workflow_with_bound_kwargs():
    wf = resolve_workflow(fn_workflow, {"scale": 3})
    assert isinstance(wf, RolloutWorkflow)
    assert await wf.arun_episode(None, 2) == 6


async def test_duck_typed_arun_episode():
    wf = resolve_workflow(Duck())
    assert await wf.arun_episode(None, 1) == ("duck", 1)
    assert isinstance(resolve_workflow(Duck, {}), RolloutWorkflow)


async def test_import_strings(module, caplog):
    assert resolve_workflow("rt_test_workflows.Echo", {"tag": "s"}).tag == "s"
    with pytest.raises(ValueError, match="required when workflow is a class or string"):
        resolve_workflow("rt_test_workflows.Echo")
    with caplog.at_level(logging.WARNING, logger="rollout_trio.workflow"):
        assert resolve_workflow("rt_test_workflows.instance", {}) is module.instance
    assert "resolves to an instance" in caplog.text
    assert await resolve_workflow("rt_test_workflows.fn").arun_episode(None, 4) == 4


@pytest.mark.parametrize(
    ("path", "match"),
    [
        ("nodots", "Expected format 'module.path.ObjectName', got 1 part"),
        ("no_such_module_xyz.Thing", "Failed to import module 'no_such_module_xyz'"),
        ("rt_test_workflows.Missing", "has no attribute 'Missing'"),
        ("", "Invalid module path"),
    ],
)
def test_bad_import_strings(module, path, match):
    with pytest.raises(ValueError, match=f"Failed to import workflow from string {path!r}") as info:
        resolve_workflow(path)
    assert match in str(info.value)


class ConfiguredAgent:
    def __init__(self, tag="default"):
        self.tag = tag

    async def run(self, data, **kw):
        return 1.0


def test_agents_resolve_to_the_agent_wrapper(module, caplog):
    from rollout_trio.agents import AgentRolloutWorkflow

    instance = Agent()
    wf = resolve_workflow(instance)
    assert isinstance(wf, AgentRolloutWorkflow) and wf.agent is instance
    assert (wf.mode, wf.discount, wf.export_style) == ("inline", 1.0, "individual")
    assert isinstance(resolve_workflow(Agent).agent, Agent)  # a class: instantiated, kwargs optional
    assert resolve_workflow(ConfiguredAgent, {"tag": "t"}).agent.tag == "t"
    assert isinstance(resolve_workflow("rt_test_workflows.Agent").agent, Agent)
    with caplog.at_level(logging.WARNING, logger="rollout_trio.workflow"):
        assert resolve_workflow(instance, {"tag": "ignored"}).agent is instance
    assert "workflow_kwargs is ignored when workflow is already an instance" in caplog.text


def test_none_and_other_objects():
    with pytest.raises(ValueError, match="workflow is None"):
        resolve_workflow(None)
    with pytest.raises(TypeError, match="workflow must be an async function"):
        resolve_workflow(42)
    with pytest.raises(TypeError, match="workflow must be an async function"):
        resolve_workflow(lambda engine, data: None)  # sync functions are not workflows


def test_agent_workflow_is_a_deprecated_shim():
    class Old(AgentWorkflow):
        def __init__(self):  # does not call super().__init__: still warns
            pass

        async def run(self, data, **kw):
            return 0.0

    with pytest.warns(DeprecationWarning, match="Old inherits from deprecated AgentWorkflow"):
        Old()
    with pytest.warns(DeprecationWarning):
        Old()  # on every instantiation


_AGENT_FIRST = '''
import sys
import trio
from rollout_trio.executor import open_executor
from rollout_trio.testing import ScriptedEngine

class Agent:
    async def run(self, data, **kwargs):
        return 0.0

async def main():
    assert "rollout_trio.agents" not in sys.modules, "the check needs a process without the agents layer"
    async with open_executor(ScriptedEngine(), consumer_batch_size=1) as rollout:
        rollout.submit({}, Agent())
        print("submitted")

trio.run(main)
'''


def test_an_agent_resolves_without_importing_the_agents_layer_first():
    """Issue 32: `from rollout_trio.executor import open_executor`, then `submit({}, agent)`,
    raised TypeError ("needs rollout_trio.agents; import it first") in a fresh process."""
    import subprocess

    proc = subprocess.run([sys.executable, "-c", _AGENT_FIRST], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "submitted" in proc.stdout
