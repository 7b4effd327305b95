"""The learner room: what every learner integration shares (the training job, the OpenRLHF
drop-in, later verl), so that none of them imports another.

- ``settings``: the ``--hilore.*`` flags (generated from ``Settings`` and ``Planner.Config``) and checks;
- ``plan``: a rank's planner (B, the planner and its plan), made on the bare model before DeepSpeed
  wraps it;
- ``lockstep``: planning on a sharded (FSDP) model: rank 0 leads, the other ranks replay;
- ``microbatch_run``: one microbatch's sequence (meter -> engine step -> actions -> report -> tighten);
- ``coordinator``: the budget coordinator every rank reports its peaks to;
- ``scope``: what B counts, resident bytes; ``fault_injection``: the ``HILORE_FAULT`` switch.

Imports torch and the package's lower floors only; the integrations import it.
"""
