"""The shared engine pool: several training jobs time-slice one set of engines (`rollwise serve pool`).

states.py     the per-(slot, job) state machine: active / sleeping / evicted, with measured transition costs
scheduler.py  the pure time-slicing policy (weighted fair share, minimum slice, no preemption of running work)
server.py     the pool: engines on EngineWorker threads, per-job queues, tokens, weights, accounting; HTTP API
client.py     a training job's side: attach_to_pool (used by rollwise.control.placement) and the HTTP worker
cli.py        `rollwise serve pool` options
(rollwise.sim.mux drives scheduler.py on simulated engines: what sharing gives at scale, without CPU contention)
"""
