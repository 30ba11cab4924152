"""What `import rollout_trio` promises."""

import inspect

import rollout_trio
from rollout_trio import engines

ROOT_NAMES = [
    "GenerationConfig", "ModelRequest", "ModelResponse", "Trajectory", "Interaction", "RolloutGroup",
    "WorkflowContractError", "concat_trajectories", "split_trajectories", "RolloutWorkflow",
    "resolve_workflow", "workflow_context", "EngineError", "EngineConnectError", "EngineTimeoutError",
    "EngineServerError", "EngineProtocolError", "GroupedRolloutWorkflow", "run_group", "NormConfig", "normalize_rewards",
    "rollout_time_affine", "rollout_time_apply",  # docs/normalization.md imports them from the root (issue 32)
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


# -- issue 11 item 17: __all__, __module__ of the subpackages, dependencies ---------------

import subprocess  # noqa: E402
import sys  # noqa: E402
import tomllib  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_root_all_lists_exactly_the_public_names():
    for name in rollout_trio.__all__:  # the names load on first use; each one must
        getattr(rollout_trio, name)
    public = {
        name for name, value in vars(rollout_trio).items()
        if not name.startswith("_") and (not inspect.ismodule(value) or name == "workflow_context")
    }
    assert sorted(rollout_trio.__all__) == sorted(public)


@pytest.mark.parametrize("package", ["engines", "executor", "observe", "server", "testing", "workflows"])
def test_subpackage_names_report_their_public_module(package):
    mod = __import__(f"rollout_trio.{package}", fromlist=["__all__"])
    checked = 0
    for name in mod.__all__:
        obj = getattr(mod, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            # A name the root re-exports too reports the root, its shortest public path.
            home = "rollout_trio" if getattr(rollout_trio, name, None) is obj else f"rollout_trio.{package}"
            assert obj.__module__ == home, name
            assert obj.__qualname__ == name
            checked += 1
    assert checked >= 1


def test_hypothesis_and_pytest_are_not_runtime_dependencies():
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    runtime = " ".join(project["dependencies"])
    assert "hypothesis" not in runtime and "pytest" not in runtime
    assert "tqdm" in runtime  # the progress bar of `rollout-trio run`
    extras = project["optional-dependencies"]
    assert any(d.startswith("hypothesis") for d in extras["testing"])
    assert {"pytest", "pytest-trio", "hypothesis"} <= {d.split(">")[0].split("=")[0] for d in extras["test"]}


def test_the_package_imports_without_test_tools_and_strategies_name_the_extra():
    code = (
        "import sys\n"
        "sys.modules['hypothesis'] = None\n"
        "import rollout_trio, rollout_trio.testing, rollout_trio.engines\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('pytest', 'pytest_trio', '_pytest')]\n"
        "try:\n"
        "    import rollout_trio.testing.strategies\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert 'pip install -e ".[testing]"' in out.stdout


def test_a_hanging_test_dumps_its_stacks(pytestconfig):
    """faulthandler_timeout is set, so a test that hangs prints every thread's stack."""
    assert float(pytestconfig.getini("faulthandler_timeout")) > 0


# -- the root loads lazily: `import rollout_trio` is cheap, every name still works ------------


def _in_fresh_python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_importing_the_root_imports_neither_torch_nor_transformers():
    out = _in_fresh_python(
        "import sys, rollout_trio\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
        "print(rollout_trio.Trajectory.__module__, 'torch' in sys.modules)\n"
    )
    assert out.splitlines() == ["[]", "rollout_trio False"]


def test_reading_trajectory_imports_only_its_own_modules_and_torch_waits_for_a_tensor():
    """Issue 31: the first public name loads its module alone; torch comes with the first tensor."""
    out = _in_fresh_python(
        "import sys\n"
        "from rollout_trio import Trajectory\n"
        "print(sorted(m for m in ('torch', 'transformers', 'trio', 'httpx', 'rollout_trio.executor') if m in sys.modules))\n"
        "import torch\n"
        "t = Trajectory(input_ids=torch.tensor([[1, 2]]), attention_mask=torch.tensor([[1, 1]]))\n"
        "print(t.attention_mask.dtype, Trajectory.__module__)\n"
        "try:\n"
        "    Trajectory(input_ids=[[1, 2]], attention_mask=torch.ones(1, 2, dtype=torch.bool))\n"
        "except ValueError as exc:\n"
        "    print(type(exc).__name__)\n"
    )
    assert out.splitlines() == ["[]", "torch.bool rollout_trio", "WorkflowContractError"]


@pytest.mark.parametrize("first", ["ModelRequest", "Trajectory", "GenerationConfig", "RolloutGroup"])
def test_names_loaded_one_module_at_a_time_still_convert_and_resolve_their_annotations(first):
    """A class already reporting ``rollout_trio`` keeps its annotations' own module for cattrs
    (``_convert`` loads after it) and for ``typing.get_type_hints``."""
    out = _in_fresh_python(
        "import typing, torch, rollout_trio\n"
        f"getattr(rollout_trio, {first!r})\n"
        "from rollout_trio import GenerationConfig, ModelRequest, RolloutGroup, Trajectory, from_json, to_json\n"
        "r = ModelRequest(input_ids=[1, 2], gconfig=GenerationConfig(max_new_tokens=3))\n"
        "t = Trajectory(input_ids=torch.tensor([[1]]), attention_mask=torch.tensor([[True]]), rollout_group=RolloutGroup((1,)))\n"
        "print(from_json(to_json(r), ModelRequest).gconfig.max_new_tokens, from_json(to_json(t), Trajectory).rollout_group.row_counts)\n"
        "print(typing.get_type_hints(Trajectory)['input_ids'].__name__, typing.get_type_hints(ModelRequest)['gconfig'].__name__)\n"
    )
    assert out.splitlines() == ["3 (1,)", "Tensor GenerationConfig"]


def test_star_import_and_dir_give_every_public_name():
    out = _in_fresh_python(
        "import rollout_trio\n"
        "names = dir(rollout_trio)\n"
        "ns = {}\n"
        "exec('from rollout_trio import *', ns)\n"
        "print(sorted(n for n in ns if not n.startswith('_')) == sorted(rollout_trio.__all__))\n"
        "print(set(rollout_trio.__all__) <= set(names))\n"
    )
    assert out.split() == ["True", "True"]


def test_an_unknown_root_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'Trajectroy'"):
        rollout_trio.Trajectroy  # noqa: B018


def test_type_checkers_see_the_same_names_the_root_loads():
    """The TYPE_CHECKING imports and the lazy table name the same objects."""
    import ast

    tree = ast.parse((Path(rollout_trio.__file__)).read_text())
    seen = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) and not isinstance(node.test, ast.UnaryOp):
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom)
                for alias in imp.names:
                    assert alias.asname == alias.name  # `from .x import Y as Y`: an explicit re-export
                    module = "." * imp.level + (imp.module or "")
                    seen[alias.name] = (module, alias.name) if imp.module else (module + alias.name, None)
    assert seen == rollout_trio._LAZY
    assert sorted(seen) == sorted(rollout_trio.__all__)


@pytest.mark.parametrize("package", ["executor", "observe"])
def test_lazy_subpackages_load_a_name_with_its_own_module_only(package):
    """Issue 31: ``rollout-trio top`` reads ``executor._dump_records`` and ``observe._snapshot``
    without the executor, the metrics server or torch; every name still loads and is listed."""
    out = _in_fresh_python(
        "import sys\n"
        f"import rollout_trio.{package} as pkg\n"
        f"print(sorted(m for m in sys.modules if m.startswith('rollout_trio.{package}.')), 'torch' in sys.modules)\n"
        "ns = {}\n"
        f"exec('from rollout_trio.{package} import *', ns)\n"
        "print(sorted(n for n in ns if not n.startswith('_')) == sorted(pkg.__all__), set(pkg.__all__) <= set(dir(pkg)))\n"
    )
    assert out.splitlines() == ["[] False", "True True"]


@pytest.mark.parametrize("order", ["server, agents", "agents, server"])
def test_a_name_two_subpackages_export_reports_its_home_whichever_loads_first(order):
    """``ServerLimits`` is exported by ``server`` and ``agents``; it reported whichever was
    imported last (exposed once the root stopped importing the agents on its first name)."""
    out = _in_fresh_python(
        f"import rollout_trio.{order.split(', ')[0]}, rollout_trio.{order.split(', ')[1]}\n"
        "from rollout_trio import agents, server\n"
        "print(server.ServerLimits is agents.ServerLimits, server.ServerLimits.__module__)\n"
    )
    assert out.split() == ["True", "rollout_trio.server"]
