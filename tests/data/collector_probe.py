"""A planner stand-in for the worker process's tests: the state of its garbage collector."""

import gc


def collector_state(doc_lens: list[int]) -> tuple[bool, int]:
    """Whether the cyclic collector runs while a plan is made, and how many objects it never scans."""
    return gc.isenabled(), gc.get_freeze_count()
