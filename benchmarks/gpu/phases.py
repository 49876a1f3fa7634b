"""The phase log `pass_phases.py` and `draft_phases.py` split a speculative loop's iterations by."""
import time

log = []  # (phase, start, end)


def stamped(name, fn, only=None):
    """fn, each call logged as phase `name` (with `only`: the calls whose first argument it is)."""
    def run(*args, **kwargs):
        t = time.perf_counter()
        r = fn(*args, **kwargs)
        if only is None or args[0] is only:
            log.append((name, t, time.perf_counter()))
        return r
    return run


def iterations(yields: list[float]) -> list[dict]:
    """For each gap between two yields, its milliseconds and those of each phase logged in it."""
    its = []
    for a, b in zip(yields, yields[1:]):
        phases = {}
        for ph, s, e in log:
            if a <= s < b:
                phases[ph] = phases.get(ph, 0.0) + 1000 * (e - s)
        its.append(dict(gap=round(1000 * (b - a), 3), **{k: round(v, 3) for k, v in phases.items()}))
    return its
