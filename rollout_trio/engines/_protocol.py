"""The interface every inference engine offers to workflows and trainers."""

from __future__ import annotations

from collections.abc import Mapping
from os import PathLike
from types import TracebackType
from typing import Any, Protocol, Self, runtime_checkable


from .._io import ModelRequest, ModelResponse

__all__ = ["InferenceEngine", "WeightsSource"]

#: A state dict (name -> tensor) or a checkpoint directory.
WeightsSource = Mapping[str, Any] | str | PathLike[str]


@runtime_checkable
class InferenceEngine(Protocol):
    """What workflows call (``agenerate``, ``get_version``) and trainers drive.

    An engine is an async context manager that owns its resources: enter it before use,
    and leaving it cancels in-flight work and releases threads, sockets and models.

    Contract every implementation keeps:

    * ``agenerate`` honours cancellation: a cancelled call stops its generation on the
      engine (a server-side abort for remote engines) before it returns.
    * every output token carries the version of the weights that produced it.
    * ``pause`` stops new generation segments; in-flight requests are interrupted and
      resume after ``resume`` from the tokens they already have.
    """

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate a completion for ``req``."""
        ...

    def get_version(self) -> int:
        """The current weight version."""
        ...

    def set_version(self, version: int) -> None:
        """Set the weight version stamped on tokens generated from now on."""
        ...

    async def pause(self) -> None:
        """Stop generating: interrupt in-flight requests at a step boundary and hold new ones."""
        ...

    async def resume(self) -> None:
        """Let held and interrupted requests continue."""
        ...

    async def update_weights(self, source: WeightsSource, version: int) -> None:
        """Load new weights (pausing around the load) and set ``version``."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...
