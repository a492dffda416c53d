"""Sandboxes: one isolated, persistent workspace per rollout (issue 6, "Sandbox runtime").

    from rollwise.sandbox.pool import SandboxPool
    from rollwise.sandbox.types import SandboxLimits

    with SandboxPool(SandboxLimits(timeout_s=10), max_sandboxes=8, warm=2) as pool:
        with pool.sandbox() as sb:
            sb.write_file("main.py", "print(6 * 7)")
            result = sb.run("python3 main.py")      # RunResult: exit code, output, wall time, limits hit
            sibling = sb.fork()                     # same files, diverges from here

Modules: types (the contract), launch (argv per isolation level), isolation (what this machine
allows, said once at start-up), process (bounded run of one process tree), workspace (temp dirs,
cleanup), files (host-side file access that never follows the sandbox's symlinks), local (the
bubblewrap backend), pool (limits, warm sandboxes, cleanup), kubernetes (one pod per rollout),
limits (which whole-sandbox limits hold here), seccomp (the syscall deny list),
probes (`rollwise check sandbox`).
"""
