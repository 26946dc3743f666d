"""The Pod Security Standards' "restricted" profile (Kubernetes 1.33), as Pod Security Admission checks a pod spec.

Each rule is the admission check of that name (k8s.io/pod-security-admission/policy): the baseline rules, then
restricted's volume types, privilege escalation, non-root, seccomp and capabilities. Specs are camelCase, as
the API server sees them.
"""

from __future__ import annotations

RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
BASELINE_CAPABILITIES = {
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}


def _containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec.get("containers", []) + spec.get("ephemeralContainers", [])


def restricted_violations(spec: dict) -> list[str]:
    """The "restricted" rules a pod spec breaks, one message per container and rule (empty: admitted)."""
    errors = []
    pod = spec.get("securityContext") or {}
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            errors.append(f"host namespaces: {field}")
    for volume in spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            errors.append(f"volume types: {volume['name']} is {sorted(kinds)}")
    for sysctl in pod.get("sysctls", []):
        if sysctl["name"] not in SAFE_SYSCTLS:
            errors.append(f"sysctls: {sysctl['name']}")
    if pod.get("runAsUser") == 0:
        errors.append("runAsUser: pod runs as uid 0")
    pod_seccomp = (pod.get("seccompProfile") or {}).get("type")
    if pod_seccomp == "Unconfined":
        errors.append("seccompProfile: pod is Unconfined")
    for container in _containers(spec):
        name = container["name"]
        context = container.get("securityContext") or {}
        capabilities = context.get("capabilities") or {}
        if context.get("privileged"):
            errors.append(f"privileged: {name}")
        if any(port.get("hostPort") for port in container.get("ports", [])):
            errors.append(f"host ports: {name}")
        if context.get("procMount") not in (None, "Default"):
            errors.append(f"procMount: {name}")
        if context.get("allowPrivilegeEscalation") is not False:
            errors.append(f"allowPrivilegeEscalation != false: {name}")
        non_root = context.get("runAsNonRoot", pod.get("runAsNonRoot"))
        if non_root is not True:
            errors.append(f"runAsNonRoot != true: {name}")
        if context.get("runAsUser") == 0:
            errors.append(f"runAsUser: {name} runs as uid 0")
        seccomp = (context.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in ("RuntimeDefault", "Localhost"):
            errors.append(f"seccompProfile not RuntimeDefault or Localhost: {name}")
        if "ALL" not in capabilities.get("drop", []):
            errors.append(f"capabilities must drop ALL: {name}")
        added = set(capabilities.get("add", []))
        if added - {"NET_BIND_SERVICE"}:
            errors.append(f"capabilities added: {name} {sorted(added - {'NET_BIND_SERVICE'})}")
        if added - BASELINE_CAPABILITIES:
            errors.append(f"capabilities beyond baseline: {name}")
    return errors
