"""Every pod the operator builds (syncer with its standby, sharded, TLS or not, with a data volume; learner pods on
CPU, GPU and TPU, one or several per unit, with a state PVC or an emptyDir) meets Pod Security's `restricted` profile
and has a read-only root with one writable scratch directory. The real apiserver's admission of these pods is tested
in test_operator_pod_security_cluster.py; this is the pure side, over every variant of the builders."""

from __future__ import annotations

import pytest

from diloco_operator.api import models as api
from diloco_operator.objects import builders as objects, podsecurity

JOB = {"apiVersion": api.API_VERSION, "kind": "DilocoJob",
       "metadata": {"name": "demo", "namespace": "ns", "uid": "u-1", "generation": 1}}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
DATA = {"mountPath": "/data", "persistentVolumeClaim": {"claimName": "tokens"}}


def restricted_violations(pod_spec: dict) -> list[str]:
    """What Pod Security's `restricted` profile (v1.36) would refuse in `pod_spec`, plus this project's own rule of a
    read-only root with the scratch volume at /tmp."""
    out: list[str] = []
    pod_ctx = pod_spec.get("securityContext", {})
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(key):
            out.append(key)
    for vol in pod_spec.get("volumes", []):
        kinds = set(vol) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"volume {vol['name']}: {sorted(kinds)}")
    for c in pod_spec.get("initContainers", []) + pod_spec["containers"]:
        ctx, name = c.get("securityContext", {}), c["name"]
        if ctx.get("privileged"):
            out.append(f"{name}: privileged")
        if ctx.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation")
        if ctx.get("capabilities", {}).get("drop") != ["ALL"] or set(ctx.get("capabilities", {}).get("add", [])) - \
                {"NET_BIND_SERVICE"}:
            out.append(f"{name}: capabilities")
        if not ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")) or ctx.get("runAsUser", pod_ctx.get("runAsUser")) == 0:
            out.append(f"{name}: runAsNonRoot")
        if ctx.get("seccompProfile", pod_ctx.get("seccompProfile", {})).get("type") not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{name}: hostPort")
        if ctx.get("readOnlyRootFilesystem") is not True:
            out.append(f"{name}: readOnlyRootFilesystem")
        tmp = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/tmp"]
        if len(tmp) != 1 or {"name": tmp[0]["name"], "emptyDir": {}} not in pod_spec["volumes"]:
            out.append(f"{name}: /tmp is not one writable emptyDir")
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        if env.get("HOME") != "/tmp" or env.get("TMPDIR") != "/tmp":
            out.append(f"{name}: HOME/TMPDIR not in the scratch directory")
    return out


def job_spec(**kw) -> api.DilocoJobSpec:
    return api.DilocoJobSpec.model_validate({"image": "img:1", "units": [{"name": "cpu"}], **kw})


def syncer_pod_specs() -> dict[str, dict]:
    variants = {
        "tls+standby": (job_spec(), 0),
        "no tls, no standby": (job_spec(syncer={"tls": {"mode": "Disabled"}, "standby": False}), 0),
        "data volume": (job_spec(data=DATA), 0),
        "shard 2 of 3": (job_spec(config={"outer": {"fragments": 4}, "syncer": {"shards": 3}}), 2),
    }
    return {name: objects.syncer_deployment(JOB, spec, tls_hash="h", shard=shard)["spec"]["template"]["spec"]
            for name, (spec, shard) in variants.items()}


def learner_pod_specs() -> dict[str, dict]:
    templates = {
        "cpu, emptyDir": {"name": "cpu"},
        "cpu, state PVC, data": {"name": "cpu", "stateVolume": {"size": "1Gi"}},
        "gpu, 2 pods": {"name": "gpu", "podsPerUnit": 2, "accelerator": {"type": "nvidia-h100-80gb", "count": 8}},
        "tpu, 2 pods": {"name": "tpu", "podsPerUnit": 2,
                        "accelerator": {"type": "tpu-v5-lite-podslice", "count": 4, "topology": "2x4"}},
    }
    out = {}
    for name, template in templates.items():
        spec = job_spec(units=[template], **({"data": DATA} if "data" in name else {}))
        unit = objects.learner_unit(JOB, objects.unit_spec("demo", spec, spec.units[0], 0, 0))
        unit["metadata"]["uid"] = "lu-1"
        for rank in range(spec.units[0].podsPerUnit):
            out[f"{name}, rank {rank}"] = objects.unit_pod(unit, 0, rank)["spec"]
    return out


@pytest.mark.parametrize("variant", list(syncer_pod_specs()))
def test_every_syncer_pod_variant_meets_the_restricted_profile_with_a_read_only_root(variant):
    pod_spec = syncer_pod_specs()[variant]
    assert restricted_violations(pod_spec) == []
    ctx = pod_spec["securityContext"]
    assert ctx["runAsUser"] == ctx["runAsGroup"] == ctx["fsGroup"] == 10001, "the checkpoint PVC must be writable"


@pytest.mark.parametrize("variant", list(learner_pod_specs()))
def test_every_learner_pod_variant_meets_the_restricted_profile_with_a_read_only_root(variant):
    pod_spec = learner_pod_specs()[variant]
    assert restricted_violations(pod_spec) == []
    assert pod_spec["securityContext"]["runAsUser"] == 10001
    # fsGroup on every learner: the token file (mode 0440, root-owned) is readable through the image's group only.
    assert pod_spec["securityContext"]["fsGroup"] == 10001


def test_the_standby_and_its_syncer_each_mount_the_scratch_volume_once():
    pod = objects.syncer_deployment(JOB, job_spec())["spec"]["template"]["spec"]
    syncer, standby = pod["containers"]
    for c in (syncer, standby):
        assert [m["mountPath"] for m in c["volumeMounts"]].count("/tmp") == 1, c["volumeMounts"]
        assert [e["name"] for e in c["env"]].count("HOME") == 1
    assert [v["name"] for v in pod["volumes"]].count(podsecurity.SCRATCH_VOLUME) == 1


def test_harden_covers_init_containers_and_keeps_what_a_pod_already_sets():
    pod_spec = {"securityContext": {"supplementalGroups": [5]},
                "initContainers": [{"name": "init", "env": [{"name": "HOME", "value": "/home/x"}]}],
                "containers": [{"name": "main"}], "volumes": [{"name": "v", "configMap": {"name": "c"}}]}
    podsecurity.harden(pod_spec)
    assert pod_spec["securityContext"]["supplementalGroups"] == [5] and "fsGroup" not in pod_spec["securityContext"]
    assert pod_spec["initContainers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "HOME", "value": "/home/x"} in pod_spec["initContainers"][0]["env"]
    assert [e["name"] for e in pod_spec["initContainers"][0]["env"]].count("HOME") == 1
    assert restricted_violations({**pod_spec, "initContainers": []}) == []


def test_the_checker_sees_what_an_unhardened_pod_lacks():
    # The check above must be able to fail: a bare pod breaks every rule it knows.
    bare = {"containers": [{"name": "c"}], "volumes": [{"name": "h", "hostPath": {"path": "/"}}], "hostNetwork": True}
    found = restricted_violations(bare)
    for rule in ("hostNetwork", "volume h", "allowPrivilegeEscalation", "capabilities", "runAsNonRoot",
                 "seccompProfile", "readOnlyRootFilesystem", "/tmp", "HOME"):
        assert any(rule in v for v in found), (rule, found)


def _token_mount(container: dict, pod_spec: dict) -> tuple[str, dict]:
    """The path --token-file reads and the Secret volume mounted there, checked for the shape every pod must have."""
    cmd = container["command"]
    path = cmd[cmd.index("--token-file") + 1]
    (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod_spec["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["defaultMode"] == 0o440 and volume["secret"]["items"] == [{"key": "token",
                                                                                       "path": "token"}]
    assert path == f"{mount['mountPath']}/token"
    return path, volume["secret"]


@pytest.mark.parametrize("variant", [*(f"syncer: {v}" for v in syncer_pod_specs()),
                                     *(f"learner: {v}" for v in learner_pod_specs())])
def test_no_pod_holds_a_token_in_its_environment_only_as_a_read_only_file_of_mode_0440(variant):
    kind, name = variant.split(": ", 1)
    pod_spec = (syncer_pod_specs() if kind == "syncer" else learner_pod_specs())[name]
    for container in pod_spec["containers"]:  # the syncer's standby too
        assert not any("valueFrom" in e or "TOKEN" in e["name"] for e in container.get("env", [])), container["env"]
        assert "--token-env" not in container["command"]
        path, secret = _token_mount(container, pod_spec)
        # The syncer reads the job's token; a learner only its own unit's (never the job's).
        assert secret["secretName"] == ("demo-token" if kind == "syncer" else "demo-cpu-0-learner-token"
                                        if name.startswith("cpu") else f"demo-{name[:3]}-0-learner-token")
        assert pod_spec["securityContext"]["fsGroup"] == podsecurity.IMAGE_GID, "the group that may read 0440"
