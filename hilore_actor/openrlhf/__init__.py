"""HiLoRe as a drop-in learner for OpenRLHF 0.11.2 recipes (``--actor_backend hilore``).

- ``train_ppo_ray``: ``python -m hilore_actor.openrlhf.train_ppo_ray <OpenRLHF flags>
  --actor_backend hilore [--hilore.*]`` runs OpenRLHF's own CLI with HiLoRe's policy actor;
- ``policy_actor``: that actor, a subclass of OpenRLHF's ``PolicyModelActor`` (GPU);
- ``training_step``: the wrapper around ``ActorPPOTrainer.training_step`` (the engine's step
  API, actions from omega, peaks to the budget coordinator);
- ``skip``: ``--hilore.skip_zero_advantage`` inside ``ppo_train``'s micro-batching;
- ``patches/openrlhf-0.11.2-actor-backend.patch`` adds the flag to a source checkout.

Nothing here imports OpenRLHF at package import; ``policy_actor`` and ``train_ppo_ray``
import it when used.
"""
