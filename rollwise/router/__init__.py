"""The inference router: prefix-, session- and load-aware routing across engine replicas, with
failover (`rollwise serve router`). Policies (policies.py, radix.py) are pure and shared with the
simulated replicas of sim.py; app.py is the HTTP gateway."""
