"""The shared engine pool: several training jobs time-slice one set of engines (`rollwise serve pool`).

states.py     the per-(slot, job) state machine: active / sleeping / evicted, with measured transition costs
scheduler.py  the pure time-slicing policy (weighted fair share, minimum slice, no preemption of running work) over
              engine tenancies: a full-parameter job, or the LoRA jobs of one base sharing one engine batch
engine_pool.py the pool: jobs, tokens, queues, weights, accounting (EnginePool); slots.py its slot loops
tenant_engines.py how a slot's engines are built for a tenancy, and the probe that finds a job that breaks one
jobs.py       the records (Job, QueuedRequest, Slot); weights.py the weight upload; metrics.py /metrics
tenancy.py    what a job may hold of the pool's memory (its footprint, the budget); API keys and jobs per key come
              from the serving front (rollwise.serve.auth)
app.py        the HTTP API (routes only); server.py `rollwise serve pool` (starts it)
cli.py        `rollwise serve pool` options
(rollwise.sim.mux drives scheduler.py on simulated engines: what sharing gives at scale, without CPU contention)
"""
