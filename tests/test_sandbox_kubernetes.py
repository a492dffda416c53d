"""The Kubernetes backend without a cluster: its manifests, and its shell plumbing run for real
(locally, in a LocalSandbox or a plain subprocess). What needs a cluster is listed in the module's
docstring as not tested."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

import pytest

from rollwise.sandbox.local import LocalSandbox
from rollwise.sandbox.types import SandboxError, SandboxLimits
from rollwise.sandbox.kubernetes import (
    LIST_COMMAND,
    KubernetesConfig,
    KubernetesSandbox,
    build_exec_command,
    build_network_policy,
    build_pod_spec,
    parse_list,
    result_from_exec,
    write_file_commands,
)
from rollwise.sandbox.process import Capture

LIMITS = SandboxLimits(timeout_s=5, cpu_s=3, memory_bytes=512 * 2**20, max_processes=32)


def test_pod_spec_is_locked_down_and_limited():
    cfg = KubernetesConfig(namespace="rl", image="python:3.12-slim", cpu="500m", runtime_class_name="gvisor",
                           host_users=False, labels={"team": "rl"})
    pod = build_pod_spec("rollwise-sandbox-abc", "abc", cfg, LIMITS)
    spec, (container,) = pod["spec"], pod["spec"]["containers"]
    assert pod["metadata"]["namespace"] == "rl"
    assert pod["metadata"]["labels"] == {"team": "rl", "app.kubernetes.io/managed-by": "rollwise",
                                         "rollwise.io/sandbox": "true", "rollwise.io/sandbox-id": "abc"}
    assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False
    assert not spec["hostNetwork"] and not spec["hostPID"] and not spec["hostIPC"]
    assert spec["restartPolicy"] == "Never" and spec["activeDeadlineSeconds"] == cfg.lifetime_s
    assert spec["hostUsers"] is False and spec["runtimeClassName"] == "gvisor"
    assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] == 65534
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container["securityContext"]
    assert sc == {"privileged": False, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                  "capabilities": {"drop": ["ALL"]}}
    assert container["resources"]["limits"] == {"cpu": "500m", "memory": "512Mi", "ephemeral-storage": "2Gi"}
    assert container["resources"]["requests"] == container["resources"]["limits"]
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/workspace", "/tmp"}
    assert {v["name"]: v["emptyDir"]["sizeLimit"] for v in spec["volumes"]} == {"workspace": "1Gi", "tmp": "256Mi"}
    default = build_pod_spec("p", "x", KubernetesConfig(), LIMITS)["spec"]
    assert "hostUsers" not in default and "runtimeClassName" not in default


def test_network_policy_denies_everything_for_sandbox_pods():
    pol = build_network_policy("rl")
    assert pol["kind"] == "NetworkPolicy" and pol["metadata"]["namespace"] == "rl"
    assert pol["spec"]["podSelector"] == {"matchLabels": {"rollwise.io/sandbox": "true"}}
    assert pol["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert "ingress" not in pol["spec"] and "egress" not in pol["spec"]  # no rule = nothing allowed


@pytest.mark.skipif(not (shutil.which("timeout") and shutil.which("prlimit")), reason="needs coreutils + util-linux")
def test_exec_command_applies_rlimits_and_kills_on_timeout():
    argv = build_exec_command("ulimit -v; ulimit -n; echo \"$0 $1\"", LIMITS, 5)
    out = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
    assert out.returncode == 0
    assert out.stdout.split("\n")[:2] == [str(512 * 1024), "256"]  # KiB of address space, open files
    slow = subprocess.run(build_exec_command("sleep 30", LIMITS, 0.5), capture_output=True, check=False, timeout=30)
    assert slow.returncode in (137, -9)  # timeout -s KILL kills its group, itself included
    r = result_from_exec("sleep 30", 137, Capture.new(64), Capture.new(64), 0.51, 0.5, False)
    assert r.killed and r.limit == "timeout" and r.exit_code is None
    r = result_from_exec("false", 1, Capture.new(64), Capture.new(64), 0.01, 0.5, False)
    assert not r.killed and r.exit_code == 1


def test_file_and_list_commands_work_in_a_real_shell():
    data = bytes(range(256)) * 500  # > one chunk, all byte values
    with LocalSandbox(LIMITS) as sb:
        for cmd in write_file_commands("sub dir/blob.bin", data):
            assert sb.run(cmd).ok
        assert sb.read_file("sub dir/blob.bin") == data
        sb.run("echo hi > .hidden && ln -s .hidden link && mkdir empty")
        listed = parse_list(sb.run(LIST_COMMAND.format(path=".")).stdout, ".")
        assert [(f.path, f.kind) for f in listed] == [
            (".hidden", "file"), ("empty", "dir"), ("link", "symlink"), ("sub dir", "dir")]
        inner = parse_list(sb.run(LIST_COMMAND.format(path="'sub dir'")).stdout, "sub dir")
        assert [(f.path, f.size) for f in inner] == [("sub dir/blob.bin", len(data))]


def test_client_is_optional_and_its_absence_is_explained():
    # This module imported without the client; creating a sandbox without it says what to install.
    if importlib.util.find_spec("kubernetes") is not None:
        pytest.skip("the kubernetes client is installed here")
    assert "kubernetes" not in sys.modules
    with pytest.raises(SandboxError, match=r"pip install -e \"\.\[kubernetes\]\""):
        KubernetesSandbox(LIMITS)
    with pytest.raises(ValueError):
        KubernetesConfig(lifetime_s=5)
