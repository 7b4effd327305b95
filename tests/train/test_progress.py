"""The driver's progress while it waits on workers (``train/progress.py``), on a stand-in of the Ray
calls it makes (``remote``, ``wait``, ``get``): the workers' reports are scripted per poll."""

import io
import time

from hilore_actor.train.progress import Progress, describe


class Handle:
    """An actor handle whose ``method.remote(...)`` calls the method at once and returns its value."""

    def __init__(self, obj):
        self.obj = obj

    def __getattr__(self, name):
        fn = getattr(self.obj, name)
        return type("M", (), {"remote": staticmethod(lambda *a, **k: fn(*a, **k))})


class FakeRay:
    """``wait`` reports the refs pending for ``polls`` calls, running ``script[i]`` (what the workers
    tell the board) before poll ``i``; ``get`` returns values as they are."""

    def __init__(self, polls: int, script):
        self.polls, self.script, self.calls = polls, script, 0

    def remote(self, cls):
        return type("A", (), {"options": lambda *_, **__: type("O", (), {"remote": lambda *a: Handle(cls(*a))})})()

    def wait(self, refs, num_returns, timeout):
        if self.calls in self.script:
            self.script[self.calls]()
        self.calls += 1
        return (refs, []) if self.calls > self.polls else ([], refs)

    def get(self, x):
        return x


def run(polls, script_for, tty, after=0.0):
    out = io.StringIO()
    ray = FakeRay(polls, {})
    progress = Progress(ray, stream=out, config=Progress.Config(poll=0.0, every=3600.0, after=after), tty=tty)
    ray.script = script_for(progress)
    return progress.get(["done"], "plan"), out.getvalue()


def script(progress):
    a, b = progress.reporter("learner-0"), progress.reporter("learner-1")
    return {
        0: lambda: (a({"phase": "gc", "pass": 1, "total": 1, "elapsed": 2.0}), b({"phase": "gc", "pass": 0})),
        1: lambda: a({"phase": "profiling", "pass": 3, "total": None, "elapsed": 65.0}),
        2: lambda: a({"phase": "profiling", "pass": 4, "total": None, "elapsed": 70.0}),  # same phase: no line
        3: lambda: b({"phase": "leave-one-out", "pass": 5, "total": 12, "elapsed": 80.0}),
    }


def test_plain_output_says_each_workers_phase_once_as_it_enters_it():
    got, text = run(5, script, tty=False)
    assert got == ["done"]  # the workers' results, as ray.get gives them
    lines = text.splitlines()
    assert lines[0] == "[plan] learner-0: gc 1/1, 2s" and lines[1].startswith("[plan] learner-1: gc, ")
    assert lines[2].startswith("[plan] learner-0: profiling pass 3, 1m05s")
    assert lines[3].startswith("[plan] learner-1: leave-one-out 5/12, 1m20s")
    assert len(lines) == 4


def test_a_terminal_gets_one_updating_line_per_worker():
    _, text = run(5, script, tty=True)
    assert "learner-1: leave-one-out 5/12" in text and "learner-0: profiling pass 4" in text
    assert text.count("learner-0: gc 1/1") == 1  # redrawn, not appended


def test_a_short_wait_shows_nothing():
    _, text = run(3, script, tty=False, after=60.0)
    assert text == ""


def test_describe_counts_the_time_since_the_worker_told():
    e = {"phase": "generating", "pass": 10, "total": 64, "elapsed": 5.0, "at": time.time() - 60}
    assert describe("rollout-0", e, time.time()) == "rollout-0: generating 10/64, 1m05s"
    assert describe("rollout-0", e) == "rollout-0: generating 10/64, 5s"
