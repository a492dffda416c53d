"""Environments as services (issue 40): environments written for other trainers run in their own worker
processes (optionally under their own interpreter), their model calls recorded token-exact by the agent proxy.

Modules, one job each:

    protocol           the JSON-lines wire protocol between rollwise and a worker (checked replies)
    workers            WorkerProcess / EnvService: start, health-check, restart, stop; failures -> failed rollouts
    verifiers_worker   the classic-verifiers worker: a standalone script run under the environment's interpreter
    verifiers_v1_driver  runs a verifiers 0.4 (v1) taskset against an engine server / router's token route
                       (standalone, under verifiers 0.4's interpreter); JSON lines of traces. Not a task kind yet
    kinds              which worker runs a task kind (WORKER_KINDS)
    runner             EnvRunner: the proxy on loopback + the service -> rollouts with exact tokens and rewards
    controller         EnvController: `rollwise train` with an environment task
"""
