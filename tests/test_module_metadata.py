"""fixup_module_metadata: public names report the public module, mutmut's copies do not."""

from rollout_trio._util import fixup_module_metadata


def _namespace() -> dict[str, type]:
    class Public:
        def method(self) -> int:
            return 1

    Public.__module__ = "rollout_trio._private"
    Public.method.__module__ = "rollout_trio._private"
    def copy(self: object) -> int:
        return 1

    copy.__module__ = "rollout_trio._private"
    setattr(Public, "xǁPublicǁmethod__mutmut_orig", copy)  # noqa: B010 - mutmut's name is not an identifier
    return {"Public": Public}


def test_public_classes_and_their_methods_report_the_public_module() -> None:
    ns = _namespace()
    fixup_module_metadata("rollout_trio", ns)
    assert ns["Public"].__module__ == "rollout_trio" and ns["Public"].__qualname__ == "Public"


def test_mutmut_method_copies_keep_their_home_module() -> None:
    """mutmut maps tests to mutants by the copy's module: rewritten, no test reached a
    public class's methods (``StalenessManager``'s 93 mutants had "no tests")."""
    ns = _namespace()
    orig = ns["Public"].__dict__["xǁPublicǁmethod__mutmut_orig"]
    fixup_module_metadata("rollout_trio", ns)
    assert orig.__module__ == "rollout_trio._private"
