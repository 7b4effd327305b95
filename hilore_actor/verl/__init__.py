"""HiLoRe as the actor of verl 0.9.1 recipes.

- ``engine``: ``HiLoReFSDPEngine``, verl's FSDP engine under the backend key ``hilore``;
- ``attach``: its plan, recovery engine and budget coordinator, made once verl built the model;
- ``microbatches``: each verl micro-batch as one learner microbatch (actions between loss and
  backward, peaks to the coordinator);
- ``token_weights``: omega from verl's own loss, in the model's input layout;
- ``settings``: the ``+actor_rollout_ref.actor.hilore.*`` overrides;
- ``register``: what verl imports in every process (``verl.plugins`` entry point,
  ``VERL_USE_EXTERNAL_MODULES``), ``main_ppo``: the launcher.

Importing this package imports nothing from verl; its modules do, where used.
"""
