"""The engine's trust rules for weight versions, in one place (DESIGN.md turn 4, "Trust").

A server, a router and any local user who can reach a server's control routes are
untrusted. These rules keep one of them from moving the fleet's version, or from failing
the requests of the honest servers:

* **Labels** are ``"default"`` (version 0) or a canonical decimal integer in
  ``[0, 2**63 - 1]``: ASCII digits, no sign, no leading zero, no space, no ``_``
  (:func:`parse_version_label`). Anything else is a :class:`~rollout_trio.VersionLabelError`
  naming the field and the rule.
* **The fleet's version is what this engine's control plane set**: :meth:`RemoteEngine.update_weights`,
  :meth:`RemoteEngine.set_version`, or at start the version the servers agree on (the one a
  strict majority holds when they do not all agree; no majority is an error).
* **No server moves it alone.** An engine that only observes (another trainer rank
  publishes the weights) follows a newer version when a strict majority of the servers it
  has in service, two at least, report it over the control plane (:meth:`VersionPolicy.quorum`).
* **A server that disagrees is taken out of service**, never the others refused: an answer
  labelled older than the fleet's version when its segment was sent, newer than the fleet's
  version now, going backwards, or with a bad label is dropped, and the request goes to
  another server.
* **A server is labelled with a version only once it holds those weights**: this engine
  reloaded them into it (the checkpoint of its last update), or the trainer confirmed it
  (``RemoteEngine(restore=...)``). An engine with no checkpoint of its own (it never
  published) takes a returning server back only at the fleet's version, which the publisher
  loaded into it. Until then the server stays out of service (:meth:`VersionPolicy.admission`).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from .._errors import VersionLabelError, VersionMismatchError

__all__ = ["INT64_MAX", "VersionPolicy", "check_version", "parse_version_label"]

INT64_MAX = 2**63 - 1
#: ASCII only ([0-9], not \d), no leading zero, at most 19 digits (the range is checked after).
_CANONICAL = re.compile(r"0|[1-9][0-9]{0,18}")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_version_label(value: Any, field: str) -> int:
    """A weight-version label (a string a server reports, or an int) as an int.

    ``"default"`` is version 0. A string must be a canonical decimal integer; an int must
    not be a bool; both must lie in ``[0, 2**63 - 1]``.

    Raises:
        VersionLabelError: naming ``field`` and the rule broken.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise VersionLabelError(
            f"{field}: must be 'default' or a decimal integer string, got {type(value).__name__} {_shown(value)}",
            field=field,
            rule="type",
        )
    if isinstance(value, str):
        if value == "default":
            return 0
        if not _CANONICAL.fullmatch(value):
            raise VersionLabelError(
                f"{field}: must be 'default' or a canonical decimal integer (ASCII digits, no sign, "
                f"no leading zero, no space, no '_'), got {_shown(value)}",
                field=field,
                rule="canonical",
            )
        number = int(value)
    else:
        number = value
    if not 0 <= number <= INT64_MAX:
        raise VersionLabelError(
            f"{field}: must be in [0, 2**63 - 1], got {_shown(value)}", field=field, rule="range"
        )
    return number


def check_version(version: Any, field: str) -> int:
    """A version given to the API (``update_weights``, ``set_version``, ``version=``).

    Raises:
        VersionLabelError: not an int (bools refused) in ``[0, 2**63 - 1]``.
    """
    if isinstance(version, bool) or not isinstance(version, int):
        raise VersionLabelError(
            f"{field}: must be an int, got {type(version).__name__} {_shown(version)}", field=field, rule="type"
        )
    return parse_version_label(version, field)


Admission = Literal["admit", "reload", "restore", "keep_out"]


class VersionPolicy:
    """Which versions the engine accepts, and when a server is in or out (see the module).

    Attributes:
        label: this engine's version (:meth:`RemoteEngine.get_version`), stamped on tokens
            whose server reports none.
        fleet: the version the servers hold as this engine's control plane set it, or None
            while no server reports one.
        verify: whether reported versions are checked (``verify_versions``).
    """

    def __init__(self, version: int, *, verify: bool) -> None:
        self.label = check_version(version, "RemoteEngine.version")
        self.fleet: int | None = None
        self.verify = verify

    def set(self, version: int) -> None:
        """The control plane moved the fleet to ``version`` (an update, or the trainer said so)."""
        self.fleet = version
        self.label = version

    def agree(self, reported: Mapping[str, int | None], *, where: str) -> list[str]:
        """At start (or after an interrupted update): adopt the version the servers hold.

        Returns the servers (their URLs) that hold another version: they go out of service.
        A version is adopted when every server reporting one agrees, or a strict majority of
        them does; with no server reporting one, :attr:`fleet` stays None.

        Raises:
            VersionMismatchError: no version is held by a strict majority (naming them all).
        """
        known = {url: v for url, v in reported.items() if v is not None}
        if not known:
            self.fleet = None
            return []
        counts = Counter(known.values())
        version, held = counts.most_common(1)[0]
        if held * 2 <= len(known):
            listing = ", ".join(f"{url} at {v}" for url, v in sorted(known.items()))
            raise VersionMismatchError(
                f"{where}: the servers disagree on their weight version and no version is held by a majority "
                f"({listing}); update them to one checkpoint (update_weights) before starting"
            )
        self.fleet = version
        self.label = version
        return sorted(url for url, v in known.items() if v != version)

    def judge(self, versions: Sequence[int], floor: int | None) -> str | None:
        """Why an answer's versions disagree with the fleet (None: they are accepted).

        ``versions`` are the answer's (per token, or the server's one version); ``floor``
        the fleet's version when the segment was sent. Accepted: non-decreasing, from
        ``floor`` up to the fleet's version now (a request held across an update carries
        both). With no fleet version known yet, any non-decreasing labels (never adopted).
        """
        for i in range(1, len(versions)):
            if versions[i] < versions[i - 1]:
                return f"weight versions go backwards within a segment ({versions[i - 1]} then {versions[i]} at token {i})"
        if not versions:
            return None
        if floor is not None and versions[0] < floor:
            return (
                f"weight version {versions[0]} for tokens of a segment sent when the fleet was at version {floor} "
                "(stale weights)"
            )
        if self.fleet is not None and versions[-1] > self.fleet:
            return f"weight version {versions[-1]}, newer than the fleet's {self.fleet} (no update this engine knows of)"
        return None

    def quorum(self, reported: Mapping[str, int | None]) -> int | None:
        """A newer version to follow: the one a strict majority of the servers in service
        (``reported``: their versions read over the control plane; None where unreadable),
        two at least, hold. None: the fleet's version stands."""
        known = [v for v in reported.values() if v is not None]
        if not known or self.fleet is None:
            return None
        version, held = Counter(known).most_common(1)[0]
        if version > self.fleet and held >= 2 and held * 2 > len(reported):
            return version
        return None

    def follow(self, version: int) -> None:
        """Follow a newer version a quorum of the servers holds (never lowers the label)."""
        self.fleet = version
        self.label = max(self.label, version)

    def admission(self, held: int | None, *, checkpoint: bool, can_reload: bool, can_restore: bool) -> Admission:
        """How a healthy server out of service comes back.

        Args:
            held: the version it reports (None: it reports none).
            checkpoint: whether this engine has updated the fleet (it knows what to load).
            can_reload: whether this engine can load the checkpoint into it itself.
            can_restore: whether the trainer gave a ``restore`` callback.

        Returns:
            ``"admit"`` (as it is), ``"reload"`` (the checkpoint), ``"restore"`` (ask the
            trainer), or ``"keep_out"``.
        """
        if self.fleet is None:
            return "admit"  # nothing reports a version: nothing to check
        if checkpoint:  # this engine published: it loads the weights itself, whatever the label says
            if can_reload:
                return "reload"
            return "restore" if can_restore else "keep_out"
        if held == self.fleet:
            return "admit"  # what the publisher (or the server's start) loaded
        return "restore" if can_restore else "keep_out"
