"""`placement: ray`: the engines, the trainer (or its FSDP2 ranks) and the reward workers as Ray actors.

    placement         the run's Ray session (cluster, placement group, bundles), the trainer actor, place_on_ray
    fleet             RayEngineFleet: the engine actors as one RolloutBackend (submit, drain, weights, pause)
    fleet_recovery    FleetRecovery: a dead engine actor's slot restarted, its outstanding requests resubmitted
    fleet_collective  FleetWeightGroup: the fleet's torch.distributed weight group (sync.sender=collective)
    fleet_timeline    FleetView: the engines' merged timeline, read by the loop's metrics
    slots             the per-actor state the fleet and its parts share (Slot, Outstanding)
    engine_actor      EngineActor: one engine on its worker thread inside an actor
    trainer_ranks     TrainerRankActor / RayRankGroup: FSDP2 trainer ranks as actors
    reward            RewardActor / RayScorer: finished groups scored on reward actors
    env_workers       EnvWorkerActor / RayEnvWorker: an environment task's workers, one actor each
    calls             ray.get over many refs with a deadline, and the one log line format

Every module here imports Ray at the top; nothing outside this package does (placement's ray.py imports it
when `placement: ray` is chosen).
"""
