"""The events of an expert-parallel step, for tests and schedule inspection (paper Sec. 4.1-4.2, Appendix C): the
launch and completion of every exchange, their replays in recomputation, and the schedule's markers."""

from contextlib import contextmanager


class _Events:
    log: list | None = None


_EVENTS = _Events()


@contextmanager
def record_events():
    """Collect ``(what, kind, serial)`` events of this process while the block runs (tests, schedule inspection):
    ``launch`` / ``done`` of every forward exchange (``done``: its result is complete, at launch when it blocks),
    ``reverse`` / ``reverse_done`` in backward, and the schedule's ``layer``, ``attention`` and ``shared`` markers."""
    saved, _EVENTS.log = _EVENTS.log, []
    try:
        yield _EVENTS.log
    finally:
        _EVENTS.log = saved


def record(what: str, kind: str, serial: int) -> None:
    """Append one event when :func:`record_events` is active (no cost otherwise)."""
    if _EVENTS.log is not None:
        _EVENTS.log.append((what, kind, serial))
