"""Weight transport from the trainer to the engines: versioned, verified, all-or-nothing.

One update (`WeightUpdate`, rollwise.types.weight_update: a manifest + its payload) and one receiving side
(`WeightReceiver`, the engine side's, rollwise.engine.weight_receiver: stage everything, verify, then apply the
whole update). The transports call down into it, never the reverse. The trainer makes the update
(`Trainer.weight_update`); the placement's RolloutBackend carries it over the transport its
configuration picks:

    placement: local      EngineWorker.load_weights        in-process, zero-copy views
    placement: ray        RayEngineFleet.load_weights      Ray object store (an ObjectRef payload)
      + sync.sender:      RayEngineFleet.load_weights      one torch.distributed broadcast from the driver
        collective                                         to every engine actor (DistributedSender /
                                                           DistributedReceiver; gloo on CPU, NCCL on GPU)
    pool.url              PoolWorker.load_weights          HTTP: checksummed buckets, the pool commits

The byte-moving transports share one format (rollwise.sync.buckets: manifest, buckets, xxh3 checksums):

    in-process   InProcessTransport(receivers, fingerprint).push(state_dict, version)
    broadcast    DistributedSender(fingerprint).push(...) on rank 0, DistributedReceiver(receiver).serve()
                 on every engine rank (torch.distributed: gloo on CPU, NCCL on GPU)
    files        FileTransport(root, fingerprint).push(...) writes <root>/v<version>/,
                 FileReceiver(receiver).load(dir) / .load_latest(root) on the engine side

rollwise.sync.inprocess.push_weights pushes a model to engines held directly, through the same check.
"""
