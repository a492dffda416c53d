"""Kubernetes sandbox backend: one pod per rollout, behind the same Sandbox interface.

Install with `pip install -e ".[kubernetes]"`; the `kubernetes` client is imported only when a
KubernetesSandbox is created, so the rest of rollwise never needs it.

Design
  - One pod per sandbox (`sleep infinity` as its main process); every `run` is a `kubectl exec`-style
    exec into it. The workspace is an emptyDir at /workspace (size-limited), /tmp another emptyDir;
    the root filesystem is read-only.
  - Isolation: runAsNonRoot (uid 65534), all capabilities dropped, no privilege escalation, the
    RuntimeDefault seccomp profile, no service-account token, no service links, optional
    `runtime_class_name` (e.g. gVisor's "runsc") and `host_users: false` (a user namespace per pod,
    Kubernetes >= 1.30), CPU/memory/ephemeral-storage limits on the container, and a deny-all
    NetworkPolicy (no ingress, no egress, so no DNS either) selecting every sandbox pod.
  - Per command: rlimits through `prlimit` when the image has it (util-linux), and
    `timeout -s KILL`, which kills the command's whole process group inside the pod; the client also
    stops reading at the deadline and keeps only a head and tail of the output.
  - Cleanup: `close()` deletes the pod (grace period 0); `activeDeadlineSeconds` makes the kubelet
    kill a pod whose owner died without closing it, and every pod carries the labels
    `app.kubernetes.io/managed-by=rollwise` and `rollwise.io/sandbox=true` for a sweep
    (`kubectl delete pod -l rollwise.io/sandbox=true`).
  - fork: the workspace is tarred in the source pod, streamed back as base64 in chunks, and
    unpacked in a new pod (exec without stdin, which older clients cannot close).

Tested here (tests/test_sandbox_kubernetes.py, no cluster): the pod spec (limits, security
context, volumes, labels, no token, deadline), the NetworkPolicy, the exec command wrapping
(timeout + prlimit + sh -c), the chunked file-write commands, parsing of `list` output, the result
mapping (exit codes, timeouts), that this module imports without the client, and the error when
the client is missing.

NOT tested here (no cluster on this machine): pod creation and readiness, exec streaming,
`returncode` handling of the client, file round trips, fork, deletion, and whether the cluster's
CNI actually enforces the NetworkPolicy (NetworkPolicies are silently ignored by CNIs without
support, e.g. plain flannel: check with `rollwise check sandbox` run inside a sandbox pod, or
`kubectl exec` + curl). Also not enforceable from a pod spec: a per-pod process limit (that is the
kubelet's `podPidsLimit`); without `host_users: false`, RLIMIT_NPROC counts all processes of uid
65534 on the node, so it bounds the node's sandboxes together, not each one.
"""

from __future__ import annotations

import base64
import shlex
import threading
import time
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from rollwise.sandbox.launch import rlimit_values
from rollwise.sandbox.process import Capture
from rollwise.sandbox.types import FileInfo, MiB, RunResult, SandboxError, SandboxLifecycle, SandboxLimits

SANDBOX_LABEL = "rollwise.io/sandbox"
WORKDIR = "/workspace"
_CHUNK = 48 * 1024  # base64 bytes per exec when writing files (well under ARG_MAX)
# `timeout -s KILL` kills its whole process group, itself included: SIGKILL, reported as 137 (or -9).
_EXIT_KILLED = (137, -9)


class KubernetesConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace: str = "default"
    image: str = Field("python:3.12-slim", description="needs sh, coreutils (timeout, base64, stat), tar")
    command: tuple[str, ...] = ("sleep", "infinity")
    cpu: str = "1"  # container CPU limit (also the request)
    ephemeral_storage: str = "2Gi"
    workspace_size: str = "1Gi"
    tmp_size: str = "256Mi"
    run_as_user: int = 65534
    host_users: bool | None = None  # False: a user namespace per pod (Kubernetes >= 1.30)
    runtime_class_name: str | None = None  # e.g. "gvisor"/"runsc", "kata"
    lifetime_s: int = Field(4 * 3600, ge=60, description="activeDeadlineSeconds: the kubelet kills older pods")
    pod_start_timeout_s: float = 180.0
    network_policy: bool = True  # create the deny-all NetworkPolicy in the namespace if missing
    labels: dict[str, str] = Field(default_factory=dict)
    node_selector: dict[str, str] = Field(default_factory=dict)
    kubeconfig: str | None = None
    context: str | None = None


def _quantity_bytes(n: int) -> str:
    return f"{n // MiB}Mi" if n % MiB == 0 else str(n)


def build_pod_spec(name: str, sandbox_id: str, cfg: KubernetesConfig, limits: SandboxLimits) -> dict[str, Any]:
    """The pod manifest for one sandbox (a plain dict: the client accepts it as the body)."""
    memory = _quantity_bytes(limits.whole_memory_bytes)  # the pod is the whole sandbox
    resources = {"cpu": cfg.cpu, "memory": memory, "ephemeral-storage": cfg.ephemeral_storage}
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "hostNetwork": False,
        "hostPID": False,
        "hostIPC": False,
        "terminationGracePeriodSeconds": 0,
        "activeDeadlineSeconds": cfg.lifetime_s,
        # No cluster DNS: the NetworkPolicy blocks it anyway, this makes lookups fail fast.
        "dnsPolicy": "None",
        "dnsConfig": {"nameservers": ["127.0.0.1"]},
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": cfg.run_as_user,
            "runAsGroup": cfg.run_as_user,
            "fsGroup": cfg.run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [{
            "name": "sandbox",
            "image": cfg.image,
            "command": list(cfg.command),
            "workingDir": WORKDIR,
            "env": [{"name": "HOME", "value": WORKDIR}, {"name": "TMPDIR", "value": "/tmp"},
                    {"name": "LANG", "value": "C.UTF-8"}, {"name": "PYTHONUNBUFFERED", "value": "1"}],
            "resources": {"limits": dict(resources), "requests": dict(resources)},
            "securityContext": {
                "privileged": False,
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]},
            },
            "volumeMounts": [{"name": "workspace", "mountPath": WORKDIR}, {"name": "tmp", "mountPath": "/tmp"}],
        }],
        "volumes": [
            {"name": "workspace", "emptyDir": {"sizeLimit": cfg.workspace_size}},
            {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": cfg.tmp_size}},
        ],
    }
    if cfg.host_users is not None:
        spec["hostUsers"] = cfg.host_users
    if cfg.runtime_class_name:
        spec["runtimeClassName"] = cfg.runtime_class_name
    if cfg.node_selector:
        spec["nodeSelector"] = dict(cfg.node_selector)
    labels = {**cfg.labels, "app.kubernetes.io/managed-by": "rollwise", SANDBOX_LABEL: "true",
              "rollwise.io/sandbox-id": sandbox_id}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": cfg.namespace, "labels": labels}, "spec": spec}


def build_network_policy(namespace: str) -> dict[str, Any]:
    """Deny all ingress and egress for every sandbox pod (no rules listed = nothing allowed)."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "rollwise-sandbox-deny-all", "namespace": namespace,
                     "labels": {"app.kubernetes.io/managed-by": "rollwise"}},
        "spec": {"podSelector": {"matchLabels": {SANDBOX_LABEL: "true"}}, "policyTypes": ["Ingress", "Egress"]},
    }


def build_exec_command(command: str, limits: SandboxLimits, timeout_s: float) -> list[str]:
    """argv for the exec: `timeout -s KILL` around `prlimit ... sh -c command` (prlimit if present)."""
    rl = " ".join(f"--{n}={s}:{h}" for n, (s, h) in rlimit_values(limits).items())
    t = f"{max(timeout_s, 0.1):g}"
    script = (f'if command -v prlimit >/dev/null 2>&1; then exec timeout -s KILL {t} prlimit {rl} -- sh -c "$1"; '
              f'else exec timeout -s KILL {t} sh -c "$1"; fi')
    return ["sh", "-c", script, "sandbox", command]


def write_file_commands(path: str, data: bytes) -> list[str]:
    """Shell commands that recreate `data` at `path` in chunks of base64 (exec without stdin)."""
    q = shlex.quote(path)
    encoded = base64.b64encode(data).decode()
    cmds = [f"mkdir -p -- \"$(dirname -- {q})\" && : > {q}"]
    for i in range(0, len(encoded), _CHUNK):
        cmds.append(f"printf %s {encoded[i:i + _CHUNK]} | base64 -d >> {q}")
    return cmds


LIST_COMMAND = "cd -- {path} && for f in .[!.]* ..?* *; do [ -e \"$f\" ] || [ -L \"$f\" ] || continue; " \
               "printf '%s\\t%s\\t%s\\n' \"$(stat -c %F -- \"$f\")\" \"$(stat -c %s -- \"$f\")\" \"$f\"; done"


def parse_list(output: str, base: str) -> list[FileInfo]:
    kinds = {"regular file": "file", "regular empty file": "file", "directory": "dir", "symbolic link": "symlink"}
    out = []
    prefix = "" if base in ("", ".") else base.rstrip("/") + "/"
    for line in output.splitlines():
        parts = line.split("\t", 2)
        if len(parts) == 3:
            kind, size, name = parts
            out.append(FileInfo(path=prefix + name, kind=kinds.get(kind, "other"), size=int(size)))
    return sorted(out, key=lambda f: f.path)


def result_from_exec(command: str, code: int | None, out: Capture, err: Capture, wall_s: float,
                     timeout_s: float, client_deadline_hit: bool) -> RunResult:
    killed = client_deadline_hit or (code in _EXIT_KILLED and wall_s >= timeout_s * 0.95)
    return RunResult(
        command=command, exit_code=None if killed else code, stdout=out.text(), stderr=err.text(),
        stdout_bytes=out.total, stderr_bytes=err.total, stdout_truncated=out.truncated,
        stderr_truncated=err.truncated, wall_s=round(wall_s, 4), killed=killed,
        limit="timeout" if killed else None,
        reason=f"killed: wall-clock timeout after {timeout_s:g} s" if killed else None,
    )


def _client():
    try:
        import kubernetes  # optional dependency, imported on first use only
        from kubernetes.stream import stream
    except ImportError as exc:
        raise SandboxError("the Kubernetes sandbox backend needs the kubernetes client: "
                           "pip install -e \".[kubernetes]\" (or pip install kubernetes)") from exc
    return kubernetes, stream


class KubernetesSandbox(SandboxLifecycle):
    """One pod. See the module docstring for what is and is not tested."""

    _policy_done: ClassVar[set[str]] = set()  # namespaces whose NetworkPolicy exists
    _policy_lock = threading.Lock()

    def __init__(self, limits: SandboxLimits | None = None, config: KubernetesConfig | None = None,
                 *, run_gate: threading.Semaphore | None = None) -> None:
        super().__init__()
        self.limits = limits or SandboxLimits()
        self.config = config or KubernetesConfig()
        self._gate = run_gate
        kubernetes, self._stream = _client()
        if self.config.kubeconfig or self.config.context:
            kubernetes.config.load_kube_config(config_file=self.config.kubeconfig, context=self.config.context)
        else:
            try:
                kubernetes.config.load_incluster_config()
            except kubernetes.config.ConfigException:
                kubernetes.config.load_kube_config()
        self._api = kubernetes.client.CoreV1Api()
        self._net = kubernetes.client.NetworkingV1Api()
        self._ApiException = kubernetes.client.exceptions.ApiException
        self.pod_name = f"rollwise-sandbox-{self._id}"
        self._lock = threading.Lock()
        self._ensure_network_policy()
        self._api.create_namespaced_pod(self.config.namespace,
                                        build_pod_spec(self.pod_name, self._id, self.config, self.limits))
        try:
            self._wait_running()
        except BaseException:
            self.close()
            raise

    @property
    def workdir(self) -> str:
        return WORKDIR

    def _ensure_network_policy(self) -> None:
        ns = self.config.namespace
        if not self.config.network_policy or ns in self._policy_done:
            return
        with self._policy_lock:
            try:
                self._net.create_namespaced_network_policy(ns, build_network_policy(ns))
            except self._ApiException as exc:
                if exc.status != 409:  # 409: already exists
                    raise SandboxError(f"cannot create the sandbox NetworkPolicy in {ns}: {exc.reason}") from exc
            self._policy_done.add(ns)

    def _wait_running(self) -> None:
        deadline = time.monotonic() + self.config.pod_start_timeout_s
        while time.monotonic() < deadline:
            pod = self._api.read_namespaced_pod(self.pod_name, self.config.namespace)
            phase = pod.status.phase
            if phase == "Running":
                return
            if phase in ("Failed", "Succeeded"):
                raise SandboxError(f"sandbox pod {self.pod_name} ended before use (phase {phase})")
            time.sleep(0.5)
        raise SandboxError(f"sandbox pod {self.pod_name} not running after {self.config.pod_start_timeout_s:g} s")

    def _exec(self, argv: list[str], timeout_s: float, keep: int, kill: int) -> tuple[int | None, Capture, Capture,
                                                                                    float, bool]:
        start = time.monotonic()
        resp = self._stream(self._api.connect_get_namespaced_pod_exec, self.pod_name, self.config.namespace,
                            container="sandbox", command=argv, stderr=True, stdin=False, stdout=True, tty=False,
                            _preload_content=False)
        out, err = Capture.new(keep), Capture.new(keep)
        deadline = start + timeout_s + 5  # the in-pod `timeout` should fire first
        hit = False
        try:
            while resp.is_open():
                if time.monotonic() > deadline or out.total + err.total > kill:
                    hit = True
                    break
                resp.update(timeout=0.5)
                if resp.peek_stdout():
                    out.feed(resp.read_stdout().encode())
                if resp.peek_stderr():
                    err.feed(resp.read_stderr().encode())
            code = None if hit else resp.returncode
        finally:
            resp.close()
        return code, out, err, time.monotonic() - start, hit

    def _sh(self, script: str, timeout_s: float = 60.0) -> RunResult:
        argv = build_exec_command(script, self.limits, timeout_s)
        code, out, err, wall, hit = self._exec(argv, timeout_s, 64 * MiB, 256 * MiB)
        return result_from_exec(script, code, out, err, wall, timeout_s, hit)

    def run(self, command: str, timeout_s: float | None = None, *, stdin: bytes | None = None) -> RunResult:
        timeout = float(timeout_s) if timeout_s is not None else self.limits.timeout_s
        if self._gate is not None:
            self._gate.acquire()
        try:
            with self._lock:
                self._check_open()
                if stdin is not None:
                    for cmd in write_file_commands("/tmp/.rollwise-stdin", stdin):
                        self._sh(cmd)
                    command = f"( {command} ) < /tmp/.rollwise-stdin"
                argv = build_exec_command(command, self.limits, timeout)
                code, out, err, wall, hit = self._exec(argv, timeout, self.limits.max_output_bytes,
                                                       self.limits.kill_output_bytes)
                return result_from_exec(command, code, out, err, wall, timeout, hit)
        finally:
            if self._gate is not None:
                self._gate.release()

    def read_file(self, path: str, max_bytes: int = 1 * MiB) -> bytes:
        q = shlex.quote(path)
        with self._lock:
            self._check_open()
            size = self._sh(f"stat -c %s -- {q}")
            if not size.ok:
                raise SandboxError(f"no such file: {path}")
            if int(size.stdout.strip()) > max_bytes:
                raise SandboxError(f"{path} is {size.stdout.strip()} bytes, more than max_bytes={max_bytes}")
            r = self._sh(f"base64 -- {q}")
        if not r.ok:
            raise SandboxError(f"reading {path} failed: {r.stderr.strip()[:300]}")
        return base64.b64decode(r.stdout)

    def write_file(self, path: str, data: bytes | str) -> None:
        raw = data.encode() if isinstance(data, str) else bytes(data)
        with self._lock:
            self._check_open()
            for cmd in write_file_commands(path, raw):
                r = self._sh(cmd)
                if not r.ok:
                    raise SandboxError(f"writing {path} failed: {r.stderr.strip()[:300]}")

    def list(self, path: str = ".") -> list[FileInfo]:
        with self._lock:
            self._check_open()
            r = self._sh(LIST_COMMAND.format(path=shlex.quote(path)))
        if not r.ok:
            raise SandboxError(f"listing {path} failed: {r.stderr.strip()[:300]}")
        return parse_list(r.stdout, path)

    def fork(self) -> KubernetesSandbox:
        with self._lock:
            self._check_open()
            tar = self._sh("tar -C /workspace -czf - . | base64 -w0", timeout_s=300)
        if not tar.ok or tar.stdout_truncated:
            raise SandboxError(f"fork: packing the workspace failed: {tar.stderr.strip()[:300] or 'too large'}")
        child = KubernetesSandbox(self.limits, self.config, run_gate=self._gate)
        try:
            child.write_file("/tmp/.rollwise-fork.tgz", base64.b64decode(tar.stdout))
            r = child._sh("tar -C /workspace -xzf /tmp/.rollwise-fork.tgz && rm /tmp/.rollwise-fork.tgz", 300)
            if not r.ok:
                raise SandboxError(f"fork: unpacking the workspace failed: {r.stderr.strip()[:300]}")
        except BaseException:
            child.close()
            raise
        return child

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._api.delete_namespaced_pod(self.pod_name, self.config.namespace, grace_period_seconds=0)
        except self._ApiException as exc:
            if exc.status != 404:
                raise SandboxError(f"deleting sandbox pod {self.pod_name} failed: {exc.reason}") from exc
