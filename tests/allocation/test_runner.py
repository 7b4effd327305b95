"""The runner's phases: what planning's progress and its per-phase report read."""

from hilore_actor.allocation import Runner
from hilore_actor.models import LoraSpec, build_model, tiny_config
from hilore_actor.workloads import replayed_microbatches


def test_phases_count_their_own_passes_and_seconds_and_tell_progress_of_each(fresh_seed):
    """A nested phase's passes and time are its own, not its parent's; the progress sink hears
    each phase start (pass 0) and each pass, numbered within its phase, with the phase's total;
    an enclosing phase's count resumes after the nested one."""
    print("seed", fresh_seed)
    model = build_model(tiny_config("qwen2", num_layers=2), lora=LoraSpec(4, 8, 0.0), seed=fresh_seed)
    (mb,) = replayed_microbatches(model, 1, 64, group_size=4, mean_len=16, seed=fresh_seed)
    runner, heard = Runner(model), []
    runner.progress = heard.append
    with runner.phase("outer"):
        runner.run(mb, "gc")
        with runner.phase("inner", total=2):
            runner.run(mb, "all-r")
            runner.run(mb, "all-h")
        runner.run(mb, "no-gc")
    runner.run(mb, "no-gc")  # outside any phase: counted nowhere
    told = [(e["phase"], e["pass"], e["total"]) for e in heard]
    assert told == [
        ("outer", 0, None),
        ("outer", 1, None),
        ("inner", 0, 2),
        ("inner", 1, 2),
        ("inner", 2, 2),
        ("outer", 2, None),
        ("", 1, None),
    ]
    elapsed = [e["elapsed"] for e in heard]
    assert elapsed == sorted(elapsed)
    stats = runner.phase_stats
    assert {k: v["passes"] for k, v in stats.items()} == {"outer": 2, "inner": 2}
    assert 0 < stats["inner"]["seconds"] and 0 < stats["outer"]["seconds"]
    assert stats["inner"]["seconds"] + stats["outer"]["seconds"] <= elapsed[-1]
